"""What a new user meets first, against the session's live swarm of three daemons: sampling
without a seed says something new each time (through `peerd generate`, the OpenAI API and the
v2 WebSocket of the gateway), with a seed the same thing; `peerd chat` recalls earlier
questions with the up arrow, within a run and in the next one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pexpect
import pytest
import uvicorn
from websockets.sync.client import connect as ws_connect

from peerd.devtools.localswarm import ROOT, LocalSwarm
from peerd.gateway import create_app
from peerd.gateway.app import uvicorn_config

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

PROMPT = "Once upon a time"
NEW_TOKENS = 24
UP_ARROW = "\x1b[A"


@pytest.fixture(scope="module")
def gateway_url(swarm: LocalSwarm) -> Iterator[str]:
    """The gateway on uvicorn in a thread, in front of daemon a."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    app = create_app(swarm.daemons[0].socket)
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start in 60 s"
        time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def _cli_generate(swarm: LocalSwarm, *flags: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "cli", "generate", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
         "--do-sample", "--socket", str(swarm.daemons[1].socket), *flags],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT,
    )  # fmt: skip
    return run.stdout


def _openai(url: str, **extra: object) -> str:
    body = {"model": "default", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 1.0}
    reply = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=120)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def _websocket(url: str, **extra: object) -> str:
    """One answer over chat.petals.dev's v2 API, sampled as the web chat asks for it."""
    with ws_connect(url.replace("http://", "ws://") + "/api/v2/generate") as ws:
        ws.send(json.dumps({"type": "open_inference_session", "max_length": 128}))
        assert json.loads(ws.recv(timeout=60))["ok"]
        request = {"type": "generate", "inputs": PROMPT, "max_new_tokens": NEW_TOKENS,
                   "do_sample": 1, "temperature": 1.0, **extra}  # fmt: skip
        ws.send(json.dumps(request))
        reply = json.loads(ws.recv(timeout=120))
        assert reply["ok"], reply
        return str(reply["outputs"])


def test_sampling_without_a_seed_differs_and_with_one_repeats(
    swarm: LocalSwarm, gateway_url: str
) -> None:
    """Two unseeded answers of 24 tokens at temperature 1 agree only if the random source
    repeats; each way in gets one pair without a seed, the API ways one pair with a seed."""
    assert _cli_generate(swarm) != _cli_generate(swarm)
    assert _openai(gateway_url) != _openai(gateway_url)
    assert _websocket(gateway_url) != _websocket(gateway_url)
    assert _openai(gateway_url, seed=11) == _openai(gateway_url, seed=11)
    assert _websocket(gateway_url, seed=11) == _websocket(gateway_url, seed=11)


def _chat(swarm: LocalSwarm, state: Path) -> pexpect.spawn:
    chat = pexpect.spawn(
        sys.executable,
        ["-m", "cli", "chat", "--socket", str(swarm.daemons[0].socket), "--max-new-tokens", "3"],
        encoding="utf-8",
        timeout=120,
        cwd=str(ROOT),
        env={**os.environ, "PEERD_STATE_DIR": str(state), "TERM": "xterm"},
    )
    chat.expect(">>> ")
    return chat


def test_chat_recalls_earlier_questions_with_the_up_arrow(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    question = "What is the capital of France?"
    chat = _chat(swarm, tmp_path)
    try:
        chat.sendline(question)
        chat.expect(r"\[\d+ tokens")
        chat.expect(">>> ")
        chat.send(UP_ARROW)
        chat.expect_exact(question)  # recalled onto the line, ready to send again
        chat.sendline("")
        chat.expect(r"\[\d+ tokens")  # and sent: a second answer
        chat.expect(">>> ")
        chat.sendeof()
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)
    assert (tmp_path / "chat_history").stat().st_mode & 0o777 == 0o600
    again = _chat(swarm, tmp_path)  # the next run remembers
    try:
        again.send(UP_ARROW)
        again.expect_exact(question)
    finally:
        again.close(force=True)


def test_the_web_chat_links_to_the_swarm_page(gateway_url: str) -> None:
    page = httpx.get(f"{gateway_url}/", timeout=30)
    assert page.status_code == 200 and 'href="/swarm"' in page.text
    assert httpx.get(f"{gateway_url}/swarm", timeout=30).status_code == 200
