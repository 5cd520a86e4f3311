"""`peerd gateway` end to end: a live swarm of three `peerd start` daemons (blocks 0:10, 10:20,
20:30) and the gateway on uvicorn in a thread, driven through chat.petals.dev's v1 HTTP and v2
WebSocket APIs, the official `openai` client, and the web page in headless Chromium.

The browser test runs last: it ends by stopping the server of blocks 20:30 to see the page say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
import websockets
from openai.types.chat import ChatCompletionMessageParam
from starlette.applications import Starlette
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as ws_connect
from websockets.typing import Origin

from peerd.devtools.localswarm import LocalSwarm
from peerd.gateway import create_app
from peerd.gateway.app import uvicorn_config
from peerd.gateway.bodies import MAX_BODY_BYTES
from peerd.gateway.guard import Exposure
from peerd.sdk.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
QUESTION = "What is the capital of France?"
CACHE_TOKENS = 16384
CACHE = ("--cache-tokens", str(CACHE_TOKENS))


@dataclass
class Gateway:
    url: str
    swarm: LocalSwarm

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/api/v2/generate"

    @property
    def socket(self) -> Path:
        return self.swarm.daemons[0].socket

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = httpx.get(f"{self.url}/api/status", timeout=30).json()
        return status


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting until {what}")
        time.sleep(0.2)


@contextlib.contextmanager
def served(app: Starlette) -> Iterator[str]:
    """`app` on uvicorn in a thread, on a free port of 127.0.0.1; yields its URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 60, "uvicorn started")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    swarm = LocalSwarm()
    try:
        swarm.start("a", "0:10", *CACHE)
        with ThreadPoolExecutor(2) as pool:  # b and c only need a to join: start them together
            for started in [
                pool.submit(swarm.start, n, b, *CACHE) for n, b in (("b", "10:20"), ("c", "20:30"))
            ]:
                started.result()
        with served(create_app(swarm.daemons[0].socket)) as url:
            running = Gateway(url, swarm)
            wait_until(
                lambda: running.status()["missing_blocks"] == [], 30, "the daemon sees every block"
            )
            yield running
    finally:
        swarm.stop()


def daemon_reference(gateway: Gateway, prompt: str, **options: Any) -> str:
    with Client(gateway.socket) as client:
        return str(client.generate(prompt, **options))


# --- chat.petals.dev v1 ---------------------------------------------------------------------


def test_v1_generate_takes_form_and_json(gateway: Gateway) -> None:
    url = f"{gateway.url}/api/v1/generate"
    expected = daemon_reference(gateway, "The capital of France is", max_new_tokens=6)
    form = httpx.post(
        url, data={"inputs": "The capital of France is", "max_new_tokens": "6"}, timeout=60
    )
    assert form.status_code == 200
    assert form.json() == {"ok": True, "outputs": expected}
    # max_length counts the inputs, as in transformers: 5 input tokens + 6 new ones.
    body = {"model": "smollm2-135m-instruct", "inputs": "The capital of France is"}
    as_json = httpx.post(
        url, json={**body, "max_length": 11, "do_sample": 0, "top_k": 5}, timeout=60
    )
    assert as_json.json() == {"ok": True, "outputs": expected}
    sampled = httpx.post(
        url,
        json={**body, "max_new_tokens": 4, "do_sample": 1, "temperature": 0.8, "top_p": 0.9},
        timeout=60,
    ).json()
    assert sampled["ok"] and isinstance(sampled["outputs"], str)

    missing = httpx.post(url, data={"inputs": "hi"})
    assert missing.status_code == 400
    assert missing.json()["ok"] is False and "max_new_tokens" in missing.json()["traceback"]
    bad = httpx.post(url, data={"inputs": "hi", "max_new_tokens": "many"})
    assert bad.status_code == 400 and "max_new_tokens" in bad.json()["traceback"]
    other = httpx.post(url, json={"model": "bigscience/bloom", "inputs": "hi", "max_new_tokens": 1})
    assert other.status_code == 404 and other.json()["ok"] is False


# --- chat.petals.dev v2 ---------------------------------------------------------------------


def receive_turn(ws: ClientConnection) -> tuple[str, list[dict[str, Any]]]:
    """Messages of one generate request, up to the one with stop: true (or an error)."""
    messages = []
    while True:
        message = json.loads(ws.recv(timeout=120))
        messages.append(message)
        if not message["ok"] or message["stop"]:
            return "".join(m.get("outputs", "") for m in messages), messages


