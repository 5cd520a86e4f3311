"""Fine-tuning through the swarm: span passes with deep prompts, the server's training calls, and
(multi-process) prompt gradients through three remote spans against local autograd on the whole
model, with a server killed between forward and backward."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from transformers import AutoModelForCausalLM

import blocks
import wire
from peerd.devtools.localswarm import LocalSwarm
from peerd.sdk.client import Client, PeerdError
from peerd.sdk.model import AutoDistributedModelForCausalLM, UnsupportedGeneration
from peerd.server.block_server import BlockServer, ServerLimits
from peerd.server.compute import PRIORITY_INFERENCE, ComputeQueue
from peerd.server.training import training_backward, training_forward
from peerd.session.training import micro_batches
from tests.numeric import SAME, assert_close_scaled
from tests.tiny_models import VOCAB, save_tiny

PREFIX = 3
# fp32 through the same operations in the same order: only summation order may differ.
RELATIVE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama")


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).norm() / reference.norm())


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- the server's arithmetic, no network ---------------------------------------------------


def test_chained_span_passes_give_the_whole_span_gradients(tiny_llama: Path) -> None:
    """Forward hop by hop, then backward hop by hop as servers do it (each recomputing its own
    span), equals autograd on the whole span: for the input and for every block's prompt."""
    whole = blocks.load_span(tiny_llama, 0, 6)
    hidden = _random(2, 7, 32, seed=0)
    prompts = _random(6, 1, PREFIX, 32, seed=1) * 0.1
    grad_out = _random(2, 7, 32, seed=2)

    x = hidden.clone().requires_grad_(True)
    p = prompts.clone().requires_grad_(True)
    whole(x, prompts=p).backward(grad_out)
    assert x.grad is not None and p.grad is not None

    spans = [whole.sub_span(a, b) for a, b in ((0, 2), (2, 4), (4, 6))]
    inputs, current = [], hidden
    for span in spans:
        inputs.append(current)
        current = training_forward(span, current, prompts[span.start : span.end])
    assert_close_scaled(current, whole(hidden, prompts=prompts), rel=SAME)
    grad, grad_prompts = grad_out, []
    for span, span_input in zip(reversed(spans), reversed(inputs), strict=True):
        grad, grad_p = training_backward(span, span_input, grad, prompts[span.start : span.end])
        grad_prompts.insert(0, grad_p)
    assert relative_error(grad, x.grad) < RELATIVE_TOLERANCE
    assert relative_error(torch.cat(grad_prompts), p.grad) < RELATIVE_TOLERANCE


def test_deep_prompts_change_only_what_follows_them(tiny_llama: Path) -> None:
    span = blocks.load_span(tiny_llama, 0, 2)
    hidden = _random(1, 6, 32, seed=3)
    prompts = torch.zeros(2, 1, PREFIX, 32)
    assert_close_scaled(span(hidden, prompts=prompts), span(hidden), rel=SAME)
    prompts[1, 0, 0] = 1.0
    changed = (span(hidden, prompts=prompts) - span(hidden)).abs().sum(-1)[0]
    assert bool((changed > 0).all()), "causal attention carries the prompt to every later token"


def test_bad_prompts_are_value_errors_that_say_the_shape(tiny_llama: Path) -> None:
    span = blocks.load_span(tiny_llama, 0, 2)
    with pytest.raises(ValueError, match=r"\[2, 1 or 1, prefix <= 4, 32\]"):
        span(torch.zeros(1, 4, 32), prompts=torch.zeros(3, 1, 2, 32))
    with pytest.raises(ValueError, match="prefix <= 4"):
        span(torch.zeros(1, 4, 32), prompts=torch.zeros(2, 1, 5, 32))


def test_micro_batches_cover_every_row_once() -> None:
    assert micro_batches(3, 10, 32) == [slice(0, 3)]
    chunks = micro_batches(9, 2048, 576)  # 4096 tokens per request at most
    assert chunks == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8), slice(8, 9)]
    assert micro_batches(1, 100_000, 8) == [slice(0, 1)]  # one row is never split


