"""Several models in one swarm, in one process (tests/memnet.py): how a daemon learns the swarm's
models from the records peers answer with, which of them it may load, the view and generator a
request naming a model gets, and the refusals for a name that is unknown or not a name at all."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from transformers import AutoModelForCausalLM

import blocks
import wire
from peerd.daemon.api_session import ApiError
from peerd.daemon.models import ModelSetupError, SwarmModels, known_checkpoints
from peerd.sdk.options import GenerateOptions, generate_request, open_request
from peerd.sdk.terminal import format_status
from peerd.session.swarm import SwarmView
from routing.models import BadModelName, check_model_name
from routing.records import record_to_info
from tests.memnet import TINY_BLOCKS, TINY_MODEL, MemNet, open_memnet
from tests.tiny_models import llama_for_tokenizer, save_tiny

OTHER = "other-model"  # the daemon's own model in these tests (a second copy of the tiny llama)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama in a directory named as memnet's servers name their model, with the
    default model's tokenizer (its ids cover the tiny vocabulary), so the daemon decodes."""
    from transformers import AutoTokenizer

    path = save_tiny("llama", tmp_path_factory.mktemp("models") / TINY_MODEL)
    AutoTokenizer.from_pretrained(blocks.resolve_checkpoint("default")).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "name", ["tiny-llama", "smollm2-135m-instruct", "qwen2.5-0.5b", "a", "x_1", "9" * 128]
)
def test_a_model_name_is_a_short_lowercase_word(name: str) -> None:
    assert check_model_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "/etc/passwd", "../models", "a/../b", "~/m", "Tiny", "<script>", "a b", "-x", "9" * 129,
     "a..b", None, 7],
)  # fmt: skip
def test_anything_else_is_refused_saying_what_a_name_is(name: object) -> None:
    with pytest.raises(BadModelName, match="lowercase letters, digits"):
        check_model_name(name)


def test_a_client_model_that_cannot_be_loaded_stops_the_daemon_early(tmp_path: Path) -> None:
    with pytest.raises(ModelSetupError, match=f"--client-models {tmp_path}"):
        known_checkpoints(OTHER, tmp_path, [str(tmp_path)])


def _models(net: MemNet, tiny: Path, sources: list[str]) -> SwarmModels:
    """What a daemon on `OTHER` (4 blocks) knows, before any refresh."""
    view = SwarmView(net.node("client"), OTHER, 4, refresh_period=60)  # type: ignore[arg-type]
    return SwarmModels(view, known_checkpoints(OTHER, tiny, sources), record_ttl=60)


def _serve_two_models(net: MemNet, tiny: Path) -> None:
    net.serve("t1", blocks.load_span(tiny, 0, 3))
    net.serve("t2", blocks.load_span(tiny, 3, TINY_BLOCKS))
    net.serve("o", blocks.load_span(tiny, 0, 2), model=OTHER)
    net.serve("evil", blocks.load_span(tiny, 0, 1), model="../../home/me/.ssh")
    net.serve("third", blocks.load_span(tiny, 0, 1), model="third-model")


async def _ask_everyone(net: MemNet, models: SwarmModels) -> None:
    """What a refresh does with each candidate: ask it for its live record."""
    view = models.views[OTHER]
    for name in ("t1", "t2", "o", "evil", "third"):
        record = await view.fetch_record(PeerInfo(ID.from_base58(net.peer_id(name)), []))
        if record is not None:
            view.records[record.peer_id] = record


