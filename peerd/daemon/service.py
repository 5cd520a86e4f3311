"""`peerd service`: a systemd unit (and its environment file) that keeps `peerd start ...` running.

`unit_text` is a pure function of a `ServiceSpec`, so the unit is unit-tested and checked with
`systemd-analyze verify` without touching /etc. The unit restarts a crashed daemon with backoff,
stops it with SIGTERM (the daemon drains its sessions first, peerd/daemon/main.py), logs to the
journal,
and keeps identity, model cache and socket in the directories systemd creates for the service
(StateDirectory, CacheDirectory, RuntimeDirectory), named to peerd by PEERD_STATE_DIR,
PEERD_CACHE_DIR and PEERD_RUNTIME_DIR.
"""

from __future__ import annotations

import getpass
import math
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

NAME = "peerd"
# The daemon drains for up to --drain-timeout (30 s by default, peerd/daemon/main.py
# DRAIN_DEADLINE_S) on SIGTERM, then gives the rest 5 s to close; systemd must not SIGKILL it
# before that, so TimeoutStopSec is the drain deadline plus this margin.
DEFAULT_DRAIN_S = 30.0
STOP_MARGIN_S = 30
# Backoff: wait this long before a restart, and give up (until `systemctl restart`) after
# START_LIMIT_BURST failed starts in START_LIMIT_INTERVAL_S: a daemon that cannot start
# (a bad flag, a port in use) must not spin.
RESTART_SEC = 10
START_LIMIT_INTERVAL_S = 600
START_LIMIT_BURST = 5
# `peerd start` exits 2 for a setting it cannot start with: restarting would not help.
CONFIG_ERROR_STATUS = 2


class ServiceError(Exception):
    """The unit cannot be written as asked; the message says what to change."""


@dataclass(frozen=True)
class ServiceSpec:
    """What the unit runs and for whom."""

    start_args: tuple[str, ...]
    """Arguments after `peerd start`."""
    user: bool = False
    """A user unit (`systemctl --user`) instead of a system one."""
    command: tuple[str, ...] = ()
    """How to run peerd: default `default_command()`."""
    run_as: str | None = None
    """System units: the account that runs the daemon (None: root, sandboxed)."""
    env_file: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)


def default_command() -> tuple[str, ...]:
    """The `peerd` script of this installation, else this Python running the cli module."""
    script = Path(sys.executable).parent / "peerd"
    if script.exists():
        return (str(script),)
    return (sys.executable, "-m", "cli")


def unit_dir(user: bool) -> Path:
    if user:
        base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        return Path(base) / "systemd" / "user"
    return Path("/etc/systemd/system")


def env_file_path(user: bool) -> Path:
    if user:
        base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        return Path(base) / "peerd" / "peerd.env"
    return Path("/etc/peerd/peerd.env")


def default_run_as() -> str | None:
    """The person who ran `sudo peerd service install`, else whoever runs it; None for root."""
    name = os.environ.get("SUDO_USER") or getpass.getuser()
    return None if name == "root" else name


def check_start_args(args: tuple[str, ...]) -> None:
    """Refuse what `peerd start` would refuse at once, so the unit does not restart-loop."""
    joined = " ".join(args)
    if not {"--new-swarm", "--mdns"} & set(args) and "--initial-peers" not in joined:
        raise ServiceError(
            "the service needs to know its swarm: add `-- --initial-peers MULTIADDR` (or "
            "`-- --new-swarm`, or `-- --mdns`) after `peerd service install`"
        )


def stop_timeout(args: tuple[str, ...]) -> int:
    """TimeoutStopSec for a daemon started with `args`: its drain deadline plus a margin."""
    drain = DEFAULT_DRAIN_S
    for i, arg in enumerate(args):
        value = None
        if arg == "--drain-timeout" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--drain-timeout="):
            value = arg.partition("=")[2]
        if value is not None:
            try:
                drain = float(value)
            except ValueError:
                raise ServiceError(f"--drain-timeout {value}: expected seconds") from None
    return math.ceil(drain) + STOP_MARGIN_S


def _quote(arg: str, specifiers: bool = False) -> str:
    """One ExecStart word: systemd expands % specifiers and $ variables, so double them (unless
    the word means to use specifiers, like %S), and quote words with spaces or quotes the way
    systemd unquotes them (C-style)."""
    if not specifiers:
        arg = arg.replace("%", "%%")
    arg = arg.replace("$", "$$")
    if arg and not any(c in arg for c in " \t\"'\\;"):
        return arg
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def exec_start(spec: ServiceSpec) -> list[str]:
    """The daemon's command line, as ExecStart runs it."""
    return [*(spec.command or default_command()), "start", *spec.start_args]


