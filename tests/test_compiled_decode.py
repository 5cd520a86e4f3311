"""blocks.compiled: a span's one-token decode steps, prompts and merged steps of a few sessions
as compiled graphs give what the eager forward gives, step after step through the sessions'
caches (which the graphs write), for any session length and room; what they cannot run (a
masked step, the last slot, short prompts, a failed guard) runs eager; spans it cannot compile
say why and serve eager."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from torch import nn
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen3Config
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen3 import modeling_qwen3

import blocks
from blocks import compiled, lean, threads
from blocks.cache import MemoryCache
from blocks.families import FAMILIES, prepare_config
from blocks.span import PREFILL_CHUNK_TOKENS, Span
from peerd.session.inference import InferenceSession
from tests.memnet import open_memnet, random_steps, view_over, whole_output
from tests.numeric import REL, assert_close_scaled

SHAPE = {"hidden_size": 48, "num_attention_heads": 6, "intermediate_size": 80}


def _span(config: PretrainedConfig, family: str, layer: type[nn.Module], rotary: Any) -> Span:
    """Blocks 2..4 of a random model (from block 2: the graph's cache index is the layer's
    index less the span's start)."""
    prepare_config(config, FAMILIES[family])
    torch.manual_seed(0)
    layers = [layer(config, layer_idx=i) for i in range(2, 5)]
    for module in layers:
        for p in module.parameters():  # large enough that a wrong position shows
            nn.init.normal_(p, std=0.2)
    return Span(config, FAMILIES[family], 2, layers, rotary(config), "tiny").eval()


def _compiled(span: Span) -> Span:
    """`span` with its passes compiled (the test skipped where this machine cannot)."""
    why = compiled.unsupported(span)
    if why is not None:
        pytest.skip(why)
    assert span.compile_passes() and span.compiled is not None and span.compiled.prompts
    return span


@pytest.fixture(scope="module")
def llama() -> Iterator[Span]:
    yield _compiled(
        _span(
            LlamaConfig(**SHAPE, num_key_value_heads=2, attention_bias=True),
            "llama",
            lean.LlamaLayer,
            modeling_llama.LlamaRotaryEmbedding,
        )
    )


def _steps(
    span: Span, max_length: int, prompt: int, seed: int, turn: int = 0
) -> list[torch.Tensor]:
    """The outputs of a session's prompt and then one-token steps up to its max_length; with
    `turn`, a second prompt of that many tokens after the first two steps (a chat's next turn).
    Every other step's input is made outside inference mode, as a server's decoded inputs are."""
    generator = torch.Generator().manual_seed(seed)
    cache = MemoryCache(budget_tokens=4096)
    width = span.config.hidden_size
    with cache.open_session(1, max_length) as session:
        outputs = [span(torch.randn(1, prompt, width, generator=generator), session)]
        step = 0
        while session.position < max_length:
            tokens = turn if turn and step == 2 else 1
            with torch.inference_mode(step % 2 == 0):
                hidden = torch.randn(1, tokens, width, generator=generator)
            outputs.append(span(hidden, session))
            step += 1
    return outputs


def _against_eager(
    span: Span, graphs: tuple[str, ...], run: Callable[[], list[torch.Tensor]]
) -> dict[str, int]:
    """`run`'s outputs with the span's compiled passes against the same run eager; how many
    passes ran in each of `graphs` (CompiledPasses attributes, counted without the "_")."""
    graph = span.compiled
    assert graph is not None
    ran = {name.lstrip("_"): 0 for name in graphs}
    originals = {name: getattr(graph, name) for name in graphs}

    def counting(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def counted(*args: Any) -> torch.Tensor:
            ran[name.lstrip("_")] += 1
            return fn(*args)

        return counted

    for name, fn in originals.items():
        setattr(graph, name, counting(name, fn))
    try:
        ours = run()
    finally:
        for name, fn in originals.items():
            setattr(graph, name, fn)
    span.compiled = None
    try:
        eager = run()
    finally:
        span.compiled = graph
    assert len(ours) == len(eager)
    for got, want in zip(ours, eager, strict=True):
        assert_close_scaled(got, want)
    return ran


def _compare_graphs(span: Span, max_length: int, prompt: int, turn: int = 0) -> dict[str, int]:
    """Passes compiled against the same passes eager; how many ran in each graph."""
    return _against_eager(
        span,
        ("_step", "_prompt", "_chunk"),
        lambda: _steps(span, max_length, prompt, seed=max_length, turn=turn),
    )


def _compare(span: Span, max_length: int, prompt: int) -> int:
    """Steps compiled against the same steps eager; how many ran compiled."""
    return sum(_compare_graphs(span, max_length, prompt).values())


def test_compiled_steps_match_eager_for_any_length_and_room(llama: Span) -> None:
    graph = llama.compiled
    assert graph is not None and graph.prompts and graph.chunks
    # Rooms and prompts the warm-up never saw: one graph serves them all (no guard fails).
    for max_length, prompt in ((12, 3), (40, 17), (7, 2), (60, 33), (19, 18)):
        ran = _compare(llama, max_length, prompt)
        # Every one-token step but the last slot's (and none with under 2 positions cached),
        # and prompts of a prefill's rows.
        assert ran == max_length - prompt - 1 + (prompt >= threads.PREFILL_ROWS)
    assert graph.failures == 0


def test_first_steps_short_and_later_prompts_run_eager(llama: Span) -> None:
    # A one-token prompt, then a step at position 1: neither holds 2 positions before it.
    assert _compare(llama, 6, 1) == 6 - 1 - 2
    # A prompt that fills the cache (the last slot) runs eager.
    assert _compare(llama, 17, 17) == 0
    # A long prompt in chunks of 20, 20 and 5 tokens: the first in the prompts' graph, the
    # second (after a past) in the chunks' graph, the third (under a prefill's rows) eager.
    llama.chunk_tokens = 20
    try:
        ran = _compare_graphs(llama, 50, 45)
    finally:
        llama.chunk_tokens = PREFILL_CHUNK_TOKENS
    assert ran == {"prompt": 1, "chunk": 1, "step": 50 - 45 - 1}
    assert llama.compiled is not None and llama.compiled.failures == 0


@pytest.mark.parametrize(("prompt", "turn"), [(20, 17), (3, 40), (17, 16)])
def test_prompts_after_a_past_run_compiled_with_the_causal_mask(
    llama: Span, prompt: int, turn: int
) -> None:
    """A chat's next turn: a prompt, two steps, then `turn` tokens at once, each attending to
    the cache and to the turn's tokens before it (a wrong mask shows in the outputs), then steps
    to the cache's last slot."""
    max_length = prompt + 2 + turn + 5
    ran = _compare_graphs(llama, max_length, prompt, turn=turn)
    assert ran["chunk"] == 1
    assert ran["prompt"] == (prompt >= threads.PREFILL_ROWS)
    assert llama.compiled is not None and llama.compiled.failures == 0


def _merged_steps(span: Span, sessions: list[tuple[int, int]], rounds: int) -> list[torch.Tensor]:
    """Outputs of sessions (prompt, max_length) that prefill alone, then step together in
    merged forwards (Span.forward_batch) for `rounds` rounds, a session leaving the merge once
    its cache is full, so the row counts fall; every other round's inputs made outside
    inference mode, as a server's decoded inputs are."""
    generator = torch.Generator().manual_seed(len(sessions) * rounds)
    width = span.config.hidden_size
    cache = MemoryCache(budget_tokens=4096)
    opened = [cache.open_session(1, max_length) for _, max_length in sessions]
    outputs = []
    for (prompt, _), session in zip(sessions, opened, strict=True):
        outputs.append(span(torch.randn(1, prompt, width, generator=generator), session))
    for round_ in range(rounds):
        live = [s for s in opened if s.position < s.max_length]
        with torch.inference_mode(round_ % 2 == 0):
            steps = [(torch.randn(1, 1, width, generator=generator), s) for s in live]
        outputs.extend(span.forward_batch(steps))
    for session in opened:
        session.close()
    return outputs


def _compare_merged(span: Span, sessions: list[tuple[int, int]], rounds: int) -> int:
    """Merged steps compiled against the same steps eager (_merged_steps); how many merged
    forwards ran in the merged steps' graph."""
    graph = span.compiled
    assert graph is not None and graph.merged_steps
    ran = _against_eager(span, ("_run_merged",), lambda: _merged_steps(span, sessions, rounds))
    assert graph.failures == 0
    return ran["run_merged"]


def test_merged_steps_run_in_their_graph_and_match_eager(llama: Span) -> None:
    """Merged steps of 4, 3 and 2 sessions of different pasts and rooms run in the merged
    steps' graph (fewer than its rows filled up with scratch rows) and match eager; a merge
    with a row at its last slot, or one with under 2 positions cached, runs eager."""
    # Caches full after rounds 5, 10, 15 and 37: 4 rows, then 3, 2 and one (not merged). The
    # rounds with every row short of its last slot: 5 of 4 rows, 4 of 3 and 4 of 2.
    assert _compare_merged(llama, [(3, 9), (5, 16), (8, 24), (2, 40)], rounds=20) == 5 + 4 + 4
    # The round at position 1 runs eager, the two after it compiled.
    assert _compare_merged(llama, [(1, 9), (4, 9)], rounds=3) == 2


def test_a_failed_compiled_step_runs_eager_and_three_stop_it(llama: Span) -> None:
    graph = llama.compiled
    assert graph is not None
    step = graph._step

    def broken(*args: Any) -> torch.Tensor:
        raise RuntimeError("Detected recompile when torch.compile stance is 'fail_on_recompile'")

    graph._step = broken
    llama.compiled = None
    eager = _steps(llama, 10, 3, seed=5)
    llama.compiled = graph
    try:
        ours = _steps(llama, 10, 3, seed=5)
        assert graph.failures == compiled.MAX_FAILURES  # then it stopped trying
    finally:
        graph._step = step
        graph.failures = 0
    for got, want in zip(ours, eager, strict=True):
        assert_close_scaled(got, want)


def test_a_masked_step_runs_eager() -> None:
    """A sliding window (Mistral's): steps past the window need a mask, which the graph does
    not take, and run eager; those before it run compiled."""
    span = _compiled(
        _span(
            MistralConfig(**SHAPE, num_key_value_heads=3, sliding_window=6),
            "mistral",
            lean.MistralLayer,
            modeling_mistral.MistralRotaryEmbedding,
        )
    )
    ran = _compare(span, 14, 3)
    assert 0 < ran < 14 - 3 - 1
    # A next turn the window narrows (5 cached, 17 new, a window of 6) runs eager too.
    assert _compare_graphs(span, 27, 3, turn=17)["chunk"] == 0
    # Merged steps: compiled while every row's past and step fit the window (2 rounds).
    assert _compare_merged(span, [(3, 12), (4, 12)], rounds=8) == 2
    assert span.compiled is not None and span.compiled.failures == 0


def test_spans_it_cannot_run_say_why_and_serve_eager(llama: Span) -> None:
    qwen3 = _span(
        Qwen3Config(**SHAPE, num_key_value_heads=2, head_dim=8),
        "qwen3",
        modeling_qwen3.Qwen3DecoderLayer,
        modeling_qwen3.Qwen3RotaryEmbedding,
    )
    assert "no lean forward" in (compiled.unsupported(qwen3) or "")
    assert not qwen3.compile_passes() and qwen3.compiled is None
    assert len(_steps(qwen3, 6, 2, seed=0)) == 5
    # A sub-span (a route using part of a server's blocks) runs eager: the graph is the span's.
    part = llama.sub_span(3, 5)
    assert part.compiled is None
    assert len(_steps(part, 6, 2, seed=0)) == 5
    # LoRA adapters are not in the graph: a span that takes one drops it.
    tiny = _span(
        LlamaConfig(**SHAPE, num_key_value_heads=2),
        "llama",
        lean.LlamaLayer,
        modeling_llama.LlamaRotaryEmbedding,
    )
    tiny.adapters = ("someone/adapter",)
    assert "LoRA" in (compiled.unsupported(tiny) or "")


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        ([], None, True),  # peerd start compiles by default
        (["--no-compile"], None, False),
        ([], "0", False),  # as the tests' daemons run (tests/conftest.py)
        (["--compile"], "0", True),  # a flag beats the environment
    ],
)
def test_the_flag_reaches_the_daemon_config(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], env: str | None, expected: bool
) -> None:
    from tests.test_max_batch_size import started_with

    if env is None:
        monkeypatch.delenv("PEERD_COMPILE", raising=False)
    else:
        monkeypatch.setenv("PEERD_COMPILE", env)
    result, configs = started_with(monkeypatch, *flags)
    assert result.exit_code == 0, result.output
    assert configs[0].compile is expected