def test_v2_session_streams_pieces_like_chat_petals_dev(gateway: Gateway) -> None:
    turn = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    with ws_connect(gateway.ws_url) as ws:
        ws.send(
            json.dumps({"type": "open_inference_session", "model": "default", "max_length": 512})
        )
        assert json.loads(ws.recv(timeout=60)) == {"ok": True}
        # chat.petals.dev's own page: one token per step, until the stop sequence.
        request = {
            "type": "generate",
            "inputs": turn.format(QUESTION),
            "max_new_tokens": 1,
            "stop_sequence": "<|im_end|>",
            "extra_stop_sequences": ["\nUser:"],
        }
        ws.send(json.dumps(request))
        answer, messages = receive_turn(ws)
        assert all(m["ok"] for m in messages)
        assert len(messages) > 3 and [m["stop"] for m in messages][-1] is True
        assert "Paris" in answer
        assert all(m["token_count"] >= 0 for m in messages)
        streamed_tokens = sum(m["token_count"] for m in messages)

        # Without a stop sequence: one answer of max_new_tokens, continuing the same session
        # (only this turn's tokens travel; the servers' caches hold the first turn).
        ws.send(
            json.dumps(
                {"type": "generate", "inputs": turn.format("And of Italy?"), "max_new_tokens": 12}
            )
        )
        answer2, messages2 = receive_turn(ws)
        assert len(messages2) == 1 and messages2[0]["ok"] and messages2[0]["token_count"] <= 12
        assert "Rome" in answer2

        # A malformed message is refused; the session goes on.
        ws.send("{not json")
        refused = json.loads(ws.recv(timeout=30))
        assert refused["ok"] is False and "JSON" in refused["traceback"]
        ws.send(json.dumps({"type": "generate", "inputs": "x", "max_new_tokens": 5000}))
        too_long = json.loads(ws.recv(timeout=30))
        assert too_long["ok"] is False and "room for" in too_long["traceback"]
        ws.send(json.dumps({"type": "generate", "max_new_tokens": 2}))  # continue, no inputs
        _, more = receive_turn(ws)
        assert more[-1]["ok"] and more[-1]["token_count"] == 2
    assert streamed_tokens > 3


def test_v2_chat_turns_and_cancel(gateway: Gateway) -> None:
    with ws_connect(gateway.ws_url) as ws:
        ws.send(json.dumps({"type": "open_inference_session", "max_length": 1024}))
        assert json.loads(ws.recv(timeout=60))["ok"]
        common = {"type": "generate", "chat": True, "stream": True, "do_sample": False}
        ws.send(json.dumps({**common, "inputs": QUESTION, "max_new_tokens": 24}))
        answer, messages = receive_turn(ws)
        assert "Paris" in answer and messages[-1]["reason"] == "eos"
        assert len(messages) > 2  # streamed piece by piece

        ws.send(
            json.dumps(
                {**common, "inputs": "Write a long story about a cat.", "max_new_tokens": 300}
            )
        )
        first = json.loads(ws.recv(timeout=60))
        assert first["ok"] and not first["stop"]
        ws.send(json.dumps({"type": "cancel"}))
        _, rest = receive_turn(ws)
        assert rest[-1]["reason"] == "cancelled" and len(rest) < 100

        # The session survives a cancel: the next turn still answers.
        ws.send(json.dumps({**common, "inputs": "Thanks! What is 2+2?", "max_new_tokens": 16}))
        answer3, messages3 = receive_turn(ws)
        assert messages3[-1]["ok"] and answer3.strip()


def test_v2_refuses_bad_openings(gateway: Gateway) -> None:
    for opening, status in [
        ({"type": "generate", "inputs": "hi"}, "open_inference_session"),
        ({"type": "open_inference_session", "max_length": 10**6}, "context"),
        ({"type": "open_inference_session", "model": "gpt-4", "max_length": 64}, "gpt-4"),
    ]:
        with ws_connect(gateway.ws_url) as ws:
            ws.send(json.dumps(opening))
            reply = json.loads(ws.recv(timeout=30))
            assert reply["ok"] is False and status in reply["traceback"], reply
    with ws_connect(gateway.ws_url, max_size=None) as ws:  # past the message limit: 1009
        ws.send("x" * (MAX_BODY_BYTES + 1))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    with pytest.raises(websockets.InvalidStatus):  # other web pages may not use it
        ws_connect(gateway.ws_url, origin=Origin("http://evil.example"))


# --- OpenAI-compatible ----------------------------------------------------------------------


def test_official_openai_client(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="not-needed", max_retries=0)
    model = client.models.list().data[0].id
    assert model == "smollm2-135m-instruct"
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=24,
        temperature=0,
    )
    answer = whole.choices[0].message.content or ""
    assert "Paris" in answer and whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None and whole.usage.prompt_tokens > 10
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(pieces) > 2 and "".join(pieces) == answer
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    counted = client.completions.create(
        model=model, prompt="1, 2, 3, 4,", max_tokens=24, temperature=0, stop=[" 8"]
    )
    text = counted.choices[0].text
    assert text.startswith(" 5, 6, 7,") and "8" not in text
    assert counted.choices[0].finish_reason == "stop"

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=messages)
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.chat.completions.create(model=model, messages=messages, n=2)


