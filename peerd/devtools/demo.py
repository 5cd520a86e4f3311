"""`peerd demo`: a local swarm of three daemons on the default model answers a prompt, showing
the route and tokens/s, then stops. The quickest proof that everything works on a machine."""

from __future__ import annotations

import sys
import time

import trio

from peerd.devtools.localswarm import LocalSwarm
from peerd.session.generation import encode_prompt
from peerd.session.inference import InferenceSession
from peerd.session.leech import open_leech


def run_demo(
    prompt: str, max_new_tokens: int, spans: tuple[str, ...] = ("0:10", "10:20", "20:30")
) -> str:
    swarm = LocalSwarm(refresh_period=5.0)
    try:
        for i, span in enumerate(spans):
            # One prompt: compiling each span's passes (seconds per daemon) would not pay back.
            daemon = swarm.start(f"server{i}", span, "--no-compile")
            print(f"started server {i}: blocks {span}, peer {daemon.peer_id}", file=sys.stderr)

        async def ask() -> str:
            async with open_leech("default", swarm.initial_peers, refresh_period=5.0) as leech:
                tokenizer = leech.client.tokenizer
                ids = encode_prompt(tokenizer, prompt, chat=True)
                eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
                tokens: list[int] = []
                printed = ""
                async with InferenceSession(
                    leech.swarm, max_length=ids.shape[1] + max_new_tokens
                ) as session:
                    print(f"route: {session.describe_route()}", file=sys.stderr)
                    started = time.perf_counter()
                    async for token in leech.generator.generate(
                        ids, max_new_tokens, session=session, eos_token_ids=eos
                    ):
                        tokens.append(int(token[0, 0]))
                        text = str(tokenizer.decode(tokens, skip_special_tokens=True))
                        # Print only whole characters: a partial UTF-8 sequence decodes to U+FFFD.
                        if not text.endswith("\ufffd"):
                            print(text[len(printed) :], end="", flush=True)
                            printed = text
                    elapsed = time.perf_counter() - started
                    hops = len(session.hops)
                print()
                print(
                    f"{len(tokens)} tokens in {elapsed:.1f} s: "
                    f"{len(tokens) / elapsed:.1f} tokens/s through {hops} servers",
                    file=sys.stderr,
                )
                return printed

        return trio.run(ask)
    finally:
        swarm.stop()
