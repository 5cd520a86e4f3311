"""Checkpoints as the Hugging Face Hub lays them out (blocks.hub, blocks.checkpoint): sharded
safetensors, tied or untied embeddings, chat templates in either file, generation_config.json
defaults, and `--model ORG/NAME` read from a Hub cache these tests build themselves (the layout
huggingface_hub writes: models--ORG--NAME/{blobs,refs/main,snapshots/<commit>/...}). Offline
always: nothing here may reach the network."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

import blocks
import blocks.checkpoint
import blocks.hub
import wire
from blocks.checkpoint import INDEX_FILE
from peerd.session.generation import Generator, with_defaults
from peerd.session.swarm import SwarmView
from tests.memnet import open_memnet
from tests.numeric import SAME, assert_close_scaled
from tests.tiny_models import SMALL

REPO = "TestOrg/Tiny-Llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
NUM_LAYERS = 6
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
WORDS = ["<unk>", "<s>", "</s>", "<eot>", "hello", "world", "<user>", "<assistant>"]


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {word: i for i, word in enumerate(WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _checkpoint(directory: Path, *, tied: bool, template_in: str = "jinja") -> Path:
    """A tiny Llama sharded into one file per block or so, with a tokenizer and chat template."""
    torch.manual_seed(0)
    config = LlamaConfig(
        **SMALL,
        num_hidden_layers=NUM_LAYERS,
        num_key_value_heads=2,
        intermediate_size=64,
        tie_word_embeddings=tied,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, max_shard_size="40KB")
    _tokenizer().save_pretrained(directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    if template_in == "jinja":
        (directory / "chat_template.jinja").write_text(TEMPLATE)
    else:  # the older layout: the template inside tokenizer_config.json
        tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
        tokenizer_config["chat_template"] = TEMPLATE
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def _hub_cache(cache: Path, source: Path, repo: str = REPO, skip: set[str] = frozenset()) -> Path:
    """`source` copied into a Hub cache as huggingface_hub lays it out; `skip`: files left out.
    Returns the snapshot directory."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        if file.name in skip:
            continue
        data = file.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (root / "blobs" / blob).write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _shards(directory: Path) -> dict[str, str]:
    return dict(json.loads((directory / INDEX_FILE).read_text())["weight_map"])


def _span_share(directory: Path, start: int, end: int) -> tuple[int, set[str]]:
    """Bytes of blocks start..end-1's tensors in the checkpoint, and the shards holding them."""
    total, files = 0, set()
    for name, file in _shards(directory).items():
        if any(name.startswith(f"model.layers.{i}.") for i in range(start, end)):
            with safe_open(directory / file, framework="pt") as f:
                total += f.get_tensor(name).nbytes
            files.add(file)
    return total, files