async def test_the_swarms_models_are_learnt_from_the_records_of_any_model(tiny: Path) -> None:
    async with open_memnet() as net:
        _serve_two_models(net, tiny)
        models = _models(net, tiny, [str(tiny)])
        await _ask_everyone(net, models)
        assert set(models.views[OTHER].records) == {net.peer_id("o")}  # the view keeps its own
        assert set(models.heard) == {TINY_MODEL, OTHER, "third-model"}  # never the bad name
        await models.prepare(TINY_MODEL)  # its block count (a daemon learns it when it hears it)
        listed = {m.name: m for m in models.listing()}
        assert models.listing()[0].name == OTHER  # ours first
        assert listed[TINY_MODEL] == wire.SwarmModel(
            name=TINY_MODEL,
            servers=2,
            num_blocks=TINY_BLOCKS,
            blocks_served=TINY_BLOCKS,
            checkpoint=str(tiny.resolve()),
        )
        assert (listed[OTHER].servers, listed[OTHER].blocks_served) == (1, 2)
        # Served, but this daemon has no checkpoint of it: listed without one or a block count.
        third = listed["third-model"]
        assert (third.servers, third.num_blocks, third.checkpoint) == (1, 0, "")
        status = wire.StatusResponse(
            peer_id=net.peer_id("client"),
            version="0",
            uptime_s=1.0,
            swarm=(record_to_info(net.server("o").record()),),
            models=models.listing(),
        )
        text = format_status(status)
        assert f"{TINY_MODEL}: 2 servers, all {TINY_BLOCKS} blocks served" in text
        assert "third-model: 1 servers, blocks unknown here; no checkpoint here" in text
        # A server of another model that says it leaves is gone from the listing at once.
        models.heard_leave(net.peer_id("t2"))
        listed = {m.name: m for m in models.listing()}
        assert (listed[TINY_MODEL].servers, listed[TINY_MODEL].blocks_served) == (1, 3)


async def test_a_request_naming_a_model_gets_that_models_view_and_servers(tiny: Path) -> None:
    async with open_memnet() as net:
        _serve_two_models(net, tiny)
        models = _models(net, tiny, [str(tiny)])
        await _ask_everyone(net, models)
        generator = await models.generator(TINY_MODEL)
        assert generator.swarm.model == TINY_MODEL
        assert generator.swarm is not models.views[OTHER]
        assert set(generator.swarm.records) == {net.peer_id("t1"), net.peer_id("t2")}
        assert await models.generator(TINY_MODEL) is generator  # loaded once
        assert (await models.generator(None)).swarm is models.views[OTHER]
        # Greedy tokens through the tiny model's two servers are the tiny model's own.
        prompt = torch.tensor([[1, 17, 42, 5, 60]])
        got = [int(t[0, 0]) async for t in generator.generate(prompt, 6)]
        local = AutoModelForCausalLM.from_pretrained(tiny).eval()
        with torch.inference_mode():
            want = local.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
        assert got == want[0, prompt.shape[1] :].tolist()


async def test_a_model_not_here_is_refused_naming_the_models_there_are(tiny: Path) -> None:
    async with open_memnet() as net:
        _serve_two_models(net, tiny)
        models = _models(net, tiny, ["default", str(tiny)])
        await _ask_everyone(net, models)
        assert models.choose(None) == OTHER
        assert models.choose("default") == "smollm2-135m-instruct"  # blocks' 'default'
        with pytest.raises(ApiError) as unknown:
            models.choose("nope")
        assert unknown.value.code == wire.ErrorCode.UNSUPPORTED
        message = str(unknown.value)
        assert "no model 'nope'" in message
        assert f"the swarm serves {OTHER}, third-model, {TINY_MODEL}" in message
        assert f"can generate with {OTHER}, smollm2-135m-instruct, {TINY_MODEL}" in message
        with pytest.raises(ApiError, match="--client-models DIR") as served_elsewhere:
            models.choose("third-model")
        assert served_elsewhere.value.code == wire.ErrorCode.UNSUPPORTED
        for hostile in ("../../home/me/.ssh", str(tiny), "/etc"):  # never a path
            with pytest.raises(ApiError, match="is not a model name") as bad:
                await models.generator(hostile)
            assert bad.value.code == wire.ErrorCode.BAD_REQUEST