@pytest.fixture
def server(tiny_llama: Path) -> BlockServer:
    span = blocks.load_span(tiny_llama, 0, 4)
    server = BlockServer(
        model=span.model,
        start=0,
        end=4,
        compute=ComputeQueue(),
        peer_id="12D3KooWtest",
        addrs=lambda: [],
        limits=ServerLimits(max_training_tokens=64),
    )
    server.go_online(span, blocks.MemoryCache(budget_tokens=1024), throughput=1.0)
    return server


async def test_server_training_calls_match_the_span(server: BlockServer) -> None:
    assert server.span is not None
    sub = server.span.sub_span(1, 3)
    hidden, grad_out = _random(2, 5, 32, seed=4), _random(2, 5, 32, seed=5)
    prompts = _random(2, 2, PREFIX, 32, seed=6)
    common = {"model": server.model, "start": 1, "end": 3, "hidden_states": hidden}
    result = await server.run_training(wire.Forward(**common, prompts=prompts))
    assert isinstance(result, wire.ForwardResult)
    assert_close_scaled(result.hidden_states, sub(hidden, prompts=prompts), rel=SAME)
    back = await server.run_training(
        wire.Backward(**common, grad_outputs=grad_out, prompts=prompts)
    )
    assert isinstance(back, wire.BackwardResult)
    x, p = hidden.clone().requires_grad_(True), prompts.clone().requires_grad_(True)
    sub(x, prompts=p).backward(grad_out)
    assert back.grad_prompts is not None and p.grad is not None and x.grad is not None
    assert_close_scaled(back.grad_inputs, x.grad, rel=SAME)
    assert_close_scaled(back.grad_prompts, p.grad, rel=SAME)
    assert all(not t.requires_grad for t in server.span.parameters())
    assert server.counters.training_passes == 2


async def test_training_waits_behind_inference_on_the_compute_queue(server: BlockServer) -> None:
    order: list[str] = []
    gate = threading.Event()
    forward = wire.Forward(model=server.model, start=0, end=4, hidden_states=torch.zeros(1, 3, 32))

    async def train() -> None:
        await server.run_training(forward)
        order.append("training")

    async def infer() -> None:
        await server.compute.run(PRIORITY_INFERENCE, lambda: None)
        order.append("inference")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.compute.run, PRIORITY_INFERENCE, gate.wait, 5)
        await trio.sleep(0.05)
        nursery.start_soon(train)
        await trio.sleep(0.05)
        nursery.start_soon(infer)  # asked later, served first
        await trio.sleep(0.05)
        gate.set()
    assert order == ["inference", "training"]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model": "other"}, "serves model"),
        ({"start": 2, "end": 6}, "cannot run blocks 2:6"),
        ({"hidden_states": torch.zeros(1, 2, 16)}, "32 wide"),
        ({"hidden_states": torch.zeros(4, 20, 32)}, "limit of 64"),
    ],
)
async def test_server_refuses_training_it_cannot_do(
    server: BlockServer, change: dict[str, Any], match: str
) -> None:
    request = {"model": server.model, "start": 0, "end": 2, "hidden_states": torch.zeros(1, 2, 32)}
    with pytest.raises(wire.ProtocolError, match=match):
        await server.run_training(wire.Forward(**{**request, **change}))


@pytest.mark.parametrize(
    ("mode", "length", "adapter", "match"),
    [
        ("lora", 4, None, "must be 'ptune' or 'deep_ptune'"),
        ("ptune", 0, None, "pre_seq_len >= 1"),
        (None, 4, None, "needs a tuning_mode"),
        ("deep_ptune", 4, "my-lora", "cannot apply a LoRA adapter"),
    ],
)
def test_tuning_options_are_checked_before_connecting(
    mode: Any, length: int, adapter: str | None, match: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=match):
        AutoDistributedModelForCausalLM.from_pretrained(
            "default",
            socket=tmp_path / "none.sock",
            tuning_mode=mode,
            pre_seq_len=length,
            active_adapter=adapter,
        )


# --- through real daemons ------------------------------------------------------------------


