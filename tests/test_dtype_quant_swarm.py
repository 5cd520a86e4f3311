"""Three real `peerd start` daemons serving the default model in a half-precision dtype: greedy
decoding through daemon a's local API equals transformers' greedy decoding in the same dtype on
the same device, and every server's record says where and how it serves. On the CPU always
(bfloat16); on a CUDA GPU where there is one (tests marked gpu)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import blocks
from peerd.devtools.localswarm import LocalSwarm
from peerd.sdk.client import Client
from tests.conftest import greedy_continuation

PROMPT = "The keeper climbed the stairs of the lighthouse at dusk and"
NEW_TOKENS = 32


def three_daemons(*serving: str) -> Iterator[LocalSwarm]:
    local = LocalSwarm()
    try:
        for name, span in (("a", "0:10"), ("b", "10:20"), ("c", "20:30")):
            local.start(name, span, *serving)
        yield local
    finally:
        local.stop()


def check_greedy_and_records(local: LocalSwarm, device: str, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = blocks.resolve_checkpoint("default")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    with torch.inference_mode():
        expected = greedy_continuation(model, tokenizer, PROMPT, NEW_TOKENS)
    ids = tokenizer(PROMPT)["input_ids"]
    with Client(local.daemons[0].socket, timeout=120) as client:
        got = client.generate_full(input_ids=ids, max_new_tokens=NEW_TOKENS).token_ids
        status = client.status()
    assert got == expected[: len(got)] and len(got) >= min(len(expected), NEW_TOKENS)
    dtype_name = str(dtype).removeprefix("torch.")
    serving = {(info.device.split(":")[0], info.dtype) for info in status.swarm}
    assert serving == {(device.split(":")[0], dtype_name)}, status.swarm


@pytest.mark.slow
@pytest.mark.multiprocess
def test_three_bfloat16_daemons_decode_as_transformers_in_bfloat16() -> None:
    for local in three_daemons("--dtype", "bfloat16"):
        check_greedy_and_records(local, "cpu", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")
def test_three_cuda_daemons_decode_as_transformers_on_cuda() -> None:
    dtype = blocks.resolve_serving("cuda", "auto").dtype
    for local in three_daemons("--device", "cuda", "--dtype", "auto"):
        check_greedy_and_records(local, "cuda:0", dtype)