async def test_a_client_session_on_another_model_runs_every_turn_on_it(
    tiny: Path, tmp_path: Path
) -> None:
    """Through the local API socket: a session opened with model= runs its turns (which name
    no model) on that model's servers; a turn naming another model is refused."""
    from peerd.daemon.local_api import LocalApi
    from peerd.sdk.client import AsyncClient, PeerdError

    async with open_memnet() as net, trio.open_nursery() as nursery:
        _serve_two_models(net, tiny)
        models = _models(net, tiny, [str(tiny)])
        await _ask_everyone(net, models)
        welcome = wire.Welcome(version="0", peer_id="p", model=OTHER, num_blocks=4, hidden_size=32)
        api = LocalApi(
            socket_path=tmp_path / "peerd.sock",
            get_generator=lambda: models.generator(None),
            models=models.generator,
            status=lambda: wire.StatusResponse(peer_id="p", version="0", uptime_s=0.0),
            welcome=lambda: welcome,
        )
        path = await nursery.start(api.serve)
        prompt = [1, 17, 42, 5, 60]
        async with AsyncClient(path) as client:
            session = await client.open_session(32, model=TINY_MODEL)
            first = await client.generate_full(input_ids=prompt, session=session, max_new_tokens=3)
            more = await client.generate_full(input_ids=[7], session=session, max_new_tokens=2)
            with pytest.raises(PeerdError, match=f"runs {TINY_MODEL}, not {OTHER}"):
                await client.generate_full(input_ids=[7], session=session, model=OTHER)
        local = AutoModelForCausalLM.from_pretrained(tiny).eval()
        with torch.inference_mode():
            fed = prompt + first.token_ids + [7]
            want = local.generate(torch.tensor([prompt]), max_new_tokens=3, min_new_tokens=3)
            want_more = local.generate(torch.tensor([fed]), max_new_tokens=2, min_new_tokens=2)
        assert first.token_ids == want[0, len(prompt) :].tolist()
        assert more.token_ids == want_more[0, len(fed) :].tolist()
        nursery.cancel_scope.cancel()


def test_the_client_names_the_model_in_generate_and_open_inference() -> None:
    options = GenerateOptions(max_new_tokens=3, model=TINY_MODEL)
    assert generate_request("hi", None, False, None, options).model == TINY_MODEL
    assert generate_request("hi", None, False, None, GenerateOptions()).model is None
    assert open_request(8, 1, None, model=TINY_MODEL).model == TINY_MODEL


# --- two models in one swarm of daemons -------------------------------------------------------

QUESTION = "Name a colour."
NEW_TOKENS = 4


def _tiny_with_tokenizer(directory: Path) -> Path:
    """A tiny random llama with the default model's tokenizer (so it chats), named tiny-llama."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(blocks.resolve_checkpoint("default"))
    config = llama_for_tokenizer(tokenizer)
    torch.manual_seed(0)
    path = directory / TINY_MODEL
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _cli(socket: Path, *args: str) -> subprocess.Popen[str]:
    """`peerd generate ARGS` through the daemon on `socket`, started (communicate() ends it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "generate", "--socket", str(socket), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )


def _printed(cli: subprocess.Popen[str]) -> str:
    out, err = cli.communicate(timeout=180)
    assert cli.returncode == 0, err
    return out.strip()