def reference_prompt_grads(
    model: Any, ids: torch.Tensor, labels: torch.Tensor, shallow: torch.Tensor, deep: Any
) -> tuple[float, torch.Tensor, torch.Tensor | None]:
    """Loss and prompt gradients by plain autograd on the whole model in this process: shallow
    prompts before the embeddings, deep ones added by a hook before every decoder layer."""
    shallow = shallow.detach().clone().requires_grad_(True)
    deep = None if deep is None else deep.detach().clone().requires_grad_(True)
    prefix = shallow.shape[0]
    hooks = []
    if deep is not None:
        for index, layer in enumerate(model.model.layers):

            def add_prompt(module: Any, args: tuple, kwargs: dict, index: int = index) -> Any:
                hidden = args[0] if args else kwargs["hidden_states"]
                hidden = torch.cat([hidden[:, :prefix] + deep[index], hidden[:, prefix:]], 1)
                if args:
                    return (hidden, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": hidden}

            hooks.append(layer.register_forward_pre_hook(add_prompt, with_kwargs=True))
    try:
        embeds = model.get_input_embeddings()(ids)
        batch = ids.shape[0]
        inputs = torch.cat([shallow.unsqueeze(0).expand(batch, -1, -1), embeds], 1)
        logits = model(inputs_embeds=inputs).logits[:, prefix:].contiguous()
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])
        loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    assert shallow.grad is not None
    return float(loss.detach()), shallow.grad, None if deep is None else deep.grad


def check_prompt_parity(
    distributed: Any, local: Any, ids: torch.Tensor, labels: torch.Tensor, seed: int
) -> None:
    """Random prompts (deep ones non-zero, so every path carries gradient) give the same loss
    and prompt gradients through the swarm as by local autograd."""
    torch.manual_seed(seed)
    with torch.no_grad():
        distributed.prompt_embeddings.normal_(0, 0.05)
        if distributed.intermediate_prompt_embeddings is not None:
            distributed.intermediate_prompt_embeddings.normal_(0, 0.05)
    distributed.zero_grad()
    loss = distributed(ids, labels=labels).loss
    loss.backward()
    ref_loss, ref_shallow, ref_deep = reference_prompt_grads(
        local,
        ids,
        labels,
        distributed.prompt_embeddings,
        distributed.intermediate_prompt_embeddings,
    )
    shallow_error = relative_error(distributed.prompt_embeddings.grad, ref_shallow)
    print(
        f"{distributed.tuning_mode}: loss {float(loss.detach()):.6f} vs {ref_loss:.6f}, shallow "
        f"gradient relative error {shallow_error:.2e}",
        end="",
    )
    assert math.isclose(float(loss.detach()), ref_loss, rel_tol=1e-5)
    assert shallow_error < RELATIVE_TOLERANCE
    if ref_deep is not None:
        deep_error = relative_error(distributed.intermediate_prompt_embeddings.grad, ref_deep)
        print(f", deep {deep_error:.2e}", end="")
        assert deep_error < RELATIVE_TOLERANCE
    print()


@pytest.fixture(scope="module")
def tiny_swarm(tiny_llama: Path) -> Iterator[LocalSwarm]:
    """Blocks 0:2, 2:4, 4:6 of the tiny llama, and a second server of 2:4 (d) to fail over to."""
    local = LocalSwarm()
    try:
        for name, span in (("a", "0:2"), ("b", "2:4"), ("c", "4:6"), ("d", "2:4")):
            local.start(name, span, "--model", str(tiny_llama))
        yield local
    finally:
        local.stop()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["ptune", "deep_ptune"])
