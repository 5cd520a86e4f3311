"""The transformers-compatible model against plain transformers on the whole model: three real
`peerd start` daemons (blocks 0:10, 10:20, 20:30) serve the default model, the model talks to the
first one's socket, and transformers' own generate drives it."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import blocks
from peerd.devtools.localswarm import LocalSwarm
from peerd.sdk.client import BadRouteOptions, DaemonNotRunning
from peerd.sdk.model import (
    AutoDistributedModelForCausalLM,
    DistributedModelForCausalLM,
    ModelMismatch,
    UnsupportedGeneration,
)
from tests.numeric import CHAINED, assert_close_scaled

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

QUESTION = "What are three good reasons to learn to bake bread at home?"
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def model(swarm: LocalSwarm) -> Iterator[DistributedModelForCausalLM]:
    model = AutoDistributedModelForCausalLM.from_pretrained(
        "default", socket=swarm.daemons[0].socket
    )
    try:
        yield model
    finally:
        model.close()


@pytest.fixture(scope="module")
def local(local_model: Any) -> Any:
    """The whole model in this process, as plain transformers loads it."""
    return local_model


@pytest.fixture(scope="module")
def prompt(model: DistributedModelForCausalLM) -> torch.Tensor:
    """A real chat prompt, as the instruct model expects it: [1, tokens]."""
    messages = [{"role": "user", "content": QUESTION}]
    ids = model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    return ids


@pytest.fixture(scope="module")
def reference(local: Any, prompt: torch.Tensor) -> torch.Tensor:
    """Local greedy generate of NEW_TOKENS after the prompt: [1, prompt + NEW_TOKENS]."""
    return local.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)


def test_greedy_generate_matches_local_transformers(
    model: DistributedModelForCausalLM, prompt: torch.Tensor, reference: torch.Tensor
) -> None:
    started = time.perf_counter()
    output = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    seconds = time.perf_counter() - started
    print(
        f"{NEW_TOKENS} tokens through 3 daemons in {seconds:.2f} s "
        f"({NEW_TOKENS / seconds:.1f} tokens/s): "
        f"{model.tokenizer.decode(output[0, prompt.shape[1] :])!r}"
    )
    assert output.tolist() == reference.tolist()


def test_sampling_with_a_fixed_seed_is_reproducible(
    model: DistributedModelForCausalLM, prompt: torch.Tensor
) -> None:
    def sample() -> list[int]:
        torch.manual_seed(1234)
        out = model.generate(prompt, max_new_tokens=16, do_sample=True, temperature=0.9, top_p=0.95)
        return list(out[0, prompt.shape[1] :].tolist())

    first, second = sample(), sample()
    assert first == second
    assert len(first) == 16


def test_inference_session_continues_across_generate_calls(
    model: DistributedModelForCausalLM, prompt: torch.Tensor, reference: torch.Tensor
) -> None:
    n = prompt.shape[1]
    with model.inference_session(max_length=n + NEW_TOKENS) as session:
        first = model.generate(prompt, max_new_tokens=NEW_TOKENS // 2)
        assert session.position == n + NEW_TOKENS // 2 - 1  # the last token is not fed yet
        second = model.generate(max_new_tokens=NEW_TOKENS // 2)  # no new input: go on
        # Every token went through the servers once: the second call fed 16, not the prefix.
        assert session.position == n + NEW_TOKENS - 1
    assert first.tolist() == reference[:, : n + NEW_TOKENS // 2].tolist()
    assert second.tolist() == reference.tolist()


def test_inference_session_takes_new_tokens_between_calls(
    model: DistributedModelForCausalLM, local: Any, prompt: torch.Tensor
) -> None:
    turn = model.tokenizer(" Thanks! One more:", return_tensors="pt", add_special_tokens=False)
    extra = turn["input_ids"]
    with model.inference_session(max_length=prompt.shape[1] + extra.shape[1] + 16) as session:
        first = model.generate(prompt, max_new_tokens=8)
        second = model.generate(extra, max_new_tokens=8)
        with pytest.raises(ValueError, match="open a longer inference_session"):
            model.generate(extra, max_new_tokens=8)
    assert session.session_id is None  # closed with the block
    expected = local.generate(torch.cat([first, extra], dim=1), max_new_tokens=8)
    assert second.tolist() == expected.tolist()


def test_output_hidden_states_are_the_final_normed_states(
    model: DistributedModelForCausalLM, local: Any, prompt: torch.Tensor
) -> None:
    ours = model(prompt, output_hidden_states=True)
    theirs = local(prompt, output_hidden_states=True)
    # Two entries: the embeddings' output and the last hidden state (after the final norm), the
    # first and last of transformers' tuple; the blocks' outputs stay on the servers.
    assert len(ours.hidden_states) == 2
    last = (ours.hidden_states[-1] - theirs.hidden_states[-1]).abs().max().item()
    logits = (ours.logits - theirs.logits).abs().max().item()
    print(f"max |difference|: last hidden state {last:.2e}, logits {logits:.2e}")
    assert torch.equal(ours.hidden_states[0], theirs.hidden_states[0])
    assert_close_scaled(ours.hidden_states[-1], theirs.hidden_states[-1], rel=CHAINED)
    assert_close_scaled(ours.logits, theirs.logits, rel=CHAINED)
    assert ours.cache is None  # a session of its own, closed again


def test_beam_search_is_refused_clearly(
    model: DistributedModelForCausalLM, prompt: torch.Tensor
) -> None:
    """(Prompt lookup, refused here before, is speculative decoding now: tests/test_speculative.)"""
    with pytest.raises(UnsupportedGeneration, match="beam search needs the servers"):
        model.generate(prompt, max_new_tokens=4, num_beams=2)


def test_an_interrupted_generation_leaves_the_model_usable(
    model: DistributedModelForCausalLM, prompt: torch.Tensor, reference: torch.Tensor
) -> None:
    """Ctrl-C in the middle of a step leaves its reply unread: the next call must not read it."""

    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main
    # A real SIGINT to this thread, so it lands inside a blocking read as Ctrl-C would. It is
    # sent again until it has been taken (a slow machine may still be setting up at the first
    # one), and only the first one raises: a second Ctrl-C must not land in the cleanup below.
    taken = threading.Event()

    def on_sigint(signum: int, frame: Any) -> None:
        if not taken.is_set():
            taken.set()
            raise KeyboardInterrupt

    def press_ctrl_c() -> None:
        while not taken.wait(0.5):
            signal.pthread_kill(main, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, on_sigint)
    ctrl_c = threading.Thread(target=press_ctrl_c, daemon=True)
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            model.generate(prompt, max_new_tokens=200)
    finally:
        taken.set()
        ctrl_c.join()
        signal.signal(signal.SIGINT, previous)
    output = model.generate(prompt, max_new_tokens=8)
    assert output.tolist() == reference[:, : prompt.shape[1] + 8].tolist()


def test_no_daemon_says_how_to_start_one(tmp_path: Path) -> None:
    with pytest.raises(DaemonNotRunning, match="peerd start"):
        AutoDistributedModelForCausalLM.from_pretrained("default", socket=tmp_path / "no.sock")


def test_a_daemon_running_another_model_is_refused(swarm: LocalSwarm, tmp_path: Path) -> None:
    # The same files under another name: another model as far as names go.
    other = tmp_path / "other-model"
    other.mkdir()
    for file in blocks.resolve_checkpoint("default").iterdir():
        (other / file.name).symlink_to(file)
    with pytest.raises(ModelMismatch, match="runs smollm2-135m-instruct, not other-model"):
        AutoDistributedModelForCausalLM.from_pretrained(other, socket=swarm.daemons[0].socket)


def test_routing_controls_reach_every_session(
    swarm: LocalSwarm, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, c = swarm.daemons
    with pytest.raises(BadRouteOptions, match="'nope' is not a peer id"):
        AutoDistributedModelForCausalLM.from_pretrained(
            "default", socket=a.socket, blocked_servers=["nope"]
        )
    routed = AutoDistributedModelForCausalLM.from_pretrained(
        "default",
        socket=a.socket,
        allowed_servers=[a.peer_id, b.peer_id, c.peer_id],
        max_retries=1,
        request_timeout=30,
        show_route=True,
    )
    try:
        ids = routed.tokenizer("Once upon a time", return_tensors="pt")["input_ids"]
        assert routed.generate(ids, max_new_tokens=2).shape[1] == ids.shape[1] + 2
    finally:
        routed.close()
    route = f"route: {a.peer_id}[0:10) -> {b.peer_id}[10:20) -> {c.peer_id}[20:30)"
    assert route in capsys.readouterr().err


def test_a_left_padded_batch_generates_row_by_row_as_single_calls_and_transformers(
    model: DistributedModelForCausalLM, local: Any
) -> None:
    """Four prompts of different lengths, left-padded by the tokenizer: model.generate with the
    attention mask gives, row by row, transformers' batched generate and four single calls."""
    prompts = [
        "Once upon a time, there was a little",
        "The capital of France is",
        "Here is a list of three fruits: apples,",
        "Water boils at",
    ]
    tokenizer = model.tokenizer
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 1, "lengths should differ"
    options = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    ours = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **options)
    theirs = local.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **options)
    assert ours.tolist() == theirs.tolist()
    width = batch["input_ids"].shape[1]
    for row, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        alone = model.generate(ids, **options)[0, ids.shape[1] :].tolist()
        assert ours[row, width : width + len(alone)].tolist() == alone, prompt


def test_right_padding_is_refused_with_what_to_do(model: DistributedModelForCausalLM) -> None:
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2)
