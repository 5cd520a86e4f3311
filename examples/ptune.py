"""Prompt-tune the default model through a swarm: `python -m examples.ptune`.

The task is generated here: short reviews, labelled with a convention the model cannot know
beforehand (a positive review is " green", a negative one " red"). Only the trainable prompts
(deep prompt tuning: 8 positions, in every block) learn it; the servers' weights never change.
Without --socket the script starts a local swarm of three daemons (blocks 0:10, 10:20, 20:30),
tunes through the first one's socket, and stops them. docs/finetuning.md walks through it.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

POSITIVE = ["wonderful", "great", "delightful", "brilliant", "lovely", "excellent", "superb"]
NEGATIVE = ["terrible", "awful", "boring", "dreadful", "poor", "dull", "horrible"]
SUBJECTS = ["movie", "book", "meal", "concert", "hotel", "game", "show", "trip", "album"]
TEMPLATES = ["The {s} was {a}.", "What a {a} {s}!", "I found the {s} {a}.", "Honestly, a {a} {s}."]
LABELS = {True: " green", False: " red"}


@dataclass
class Example:
    text: str
    positive: bool

    @property
    def prompt(self) -> str:
        return f"Review: {self.text}\nColour:"


def make_task(count: int, seed: int) -> list[Example]:
    """`count` reviews, half positive, from a seeded generator (the same seed, the same task)."""
    rng = random.Random(seed)
    examples = []
    for i in range(count):
        positive = i % 2 == 0
        word = rng.choice(POSITIVE if positive else NEGATIVE)
        text = rng.choice(TEMPLATES).format(s=rng.choice(SUBJECTS), a=word)
        examples.append(Example(text, positive))
    rng.shuffle(examples)
    return examples


def encode(tokenizer: Any, examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [batch, tokens] and labels (-100 but on the label token). Shorter examples are
    padded on the right: with causal attention no earlier position sees the padding, so each
    example's loss is what it would be alone."""
    rows, labels = [], []
    for example in examples:
        prompt = tokenizer(example.prompt)["input_ids"]
        answer = tokenizer(LABELS[example.positive])["input_ids"]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    pad = int(tokenizer.eos_token_id or 0)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    return ids, target


def evaluate(model: Any, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """Loss on the label tokens and the share of examples whose label is the likelier of the
    two colours, without keeping anything for a backward."""
    with torch.no_grad():
        output = model(ids, labels=labels)
    positions = (labels != -100).nonzero()
    colours = [model.tokenizer(LABELS[p])["input_ids"][0] for p in (True, False)]
    correct = 0
    for row, col in positions.tolist():
        scores = output.logits[row, col - 1, colours]
        correct += int(colours[int(scores.argmax())] == int(labels[row, col]))
    return float(output.loss), correct / len(positions)


def train(
    model: Any,
    steps: int = 30,
    batch_size: int = 4,
    lr: float = 0.02,
    seed: int = 0,
    log: Any = None,
) -> dict[str, Any]:
    """`steps` Adam steps on the prompts; the loss of every step and held-out loss and accuracy
    before and after."""
    torch.manual_seed(seed)
    tokenizer = model.tokenizer
    train_set = make_task(steps * batch_size, seed)
    held_out = encode(tokenizer, make_task(16, seed + 1))
    before = evaluate(model, *held_out)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=lr)
    curve = []
    started = time.perf_counter()
    for step in range(steps):
        batch = train_set[step * batch_size : (step + 1) * batch_size]
        ids, labels = encode(tokenizer, batch)
        loss = model(ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        curve.append(float(loss.detach()))
        if log is not None:
            log(f"step {step + 1:2d}/{steps}: loss {curve[-1]:.3f}")
    seconds = time.perf_counter() - started
    after = evaluate(model, *held_out)
    return {"curve": curve, "before": before, "after": after, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", type=Path, help="a running daemon's socket (default: start 3)")
    parser.add_argument("--mode", choices=("ptune", "deep_ptune"), default="deep_ptune")
    parser.add_argument("--pre-seq-len", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args(argv)

    from peerd.devtools.localswarm import LocalSwarm
    from peerd.sdk.model import AutoDistributedModelForCausalLM

    swarm = None
    socket = args.socket
    if socket is None:
        swarm = LocalSwarm()
        for name, span in (("a", "0:10"), ("b", "10:20"), ("c", "20:30")):
            swarm.start(name, span)
            print(f"started daemon {name} on blocks {span}", file=sys.stderr)
        socket = swarm.daemons[0].socket
    try:
        model = AutoDistributedModelForCausalLM.from_pretrained(
            "default", socket=socket, tuning_mode=args.mode, pre_seq_len=args.pre_seq_len
        )
        try:
            report = train(
                model, args.steps, args.batch_size, args.lr, log=lambda s: print(s, flush=True)
            )
        finally:
            model.close()
    finally:
        if swarm is not None:
            swarm.stop()
    (loss0, acc0), (loss1, acc1) = report["before"], report["after"]
    print(f"held-out loss {loss0:.3f} -> {loss1:.3f}, accuracy {acc0:.0%} -> {acc1:.0%}")
    print(f"{args.steps} steps in {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