def _chat(url: str, model: str) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
    }
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["model"] == model
    return str(answer["choices"][0]["message"]["content"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_models_in_one_swarm_by_name_through_cli_openai_and_the_page(tmp_path: Path) -> None:
    """A daemon serving the default model and one serving a tiny llama share a swarm: the
    first generates with either by name (CLI, client library, OpenAI API), /v1/models lists
    both, and the web page's picker switches between them."""
    from peerd.devtools.localswarm import LocalSwarm
    from peerd.sdk.client import Client, PeerdError
    from tests.test_gateway import CHROMIUM, wait_until

    tiny_dir = _tiny_with_tokenizer(tmp_path)
    default = blocks.model_name("default")
    (tmp_path / "swarm").mkdir()
    swarm = LocalSwarm(tmp_path / "swarm", refresh_period=2.0)
    clis: dict[str, subprocess.Popen[str]] = {}
    with _gateway_thread() as serve:
        try:
            a = swarm.start(
                "a", "0:30", "--client-models", "default", "--client-models", str(tiny_dir)
            )
            swarm.start("b", "0:4", "--model", str(tiny_dir))
            with Client(a.socket) as client:

                def both_served() -> bool:
                    listed = {m.name: m for m in client.models()}
                    return all(
                        name in listed and listed[name].blocks_served == listed[name].num_blocks > 0
                        for name in (default, TINY_MODEL)
                    )

                wait_until(both_served, 60, "both models served in full")
                # The CLI by name (its processes start while the rest goes on).
                new = ("--max-new-tokens", str(NEW_TOKENS))
                for name, given in ((TINY_MODEL, TINY_MODEL), (default, "default")):
                    clis[name] = _cli(a.socket, "--model", given, "--chat", *new, QUESTION)
                greedy = {"max_new_tokens": NEW_TOKENS}
                want = {
                    name: client.generate(QUESTION, chat=True, model=name, **greedy)
                    for name in (default, TINY_MODEL)
                }
                with pytest.raises(PeerdError, match=f"the swarm serves {default}, {TINY_MODEL}"):
                    client.generate(QUESTION, model="nope", **greedy)
            assert want[default] != want[TINY_MODEL]
            # The OpenAI API, by name; /v1/models lists both.
            url = serve(a.socket)
            listed = httpx.get(f"{url}/v1/models", timeout=60).json()
            assert [m["id"] for m in listed["data"]] == [default, TINY_MODEL]
            for name in (default, TINY_MODEL):
                assert _chat(url, name) == want[name]
            unknown = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "a"})
            assert unknown.status_code == 404
            assert f"serves {default}, {TINY_MODEL}" in unknown.json()["error"]["message"]
            if CHROMIUM.exists():
                _pick_in_the_page(url, want)
            for name, cli in clis.items():
                assert _printed(cli) == want[name].strip()
        finally:
            for cli in clis.values():
                cli.kill()
                cli.communicate()
            swarm.stop()


@contextlib.contextmanager
def _gateway_thread() -> Iterator[Callable[[Path], str]]:
    """serve(socket) starts a gateway in front of that daemon (in a thread) and gives its URL;
    it stops on leaving."""
    import uvicorn

    from peerd.gateway import create_app
    from peerd.gateway.app import uvicorn_config
    from tests.test_gateway import wait_until

    running: list[tuple[uvicorn.Server, threading.Thread]] = []

    def serve(daemon_socket: Path) -> str:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        server = uvicorn.Server(
            uvicorn_config(create_app(daemon_socket), "127.0.0.1", port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
        thread.start()
        running.append((server, thread))
        wait_until(lambda: server.started, 60, "uvicorn started")
        return f"http://127.0.0.1:{port}"

    try:
        yield serve
    finally:
        for server, thread in running:
            server.should_exit = True
            thread.join(15)


def _pick_in_the_page(url: str, want: dict[str, str]) -> None:
    """The web chat's picker lists both models; an answer with each, greedy, is that model's."""
    from playwright.sync_api import sync_playwright

    from tests.test_gateway import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS

    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(url)
            page.wait_for_selector("#model-choice:not([hidden])", timeout=60_000)
            options = page.eval_on_selector_all(
                "#model-picker option", "os => os.map(o => o.value)"
            )
            assert options == list(want)
            page.click("#settings summary")
            page.uncheck("#do-sample")
            page.fill("#max-new-tokens", str(NEW_TOKENS))
            page.fill("#repetition-penalty", "1")
            for name in reversed(list(want)):  # the other model first, then back to the default
                page.select_option("#model-picker", name)
                page.wait_for_function(
                    f"document.getElementById('model').textContent.startsWith('{name} ')"
                )
                page.fill("#prompt", QUESTION)
                page.press("#prompt", "Enter")
                page.wait_for_selector(".message.assistant .stats", timeout=120_000)
                page.wait_for_selector(
                    ".message.assistant.streaming", state="detached", timeout=120_000
                )
                assert page.locator(".message.assistant").count() == 1  # a new chat per model
                assert page.inner_text(".message.assistant .text") == want[name]
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "chat-model-picker.png"), full_page=True)
        finally:
            browser.close()