class _Reads:
    """Every file safe_open opens in blocks.checkpoint, and the bytes of every tensor it reads."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.bytes = 0

    def open(self, path: object, framework: str, device: str = "cpu") -> _Reads._File:
        self.files.add(Path(str(path)).name)
        return _Reads._File(self, safe_open(path, framework=framework, device=device))

    class _File:
        def __init__(self, reads: _Reads, inner: object) -> None:
            self.reads, self.inner = reads, inner

        def __enter__(self) -> _Reads._File:
            self.inner = self.inner.__enter__()  # type: ignore[attr-defined]
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.__exit__(*exc)  # type: ignore[attr-defined]

        def keys(self) -> list[str]:
            return list(self.inner.keys())  # type: ignore[attr-defined]

        def get_tensor(self, name: str) -> torch.Tensor:
            tensor = self.inner.get_tensor(name)  # type: ignore[attr-defined]
            self.reads.bytes += tensor.nbytes
            return tensor


@pytest.mark.parametrize(("tied", "template_in"), [(False, "jinja"), (True, "tokenizer_config")])
def test_a_model_in_the_hub_cache_runs_offline_by_its_id(
    tmp_path: Path, offline_cache: Path, tied: bool, template_in: str
) -> None:
    source = _checkpoint(tmp_path / "source", tied=tied, template_in=template_in)
    assert len(set(_shards(source).values())) >= 3
    snapshot = _hub_cache(offline_cache, source)

    assert blocks.resolve_checkpoint(REPO) == snapshot
    assert blocks.model_name(REPO) == blocks.model_name(snapshot) == "testorg-tiny-llama"
    client = blocks.load_client_side(REPO)
    spans = [blocks.load_span(REPO, a, b) for a, b in ((0, 2), (2, 5), (5, NUM_LAYERS))]
    ids = torch.tensor([[1, 4, 5, 4, 6, 7, 5]])
    hidden = client.embed(ids)
    for span in spans:
        hidden = span(hidden)
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        assert_close_scaled(client.logits(hidden), reference(ids).logits, rel=SAME)
    assert (client.lm_head.weight is client.embeddings.weight) == tied

    chat = client.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello world"}], tokenize=False
    )
    assert chat == "<user>hello world"


def test_peerd_start_model_org_name_takes_the_cached_snapshot(
    tmp_path: Path, offline_cache: Path
) -> None:
    from libp2p.crypto.ed25519 import create_new_key_pair

    from peerd.daemon.main import Daemon, DaemonConfig

    snapshot = _hub_cache(offline_cache, _checkpoint(tmp_path / "source", tied=False))
    daemon = Daemon(DaemonConfig(model=REPO, blocks="2:4"), create_new_key_pair())
    assert daemon.checkpoint == snapshot
    assert daemon.model == "testorg-tiny-llama"
    assert daemon.num_blocks == NUM_LAYERS


def test_peerd_start_with_a_shard_missing_offline_stops_with_one_line_naming_it(
    tmp_path: Path, offline_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peerd.daemon.main import DaemonConfig, DaemonError, run

    monkeypatch.setenv("PEERD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("PEERD_RUNTIME_DIR", str(tmp_path / "run"))
    source = _checkpoint(tmp_path / "source", tied=False)
    missing = sorted(_span_share(source, 1, 2)[1])[-1]
    _hub_cache(offline_cache, source, skip={missing})
    config = DaemonConfig(
        model=REPO,
        new_swarm=True,
        blocks="0:2",
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        socket=tmp_path / "a.sock",
        throughput="1",
    )
    with pytest.raises(DaemonError) as stopped:
        run(config)
    message = str(stopped.value)
    assert "\n" not in message and missing in message and "HF_HUB_OFFLINE" in message


def test_a_server_opens_only_the_shards_of_its_span(
    tmp_path: Path, offline_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _checkpoint(tmp_path / "source", tied=False)
    start, end = 2, 4
    share, needed = _span_share(source, start, end)
    all_shards = set(_shards(source).values())
    assert len(all_shards - needed) >= 2  # shards outside the span exist...
    _hub_cache(offline_cache, source, skip=all_shards - needed)  # ...but not in this cache
    reads = _Reads()
    monkeypatch.setattr(blocks.checkpoint, "safe_open", reads.open)

    span = blocks.load_span(REPO, start, end)

    assert reads.files == needed
    assert 0.9 * share <= reads.bytes <= 1.1 * share, (reads.bytes, share)
    assert span.weight_bytes == pytest.approx(share, rel=0.1)

    # A local directory holding every shard: the same files opened, the same bytes read.
    local = _Reads()
    monkeypatch.setattr(blocks.checkpoint, "safe_open", local.open)
    blocks.load_span(source, start, end)
    assert (local.files, local.bytes) == (needed, reads.bytes)
    # The client side opens only the shards of the embeddings, final norm and LM head.
    client_reads = _Reads()
    monkeypatch.setattr(blocks.checkpoint, "safe_open", client_reads.open)
    blocks.load_client_side(source)
    outside = {n: f for n, f in _shards(source).items() if not n.startswith("model.layers.")}
    assert client_reads.files == set(outside.values())
    with safe_open(source / outside["lm_head.weight"], framework="pt") as f:
        head_bytes = f.get_tensor("lm_head.weight").nbytes
    assert 2 * head_bytes <= client_reads.bytes <= 2.1 * head_bytes  # embeddings + head + norm


def test_a_shard_missing_from_the_cache_offline_is_one_line_naming_it(
    tmp_path: Path, offline_cache: Path
) -> None:
    source = _checkpoint(tmp_path / "source", tied=False)
    _, needed = _span_share(source, 4, 5)
    missing = sorted(needed)[0]
    _hub_cache(offline_cache, source, skip={missing})
    blocks.load_span(REPO, 0, 2)  # spans that do not need it load

    with pytest.raises(blocks.ModelNotFoundError) as caught:
        blocks.load_span(REPO, 3, 6)
    message = str(caught.value)
    assert "\n" not in message
    assert missing in message and REPO in message and "HF_HUB_OFFLINE" in message

    weights = {f.name for f in source.iterdir() if f.name.startswith("model")}
    _hub_cache(offline_cache, source, repo="TestOrg/No-Weights", skip=weights)
    with pytest.raises(blocks.ModelNotFoundError) as caught:
        blocks.resolve_checkpoint("TestOrg/No-Weights")
    message = str(caught.value)
    assert "\n" not in message and INDEX_FILE in message and "model.safetensors " in message


def test_a_model_not_cached_with_no_network_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as closed:  # a local port nobody listens on: no request leaves the host
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(blocks.hub, "_probes", {})  # no answer from another test's endpoint

    with pytest.raises(blocks.ModelNotFoundError) as caught:
        blocks.resolve_checkpoint(REPO)
    message = str(caught.value)
    assert "\n" not in message
    assert "config.json" in message and "no network" in message


@contextmanager
def _local_hub(source: Path, requests: list[str]) -> Iterator[str]:
    """A Hub endpoint on 127.0.0.1 that serves `source` as REPO at COMMIT, speaking the part of
    the Hub's protocol hf_hub_download uses (HEAD, then GET of /REPO/resolve/REVISION/FILE);
    each request is appended to `requests` as "HEAD file" or "GET file". Nothing leaves the
    host."""

    class Handler(BaseHTTPRequestHandler):
        def _file(self) -> Path | None:
            prefix = f"/{REPO}/resolve/"
            if not self.path.startswith(prefix):
                return None
            revision, _, name = self.path.removeprefix(prefix).partition("/")
            file = source / name
            ok = revision in ("main", COMMIT) and "/" not in name and file.is_file()
            return file if ok else None

        def _head(self) -> bytes | None:
            requests.append(f"{self.command} {self.path.rsplit('/', 1)[1]}")
            file = self._file()
            if file is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            data = file.read_bytes()
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return data

        def do_HEAD(self) -> None:
            self._head()

        def do_GET(self) -> None:
            data = self._head()
            if data is not None:
                self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_model_not_cached_fetches_only_what_its_span_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _checkpoint(tmp_path / "source", tied=False)
    _, needed = _span_share(source, 2, 4)
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(blocks.hub, "_probes", {})  # no answer from another test's endpoint
    requests: list[str] = []
    with _local_hub(source, requests) as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        blocks.load_span(REPO, 2, 4)
        downloads = [r.removeprefix("GET ") for r in requests if r.startswith("GET ")]
        assert {name for name in downloads if name.startswith("model-")} == needed
        small = {"config.json", INDEX_FILE, "tokenizer.json", "tokenizer_config.json"}
        assert small <= set(downloads) and "chat_template.jinja" in downloads
        assert len(downloads) == len(set(downloads))  # nothing twice
        asked = len(requests)
        blocks.load_span(REPO, 3, 4)  # all in the cache now: the Hub is not asked again
        assert len(requests) == asked

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what it fetched is a Hub cache like any other
    assert blocks.load_span(REPO, 3, 4).num_blocks == 1


def test_generation_config_gives_defaults_the_request_did_not_set(
    tmp_path: Path, offline_cache: Path
) -> None:
    source = _checkpoint(tmp_path / "source", tied=False)
    (source / "generation_config.json").write_text(
        json.dumps(
            {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
            | {"eos_token_id": [2, 3], "do_sample": True}
        )
    )
    _hub_cache(offline_cache, source)
    client = blocks.load_client_side(REPO)
    defaults = client.generation_defaults

    assert client.eos_token_ids == [2, 3]  # the tokenizer's </s>, then the config's <eot>
    sampled = with_defaults(wire.Sampling(do_sample=True, seed=5), defaults)
    assert sampled == wire.Sampling(
        do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05, seed=5
    )
    mine = wire.Sampling(do_sample=True, temperature=0.3, top_k=3, repetition_penalty=1.2)
    assert with_defaults(mine, defaults) == wire.Sampling(
        do_sample=True, temperature=0.3, top_k=3, top_p=0.8, repetition_penalty=1.2
    )
    # Greedy stays greedy; the repetition penalty applies to it, as in transformers.
    assert with_defaults(wire.Sampling(), defaults) == wire.Sampling(repetition_penalty=1.05)


async def test_three_servers_of_a_hub_model_generate_as_transformers_with_its_defaults(
    tmp_path: Path, offline_cache: Path
) -> None:
    """Greedy through three in-process servers, each loading its span by the Hub id: the same
    tokens as transformers' generate, which applies the checkpoint's repetition penalty and
    stops at its extra EOS id as well."""
    source = _checkpoint(tmp_path / "source", tied=False)
    generation = {"repetition_penalty": 1.8, "eos_token_id": [2, 3], "bos_token_id": 1}
    (source / "generation_config.json").write_text(json.dumps(generation))
    _hub_cache(offline_cache, source)
    prompt = torch.tensor([[1, 7, 6, 5, 4]])
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=16, do_sample=False)[0, 5:]
    # This model repeats a token by step 6 without the penalty, and ends with <eot> (3) after 9.
    assert expected.tolist()[-1] == 3 and len(expected) < 16

    async with open_memnet() as net:
        for name, (start, end) in {"a": (0, 2), "b": (2, 5), "c": (5, NUM_LAYERS)}.items():
            net.serve(name, blocks.load_span(REPO, start, end), model=blocks.model_name(REPO))
        model = blocks.model_name(REPO)
        view = SwarmView(net.node("client"), model, NUM_LAYERS, refresh_period=60)  # type: ignore[arg-type]
        view.records = net.records()
        client = blocks.load_client_side(REPO)
        tokens = [
            int(token)
            async for token in Generator(client, view).generate(
                prompt, 16, eos_token_ids=client.eos_token_ids
            )
        ]
    assert tokens == expected.tolist()


def test_bad_generation_config_values_are_dropped(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0, "top_p": 2, "top_k": True, "eos_token_id": [-1, "x", 7]})
    )
    assert blocks.generation_defaults(tmp_path) == blocks.GenerationDefaults(eos_token_ids=(7,))
    (tmp_path / "generation_config.json").write_text("[1, 2")
    assert blocks.generation_defaults(tmp_path) == blocks.GenerationDefaults()


def test_an_index_pointing_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "source", tied=False)
    index = json.loads((source / INDEX_FILE).read_text())
    index["weight_map"]["model.layers.0.input_layernorm.weight"] = "../../etc/passwd"
    (source / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(blocks.ModelNotFoundError, match="not a file name of the checkpoint"):
        blocks.load_span(source, 0, 1)
