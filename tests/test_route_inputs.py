"""A session's remembered inputs (peerd.session.route.RouteKeeper): what each block boundary
took, kept for replay on failover and for spot checks. Decode steps append in place to a buffer
that doubles, and a view handed out earlier never changes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from peerd.session.route import RouteKeeper


def _keeper() -> RouteKeeper:
    swarm: Any = None  # remember, forget and truncate touch only the inputs
    options: Any = None
    return RouteKeeper(swarm, options, allowed=None, blocked=frozenset(), max_retries=1)


def test_appended_steps_are_the_concatenation_and_share_one_buffer() -> None:
    keeper, gen = _keeper(), torch.Generator().manual_seed(0)
    prompt = torch.randn(2, 7, 8, generator=gen)
    steps = [torch.randn(2, 1, 8, generator=gen) for _ in range(20)]
    keeper.remember(5, prompt)
    moves = 0
    for step in steps:
        previous = keeper.inputs[5]  # held: a new allocation cannot take its address
        keeper.remember(5, step)
        moves += keeper.inputs[5].data_ptr() != previous.data_ptr()
    assert torch.equal(keeper.inputs[5], torch.cat([prompt, *steps], dim=1))
    # 20 steps after a 7-token prompt: the history moved to a buffer of 16 positions, then to
    # one of 34, instead of to a new tensor every step.
    assert moves == 2


def test_a_view_handed_out_earlier_never_changes() -> None:
    keeper = _keeper()
    keeper.remember(0, torch.zeros(1, 4, 3))
    for i in range(4):
        keeper.remember(0, torch.full((1, 1, 3), float(i + 1)))
    before = keeper.inputs[0]
    seen = before.clone()
    keeper.truncate(6)  # a rollback: positions 6 and 7 are taken back...
    keeper.remember(0, torch.full((1, 2, 3), -1.0))  # ...and others take their place
    assert torch.equal(before, seen)
    assert torch.equal(keeper.inputs[0][:, :6], seen[:, :6])
    assert torch.equal(keeper.inputs[0][:, 6:], torch.full((1, 2, 3), -1.0))
    held = keeper.inputs[0][:, 2:5]  # the verifier's step input
    keeper.forget(0, 2)
    keeper.remember(0, held)
    assert torch.equal(keeper.inputs[0], seen[:, :5])


def test_forget_drops_later_blocks_and_a_mismatched_step_is_refused() -> None:
    keeper = _keeper()
    for block in (0, 10, 20):
        keeper.remember(block, torch.ones(1, 3, 4))
        keeper.remember(block, torch.ones(1, 1, 4))
    keeper.forget(10, 0)
    assert list(keeper.inputs) == [0] and keeper.inputs[0].shape == (1, 4, 4)
    assert list(keeper._buffers) == [0]  # nothing kept of the blocks forgotten
    keeper.forget(0, 2)
    assert keeper.inputs[0].shape == (1, 2, 4)
    with pytest.raises(RuntimeError):
        keeper.remember(0, torch.ones(2, 1, 4))  # another batch size: torch.cat's error
    assert keeper.inputs[0].shape == (1, 2, 4)
