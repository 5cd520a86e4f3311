"""`peerd bench wan`'s floor: each span's part is the median of its decode steps, so one slow
stretch of the machine while the floor is measured does not move the ratio. (The bench itself
needs network namespaces and minutes; its figures are the benchmark's, not CI's.)"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

import blocks
from peerd.bench import wan

HIDDEN = 8


class _TimedSpan:
    """A stand-in span that sleeps `step_s` a decode step, `slow_s` on the steps in `slow`
    (counted from the first call after the prompt), and `prompt_s` for the prompt."""

    def __init__(self, step_s: float, slow_s: float, slow: set[int], prompt_s: float) -> None:
        self.config = type("Config", (), {"hidden_size": HIDDEN})()
        self.step_s, self.slow_s, self.slow, self.prompt_s = step_s, slow_s, slow, prompt_s
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, hidden: torch.Tensor, session: Any) -> torch.Tensor:
        self.calls.append(tuple(hidden.shape))
        if hidden.shape[1] > 1:
            time.sleep(self.prompt_s)
        else:
            time.sleep(self.slow_s if len(self.calls) - 2 in self.slow else self.step_s)
        return hidden


def test_the_floor_takes_the_median_step_not_a_slow_stretch_nor_the_warm_up() -> None:
    # The warm-up steps (the first FLOOR_WARM_UP after the prompt) and one of the 5 timed steps
    # are slow: the mean of the timed steps would be ~40 ms, and a median that counted the
    # warm-up would be slow too; the median of the timed steps is the usual 2 ms.
    slow = set(range(wan.FLOOR_WARM_UP)) | {wan.FLOOR_WARM_UP + 2}
    span = _TimedSpan(step_s=0.002, slow_s=0.2, slow=slow, prompt_s=0.2)
    seconds = wan.median_step_seconds(span, steps=5, past=16)
    assert 0.002 <= seconds < 0.02
    assert span.calls[0] == (1, 16, HIDDEN)  # the prompt first, untimed
    assert span.calls[1:] == [(1, 1, HIDDEN)] * (wan.FLOOR_WARM_UP + 5)


def test_the_floor_times_real_decode_steps_of_the_default_model() -> None:
    span = blocks.load_span(blocks.resolve_checkpoint("default"), 0, 2)
    seconds = wan.median_step_seconds(span, steps=5, past=wan.FLOOR_PAST)
    assert math.isfinite(seconds) and 0 < seconds < 5