def test_http_errors_are_json_and_4xx(gateway: Gateway) -> None:
    chat = f"{gateway.url}/v1/chat/completions"
    as_json = {"content-type": "application/json"}
    huge = httpx.post(chat, content=b"{" + b" " * (MAX_BODY_BYTES + 1) + b"}", headers=as_json)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    garbled = httpx.post(chat, content=b"{nope", headers=as_json)
    assert garbled.status_code == 400 and garbled.json()["error"]["code"] == "invalid_json"
    no_messages = httpx.post(chat, json={"model": "default"})
    assert no_messages.status_code == 400
    assert no_messages.json()["error"]["param"] == "messages"
    hot = httpx.post(chat, json={"messages": [{"role": "user", "content": "x"}], "temperature": 7})
    assert hot.status_code == 400 and "temperature" in hot.json()["error"]["message"]
    tools = httpx.post(
        chat, json={"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}
    )
    assert tools.status_code == 400 and "tools" in tools.json()["error"]["message"]
    long = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "hi", "max_tokens": 100_000})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    nowhere = httpx.get(f"{gateway.url}/v1/engines")
    assert nowhere.status_code == 404 and "error" in nowhere.json()
    session = httpx.post(
        f"{gateway.url}/api/v1/generate",
        data={"inputs": "hi", "max_new_tokens": 1, "session_id": "s"},
    )
    assert session.status_code == 400 and "WebSocket" in session.json()["traceback"]


async def test_no_daemon_is_503_with_what_to_do(tmp_path: Path) -> None:
    app = create_app(tmp_path / "nobody.sock")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        models = await client.get("/v1/models")
        v1 = await client.post("/api/v1/generate", data={"inputs": "hi", "max_new_tokens": 1})
    assert models.status_code == 503 and "peerd start" in models.json()["error"]["message"]
    assert v1.status_code == 503 and "peerd start" in v1.json()["traceback"]


# --- cancellation and cache --------------------------------------------------------------------


def _daemon_status(gateway: Gateway) -> tuple[int, dict[str, int]]:
    """Tokens daemon a's blocks ran, and the free cache tokens of every server (daemon a's own
    record is live; the others' as of daemon a's last refresh, every 2 s)."""
    with Client(gateway.socket) as client:
        status = client.status()
    return status.tokens_served, {r.peer_id: r.free_cache_tokens for r in status.swarm}


def _caches_held(gateway: Gateway) -> bool:
    caches = _daemon_status(gateway)[1]
    return len(caches) == 3 and all(free < CACHE_TOKENS for free in caches.values())


def _caches_free(gateway: Gateway) -> bool:
    caches = _daemon_status(gateway)[1]
    return len(caches) == 3 and all(free == CACHE_TOKENS for free in caches.values())


def _assert_generation_stopped(gateway: Gateway) -> None:
    wait_until(lambda: _caches_free(gateway), 15, "every server frees the session")
    served = _daemon_status(gateway)[0]
    time.sleep(1.0)
    assert _daemon_status(gateway)[0] == served, "blocks still run for a client that left"


def test_disconnect_cancels_generation_and_frees_caches(gateway: Gateway) -> None:
    wait_until(lambda: _caches_free(gateway), 15, "earlier tests' sessions are gone")
    request = {
        "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
        "max_tokens": 1000,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=request, timeout=60) as r:
        assert r.status_code == 200
        events = r.iter_lines()
        for _ in range(3):
            next(line for line in events if line.startswith("data: {"))
        # Every server reserves prompt + 1000 tokens (seen once daemon a refreshes its view).
        wait_until(lambda: _caches_held(gateway), 15, "every server holds the session")
    # The client is gone: the generation stops and every server frees the session's cache.
    _assert_generation_stopped(gateway)

    with ws_connect(gateway.ws_url) as ws:
        ws.send(json.dumps({"type": "open_inference_session", "max_length": 1000}))
        assert json.loads(ws.recv(timeout=60))["ok"]
        story = {"inputs": "Tell a long story.", "chat": True, "max_new_tokens": 500}
        ws.send(json.dumps({"type": "generate", "stream": True, **story}))
        json.loads(ws.recv(timeout=60))
        wait_until(lambda: _caches_held(gateway), 15, "every server holds the session")
    _assert_generation_stopped(gateway)


