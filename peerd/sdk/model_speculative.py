"""`generate(..., assistant_model=...)` and `generate(..., prompt_lookup_num_tokens=...)` of
AutoDistributedModelForCausalLM, as transformers spells them: the daemon's own speculative
decoding (docs/swarm.md#speculative-decoding), one Generate request of the local API, rather
than transformers' assisted generation (which would crop the servers' caches a step at a time).

The assistant model runs on the daemon's machine, from the local directory it was loaded from;
the tokens are plain greedy's (or plain sampling's distribution), as with transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from peerd.sdk.model_checks import UnsupportedGeneration, new_tokens, prompt_length
from peerd.sdk.options import GenerateOptions

NO_SPECULATIVE_SESSION = (
    "assistant_model / prompt_lookup_num_tokens run in a session of their own: call generate "
    "outside inference_session"
)
MAX_DRAFTS = 15  # wire.local_api.MAX_SPECULATE_TOKENS: more are clamped, not refused


def wants_speculation(config: GenerationConfig, kwargs: dict[str, Any]) -> bool:
    """Whether a generate call asks for assisted generation or prompt lookup."""
    return kwargs.get("assistant_model") is not None or bool(config.prompt_lookup_num_tokens)


def speculate_option(config: GenerationConfig, kwargs: dict[str, Any]) -> tuple[str, int | None]:
    """The local API's (speculate, speculate_tokens) for a generate call's keywords."""
    assistant = kwargs.get("assistant_model")
    if assistant is None:
        return "ngram", min(int(config.prompt_lookup_num_tokens), MAX_DRAFTS)
    path = Path(str(getattr(assistant, "name_or_path", "") or ""))
    if not (path / "config.json").is_file():
        raise UnsupportedGeneration(
            "the daemon runs the assistant model from the local directory it was loaded from: "
            "load it with from_pretrained(DIRECTORY) (a small checkpoint with this model's "
            "tokenizer), or use prompt_lookup_num_tokens=N"
        )
    return f"draft:{path.resolve()}", None


def speculative_generate(
    model: Any,
    inputs: torch.Tensor | None,
    config: GenerationConfig,
    given: tuple[GenerationConfig | None, GenerationConfig | None],
    session: Any,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """The sequence (prompt + new tokens, [1, length]) of one speculative generation of `model`
    (a DistributedModelForCausalLM) through its daemon; `given`: the generation_config passed
    to the call and the model's own."""
    if session is not None or model.active_session is not None:
        raise UnsupportedGeneration(NO_SPECULATIVE_SESSION)
    if inputs is None or inputs.shape[0] != 1 or kwargs.get("inputs_embeds") is not None:
        raise UnsupportedGeneration(
            "assistant_model / prompt_lookup_num_tokens through the swarm take input_ids of one "
            "sequence (batch of 1)"
        )
    if kwargs.get("return_dict_in_generate") or config.return_dict_in_generate:
        raise UnsupportedGeneration(
            "assistant_model / prompt_lookup_num_tokens return the token ids only: drop "
            "return_dict_in_generate"
        )
    speculate, tokens = speculate_option(config, kwargs)
    max_new_tokens = new_tokens(config, given, kwargs, prompt_length(inputs, kwargs))
    options = GenerateOptions(
        max_new_tokens=max_new_tokens,
        do_sample=bool(config.do_sample),
        temperature=float(config.temperature or 1.0),
        top_k=int(config.top_k) if config.do_sample and config.top_k else None,
        top_p=float(config.top_p) if config.do_sample and config.top_p else None,
        repetition_penalty=float(config.repetition_penalty or 1.0),
        # transformers samples from torch's global generator: so does this, through a seed.
        seed=int(torch.randint(0, 2**62, ())) if config.do_sample else None,
        active_adapter=model.active_adapter,
        speculate=speculate,
        speculate_tokens=tokens,
    )
    prompt = [int(t) for t in inputs[0]]
    with model.daemon.request() as client:
        result = client.generate_full(input_ids=prompt, options=options)
    return torch.tensor([prompt + list(result.token_ids)], dtype=torch.long)