def test_tiny_prompt_gradients_match_local_autograd(
    tiny_swarm: LocalSwarm, tiny_llama: Path, mode: Any
) -> None:
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    distributed = AutoDistributedModelForCausalLM.from_pretrained(
        tiny_llama, socket=tiny_swarm.daemons[0].socket, tuning_mode=mode, pre_seq_len=PREFIX
    )
    try:
        ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(7))
        labels = ids.clone()
        labels[:, :4] = -100  # loss on the answer part only, as in the example task
        check_prompt_parity(distributed, local, ids, labels, seed=8)
        with pytest.raises(UnsupportedGeneration, match="cache-less"):
            distributed.generate(ids, max_new_tokens=2)
        with torch.no_grad():  # evaluation keeps nothing on the daemon
            assert distributed(ids).logits.shape == (3, 9, VOCAB)
    finally:
        distributed.close()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bad_training_requests_get_typed_errors(tiny_swarm: LocalSwarm) -> None:
    with Client(tiny_swarm.daemons[0].socket) as client:
        with pytest.raises(PeerdError, match="no kept training pass") as missing:
            client.training_backward("nope", torch.zeros(1, 2, 32))
        assert missing.value.code == "forward_not_found"
        with pytest.raises(PeerdError, match="deep prompts must have shape") as bad:
            client.training_forward(torch.zeros(1, 4, 32), torch.zeros(2, 1, 2, 32))
        assert bad.value.code == wire.ErrorCode.BAD_REQUEST
        # The connection and the daemon go on serving.
        assert client.training_forward(torch.zeros(1, 4, 32), keep=False).forward_id is None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_killing_a_server_before_backward_gives_the_same_gradients(
    tiny_swarm: LocalSwarm,
) -> None:
    """Forward, then kill -9 the server that ran blocks 2:4: the backward re-runs that span's
    forward on the other server of 2:4 and returns exactly the gradients of an undisturbed
    pass. (Runs last in this module: it kills a daemon of the module's swarm.)"""
    hidden = _random(2, 6, 32, seed=9)
    prompts = _random(6, 1, PREFIX, 32, seed=10) * 0.1
    grad_out = _random(2, 6, 32, seed=11)
    with Client(tiny_swarm.daemons[0].socket) as client:
        calm = client.training_forward(hidden, prompts)
        assert calm.forward_id is not None
        expected = client.training_backward(calm.forward_id, grad_out)
        assert expected.grad_prompts is not None

        first = client.training_forward(hidden, prompts)
        assert first.forward_id is not None
        torch.testing.assert_close(first.hidden_states, calm.hidden_states, rtol=0, atol=0)
        middle = next(hop for hop in first.route if hop.endswith("[2:4)"))
        victim = next(d for d in tiny_swarm.daemons if middle.startswith(d.peer_id))
        other = next(d for d in tiny_swarm.daemons[1:] if d is not victim and d.span == (2, 4))
        victim.kill()
        got = client.training_backward(first.forward_id, grad_out)
    assert any(hop.startswith(other.peer_id) for hop in got.route), got.route
    assert got.grad_prompts is not None
    assert relative_error(got.grad_inputs, expected.grad_inputs) < RELATIVE_TOLERANCE
    assert relative_error(got.grad_prompts, expected.grad_prompts) < RELATIVE_TOLERANCE


# --- the default model, on the session's three-daemon swarm ------------------------------------


@pytest.fixture(scope="module")
def tuned_default(swarm: LocalSwarm) -> Iterator[Any]:
    model = AutoDistributedModelForCausalLM.from_pretrained(
        "default", socket=swarm.daemons[0].socket, tuning_mode="deep_ptune", pre_seq_len=8
    )
    try:
        yield model
    finally:
        model.close()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_default_model_prompt_gradients_match_local_autograd(
    swarm: LocalSwarm, local_model: Any, tuned_default: Any
) -> None:
    from examples.ptune import encode, make_task

    ids, labels = encode(tuned_default.tokenizer, make_task(4, seed=5))
    check_prompt_parity(tuned_default, local_model, ids, labels, seed=6)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.quality  # 75-90 s of training; the gradient parity tests above stay in CI
def test_thirty_steps_of_deep_prompt_tuning_halve_the_loss(tuned_default: Any) -> None:
    from examples.ptune import train

    with torch.no_grad():  # a fresh start, whatever the parity test left in the prompts
        tuned_default.prompt_embeddings.normal_(0, 0.02)
        tuned_default.intermediate_prompt_embeddings.zero_()
    report = train(tuned_default, steps=30)
    (loss0, acc0), (loss1, acc1) = report["before"], report["after"]
    print(
        f"\nloss curve: {' '.join(f'{x:.2f}' for x in report['curve'])}\n"
        f"held-out loss {loss0:.3f} -> {loss1:.3f}, accuracy {acc0:.0%} -> {acc1:.0%}, "
        f"30 steps in {report['seconds']:.0f} s"
    )
    assert loss1 <= loss0 / 2
    assert acc1 > acc0