async def test_servers_with_compiled_spans_give_the_whole_models_outputs(
    tiny_llama: Path, whole: blocks.Span
) -> None:
    """Three real BlockServers (tests/memnet.py) whose spans run compiled: a session's prompt,
    steps and next turn, pushed hop to hop (inputs decoded from the wire, which the graphs
    take), and two sessions at once (merged steps, eager), match the whole model; every server
    ran its graphs and none failed."""
    names = ["head", "mid", "tail"]
    calls = {name: 0 for name in names}
    spans = []
    for name, (start, end) in zip(names, ((0, 2), (2, 4), (4, 6)), strict=True):
        span = _compiled(blocks.load_span(tiny_llama, start, end))
        assert span.compiled is not None
        graph = span.compiled

        def counted(run: Any, name: str = name) -> Callable[..., torch.Tensor]:
            def call(*args: Any) -> torch.Tensor:
                calls[name] += 1
                return run(*args)

            return call

        graph._step, graph._prompt = counted(graph._step), counted(graph._prompt)
        graph._chunk = counted(graph._chunk)
        spans.append((name, span))
    # A prompt, two steps, a next turn of 16 tokens (the chunks' graph), two more steps.
    alone = random_steps(4, (20, 1, 1, 16, 1, 1))
    together = [random_steps(seed, (17, 1, 1, 1)) for seed in (5, 6)]
    outputs: dict[int, list[torch.Tensor]] = {}
    async with open_memnet() as net:
        for name, span in spans:
            net.serve(name, span)
        view = view_over(net)
        async with InferenceSession(view, max_length=48) as session:
            with trio.fail_after(60):
                outputs[4] = [await session.step(hidden) for hidden in alone]

        async def run(seed: int, steps: list[torch.Tensor]) -> None:
            async with InferenceSession(view, max_length=30) as session:
                outputs[seed] = [await session.step(hidden) for hidden in steps]

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for seed, steps in zip((5, 6), together, strict=True):
                    nursery.start_soon(run, seed, steps)
    # Six blocks deep, a prompt's fused kernels (their sums in another order) came 1.2e-5 of the
    # largest value from eager on the development machine: ten times the usual tolerance here.
    for seed, steps in ((4, alone), (5, together[0]), (6, together[1])):
        expected = whole_output(whole, steps)
        assert_close_scaled(torch.cat(outputs[seed], dim=1), expected, rel=10 * REL)
    # The lone session's prompt, its turn and its 4 steps at least, on every server.
    assert all(count >= 6 for count in calls.values()), calls
    assert all(span.compiled is not None and span.compiled.failures == 0 for _, span in spans)