def test_twenty_concurrent_websocket_sessions(gateway: Gateway) -> None:
    sessions, new_tokens = 20, 5

    async def chat(i: int) -> int:
        async with websockets.connect(gateway.ws_url) as ws:
            await ws.send(json.dumps({"type": "open_inference_session", "max_length": 64}))
            assert json.loads(await ws.recv())["ok"]
            request = {"type": "generate", "inputs": f"{i}, {i + 1},", "max_new_tokens": new_tokens}
            await ws.send(json.dumps({**request, "stream": True}))
            tokens = 0
            while True:
                message = json.loads(await ws.recv())
                assert message["ok"], message
                tokens += message["token_count"]
                if message["stop"]:
                    return tokens

    async def timed(n: int) -> tuple[list[int], float]:
        started = time.perf_counter()
        counts = await asyncio.gather(*(chat(i) for i in range(n)))
        return counts, time.perf_counter() - started

    alone, alone_s = asyncio.run(timed(1))
    counts, elapsed = asyncio.run(timed(sessions))
    assert len(counts) == sessions and all(1 <= n <= new_tokens for n in counts)
    print(
        f"{sessions} concurrent v2 sessions: {sum(counts)} tokens in {elapsed:.1f} s, "
        f"{sum(counts) / elapsed:.1f} tokens/s aggregate (one session alone: "
        f"{sum(alone) / alone_s:.1f} tokens/s, open to last token)"
    )


# --- the web page (last: it stops a server) ------------------------------------------------


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (scripts/setup.sh)")
def test_web_page_asks_for_the_api_key_and_chats_with_it(gateway: Gateway) -> None:
    """A gateway with --api-key: the page gets 401, asks for the key, and sends it (Bearer on
    fetch, a subprotocol on its WebSocket) for the rest of the chat."""
    from playwright.sync_api import Dialog, sync_playwright

    key = "chromium-test-key-0123456789"
    keyed = create_app(gateway.socket, exposure=Exposure(api_key=key))
    with served(keyed) as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            asked: list[str] = []

            def answer(dialog: Dialog) -> None:
                asked.append(dialog.message)
                dialog.accept(key)

            page.on("dialog", answer)
            page.goto(url)
            page.wait_for_function(
                "document.getElementById('swarm').textContent.includes('3 servers')"
            )
            assert len(asked) == 1 and "API key" in asked[0]
            page.evaluate("document.getElementById('max-new-tokens').value = '6'")
            page.fill("#prompt", QUESTION)
            page.press("#prompt", "Enter")
            done = page.wait_for_selector(
                ".message.assistant:not(.streaming) .stats", timeout=90_000
            )
            assert done is not None and "tokens/s" in done.inner_text()
            assert page.inner_text(".message.assistant .text").strip()
            assert len(asked) == 1  # the socket used the stored key
            assert httpx.get(f"{url}/api/status", timeout=30).status_code == 401
        finally:
            browser.close()


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (scripts/setup.sh)")
def test_web_page_streams_an_answer_in_chromium(gateway: Gateway) -> None:
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(gateway.url)
            page.wait_for_function(
                "document.getElementById('swarm').textContent.includes('3 servers')"
            )
            # Record every length the answer takes while it streams.
            page.evaluate(
                """() => {
                    window.lengths = [];
                    new MutationObserver(() => {
                        const text = document.querySelector('.message.assistant.streaming .text');
                        if (text) window.lengths.push(text.textContent.length);
                    }).observe(document.getElementById('messages'),
                               {subtree: true, childList: true, characterData: true});
                }"""
            )
            # Greedy: a sampled answer need not name Paris (the settings sit in a closed panel).
            page.evaluate("document.getElementById('do-sample').checked = false")
            page.fill("#prompt", QUESTION)
            page.press("#prompt", "Enter")
            done = page.wait_for_selector(
                ".message.assistant:not(.streaming) .stats", timeout=90_000
            )
            assert done is not None
            answer = page.inner_text(".message.assistant .text")
            assert "Paris" in answer
            assert "tokens/s" in done.inner_text()
            lengths = page.evaluate("window.lengths")
            assert len({n for n in lengths if n > 0}) > 2, lengths  # it grew piece by piece
            page.screenshot(path=str(ARTIFACTS / "gateway-chat.png"), full_page=True)

            # The swarm loses blocks 20:30: the page says which and what to do.
            next(d for d in gateway.swarm.daemons if d.name == "c").kill()
            wait_until(lambda: gateway.status()["missing_blocks"] == [[20, 30]], 30, "20:30 gone")
            page.evaluate("refreshStatus()")  # the page polls every 15 s; ask now
            warning = page.wait_for_selector("#swarm-warning:not([hidden])", timeout=30_000)
            assert warning is not None
            assert "blocks 20-29" in warning.inner_text()
            assert "peerd start --blocks 20:30" in warning.inner_text()
            page.screenshot(path=str(ARTIFACTS / "gateway-swarm-lacks-blocks.png"), full_page=True)
        finally:
            browser.close()