def service_env(user: bool) -> dict[str, str]:
    """Where the daemon keeps its files under the unit: systemd's own directories (%S state,
    %C cache, %t runtime), which it creates, owns to the service and makes writable through
    ProtectSystem=strict."""
    del user  # the specifiers resolve to per-user or system paths by themselves
    return {
        "PEERD_STATE_DIR": f"%S/{NAME}",
        "PEERD_CACHE_DIR": f"%C/{NAME}",
        "PEERD_RUNTIME_DIR": f"%t/{NAME}",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _sandbox(spec: ServiceSpec) -> list[str]:
    lines = ["NoNewPrivileges=yes", "UMask=0077"]
    if spec.user:
        # A user manager may lack the user namespaces most sandboxing needs: keep to what
        # always works, rather than a unit that fails to start on some distributions.
        return lines
    # The installation (virtualenv, checkout) may live in a home directory: keep it readable.
    home_install = any(
        str(Path(p).resolve()).startswith(("/home/", "/root/")) for p in exec_start(spec)[:1]
    ) or str(Path(sys.prefix).resolve()).startswith(("/home/", "/root/"))
    lines += [
        "ProtectSystem=strict",
        f"ProtectHome={'read-only' if home_install else 'yes'}",
        "PrivateTmp=yes",
        # No PrivateDevices: a GPU server needs /dev/nvidia*.
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "RestrictSUIDSGID=yes",
        "RestrictRealtime=yes",
        "RestrictNamespaces=yes",
        "LockPersonality=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
    ]
    return lines


def unit_text(spec: ServiceSpec) -> str:
    """The systemd unit for `spec`."""
    check_start_args(spec.start_args)
    env = {**service_env(spec.user), **spec.extra_env}
    env_file = spec.env_file or env_file_path(spec.user)
    lines = [
        f"# Written by `peerd service install{' --user' if spec.user else ''}`; "
        "edit the environment file, not this unit,",
        "# or re-run the install with other start arguments.",
        "[Unit]",
        "Description=peerd: serve blocks of a language model to a peerd swarm",
        "Documentation=https://github.com/peerd/peerd/blob/main/docs/operations.md",
        "After=network-online.target",
        "Wants=network-online.target",
        f"StartLimitIntervalSec={START_LIMIT_INTERVAL_S}",
        f"StartLimitBurst={START_LIMIT_BURST}",
        "",
        "[Service]",
        "Type=exec",
        f"EnvironmentFile=-{env_file}",
        *(f"Environment={_quote(f'{k}={v}', specifiers=True)}" for k, v in env.items()),
        "ExecStart=" + " ".join(_quote(a) for a in exec_start(spec)),
        "Restart=on-failure",
        f"RestartSec={RESTART_SEC}",
        f"RestartPreventExitStatus={CONFIG_ERROR_STATUS}",
        # SIGTERM to the daemon only: it drains, then ends its own worker threads.
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        f"TimeoutStopSec={stop_timeout(spec.start_args)}",
        "StandardOutput=journal",
        "StandardError=journal",
        f"SyslogIdentifier={NAME}",
        f"StateDirectory={NAME}",
        f"CacheDirectory={NAME}",
        f"RuntimeDirectory={NAME}",
        "StateDirectoryMode=0700",
        "CacheDirectoryMode=0700",
        "RuntimeDirectoryMode=0700",
    ]
    if not spec.user and spec.run_as:
        lines.append(f"User={spec.run_as}")
    lines += _sandbox(spec)
    lines += ["", "[Install]", f"WantedBy={'default.target' if spec.user else 'multi-user.target'}"]
    return "\n".join(lines) + "\n"


def env_text(spec: ServiceSpec) -> str:
    """The environment file: a place for the operator's own settings, read before each start."""
    socket = f"$XDG_RUNTIME_DIR/{NAME}/peerd.sock" if spec.user else f"/run/{NAME}/peerd.sock"
    return (
        "# Environment of the peerd service (KEY=value lines), read at every start.\n"
        "# Examples:\n"
        "# HF_HUB_OFFLINE=1\n"
        "# OMP_NUM_THREADS=4\n"
        f"# Local programs reach this daemon with PEERD_SOCKET={socket}\n"
    )


@dataclass(frozen=True)
class Installed:
    unit: Path
    env_file: Path
    enable_hint: str


def _systemctl(user: bool, *args: str) -> None:
    """Best effort: no systemd running (a container, a build machine) is not an error here."""
    if shutil.which("systemctl") is None:
        return
    command = ["systemctl", *(["--user"] if user else []), *args]
    subprocess.run(command, check=False, capture_output=True, timeout=30)


def install(spec: ServiceSpec, directory: Path | None = None, reload: bool = True) -> Installed:
    """Write the unit (and the environment file if there is none) and reload systemd."""
    unit = (directory or unit_dir(spec.user)) / f"{NAME}.service"
    env_file = spec.env_file or env_file_path(spec.user)
    text = unit_text(spec)
    try:
        unit.parent.mkdir(parents=True, exist_ok=True)
        unit.write_text(text)
        if not env_file.exists():
            env_file.parent.mkdir(parents=True, exist_ok=True)
            env_file.write_text(env_text(spec))
            env_file.chmod(0o600)
    except PermissionError as e:
        raise ServiceError(
            f"cannot write {e.filename}: install a system unit with sudo, or a unit of your "
            "own with --user"
        ) from None
    if reload:
        _systemctl(spec.user, "daemon-reload")
    hint = f"systemctl {'--user ' if spec.user else ''}enable --now {NAME}"
    return Installed(unit, env_file, hint)


def uninstall(user: bool, directory: Path | None = None, reload: bool = True) -> Path | None:
    """Stop and disable the service and remove its unit; the environment file, identity and
    cache stay (a re-install keeps the same peer id). None if no unit was installed."""
    unit = (directory or unit_dir(user)) / f"{NAME}.service"
    if not unit.exists():
        return None
    if reload:
        _systemctl(user, "disable", "--now", NAME)
    unit.unlink()
    if reload:
        _systemctl(user, "daemon-reload")
    return unit


def parse_exec_start(unit: str) -> list[str]:
    """The argv of a unit's ExecStart (for tests and `--print` users): systemd's quoting is
    close enough to the shell's for what `_quote` writes."""
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    words = shlex.split(line.removeprefix("ExecStart="))
    return [w.replace("%%", "%").replace("$$", "$") for w in words]
