"""Messages between a local client (`peerd chat`, the client library, the gateway) and the daemon.

They travel over the daemon's Unix socket in the same frames as the peer protocol
(docs/wire.md#local-api). A client sends Generate (its Sampling record says how to pick each
token) and receives GeneratedToken messages, one per token, then GenerateDone; Cancel stops the
generation in flight. StatusRequest is answered with StatusResponse. TrainingForward /
TrainingBackward run cache-less passes for fine-tuning. A failed request is answered with
`wire.peer_protocol.Error`, shared by both protocols.
"""

from __future__ import annotations

from typing import Literal

import torch

from wire.peer_protocol import (
    MAX_ADAPTER_NAME_LEN,
    MAX_ADDR_LEN,
    MAX_ADDRS,
    MAX_BATCH_SIZE,
    MAX_BLOCKS,
    MAX_HOPS,
    MAX_ID_LEN,
    MAX_MODEL_LEN,
    MAX_SESSION_TOKENS,
    ServerInfo,
)
from wire.schema import Message, Record, message, record, spec

MAX_PROMPT_CHARS = 1 << 20
"""A prompt's text: 128k tokens of English are ~0.5 M characters (the frame's 4 MiB string limit
bounds the bytes)."""

MAX_INPUT_TOKENS = 1 << 17
"""Token ids in one prompt: a full 128k-token context."""

MAX_TOKEN_ID = (1 << 31) - 1
"""Vocabularies are at most a few hundred thousand entries; ids fit int32 everywhere."""

MAX_NEW_TOKENS = 1 << 20

MAX_STOP_SEQUENCES = 16
MAX_STOP_LEN = 256
# Speculative decoding: "draft:" and a path (PATH_MAX on Linux); drafts per pass (a pass of
# k + 1 tokens still merges with other sessions' short steps on a server).
MAX_SPECULATE_LEN = 4096 + 6
MAX_SPECULATE_TOKENS = 15

MAX_SWARM_RECORDS = 4096
"""Server records one StatusResponse lists: a large public swarm has a few hundred servers."""

MAX_ROUTE_PEERS = MAX_SWARM_RECORDS
"""Peer ids one RouteOptions may allow or block: at most every server a daemon can know of."""

MAX_RETRIES = 1000
MAX_TIMEOUT_S = 86400.0
"""A day: longer than any step or dial should ever be allowed to take."""

_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
# Multihash functions a libp2p peer id is made with: the public key itself (identity, for keys
# up to 42 bytes such as Ed25519) or its sha2-256 digest (RSA and other long keys).
_PEER_ID_HASHES = {0x00: "identity", 0x12: "sha2-256"}


def peer_id_problem(text: str) -> str | None:
    """Why `text` is not a libp2p peer id (base58btc of a multihash), or None if it is one."""
    if not text:
        return "it is empty"
    if bad := sorted({c for c in text if c not in _BASE58}):
        return f"{''.join(bad)!r} is not base58 (peer ids look like 12D3KooW... or Qm...)"
    number = 0
    for char in text:
        number = number * 58 + _BASE58.index(char)
    body = number.to_bytes((number.bit_length() + 7) // 8, "big") if number else b""
    raw = b"\0" * (len(text) - len(text.lstrip("1"))) + body
    if len(raw) < 2 or raw[0] not in _PEER_ID_HASHES:
        return "it is not a multihash of a public key (peer ids look like 12D3KooW... or Qm...)"
    if raw[1] != len(raw) - 2:
        return f"its multihash says {raw[1]} digest bytes but holds {len(raw) - 2}"
    if raw[0] == 0x12 and raw[1] != 32:
        return "a sha2-256 multihash holds 32 bytes"
    if raw[0] == 0x00 and not 32 <= raw[1] <= 42:
        # libp2p inlines keys of at most 42 bytes (Ed25519, secp256k1) and hashes longer ones.
        return "an identity multihash holds a public key of 32 to 42 bytes"
    return None


@record
class RouteOptions(Record):
    """How the daemon may route one request: which servers it may or must not use, how often it
    may replace a failed one, and how long dialing a hop and each step may take (None: the
    daemon's defaults)."""

    allowed_servers: tuple[str, ...] | None = spec(
        default=None, min_items=1, max_items=MAX_ROUTE_PEERS, min_len=1, max_len=MAX_ID_LEN
    )
    """Use only these peers (nil: any)."""
    blocked_servers: tuple[str, ...] = spec(
        default=(), max_items=MAX_ROUTE_PEERS, min_len=1, max_len=MAX_ID_LEN
    )
    """Never use these peers."""
    max_retries: int | None = spec(default=None, ge=0, le=MAX_RETRIES)
    """Failed servers the request may replace before it fails."""
    connect_timeout: float | None = spec(default=None, gt=0.0, le=MAX_TIMEOUT_S)
    """Seconds to dial a hop and open its session."""
    request_timeout: float | None = spec(default=None, gt=0.0, le=MAX_TIMEOUT_S)
    """Seconds one step may take on one hop."""

    def check(self) -> None:
        for name in ("allowed_servers", "blocked_servers"):
            for peer_id in getattr(self, name) or ():
                if (problem := peer_id_problem(peer_id)) is not None:
                    raise ValueError(f"{name}: {peer_id!r} is not a peer id: {problem}")


@record
class Sampling(Record):
    """How to pick the next token, one record from the command line or client library to the
    daemon's sampler; the defaults are greedy decoding (argmax after the repetition penalty).
    With do_sample false, temperature, top_k and top_p are not used."""

    do_sample: bool = False
    temperature: float = spec(default=1.0, gt=0.0, le=100.0)
    top_k: int | None = spec(default=None, ge=1, le=MAX_TOKEN_ID)
    """Sample among the k likeliest tokens (None: all)."""
    top_p: float | None = spec(default=None, gt=0.0, le=1.0)
    """Sample among the likeliest tokens that reach this probability mass (None: all)."""
    repetition_penalty: float = spec(default=1.0, gt=0.0, le=100.0)
    """CTRL-style penalty on tokens already in the sequence, as transformers applies it."""
    seed: int | None = spec(default=None, ge=0, le=(1 << 64) - 1)
    """Seeds the sampler, so the same request samples the same tokens (None: random)."""


@message("generate")
class Generate(Message):
    """Generate up to max_new_tokens after `prompt` (text), `input_ids`, or each of `prompts`
    (exactly one of them)."""

    prompt: str | None = spec(default=None, max_len=MAX_PROMPT_CHARS)
    input_ids: tuple[int, ...] | None = spec(
        default=None, min_items=1, max_items=MAX_INPUT_TOKENS, ge=0, le=MAX_TOKEN_ID
    )
    model: str | None = spec(default=None, min_len=1, max_len=MAX_MODEL_LEN)
    max_new_tokens: int = spec(ge=1, le=MAX_NEW_TOKENS)
    sampling: Sampling = spec(default_factory=Sampling)
    """How to pick each token (the default: greedy decoding)."""
    stop: tuple[str, ...] = spec(
        default=(), max_items=MAX_STOP_SEQUENCES, min_len=1, max_len=MAX_STOP_LEN
    )
    chat: bool = False
    """Treat `prompt` as a user's chat message: wrap it in the model's chat template."""
    session_id: str | None = spec(default=None, min_len=1, max_len=MAX_ID_LEN)
    """Continue this open inference session (OpenInference) instead of starting afresh: the
    servers' caches already hold the conversation, so only the new tokens travel."""
    active_adapter: str | None = spec(default=None, min_len=1, max_len=MAX_ADAPTER_NAME_LEN)
    """Generate with this LoRA adapter: routed only through servers that list it. With
    session_id, the session's own adapter applies and this must be unset or name the same."""
    routing: RouteOptions | None = None
    """Limits on the route (ignored with session_id: the session's route stands)."""
    prompts: tuple[str, ...] | None = spec(
        default=None, min_items=1, max_items=MAX_BATCH_SIZE, max_len=MAX_PROMPT_CHARS
    )
    """A batch: several prompts generated together in one inference session (left-padded), each
    row stopping on its own; tokens and endings carry their row (its index here)."""
    speculate: str = spec(default="off", min_len=1, max_len=MAX_SPECULATE_LEN)
    """Speculative decoding: "auto" (prompt lookup, drafts per pass adapted to how many stand
    and to the chain's latency, off where it does not pay), "ngram" (prompt lookup),
    "draft:PATH" (a small local checkpoint with the model's tokenizer, run by the daemon) or
    "off". The same tokens as without (greedy), the same distribution (sampling); a batch of
    prompts decodes without."""
    speculate_tokens: int | None = spec(default=None, ge=1, le=MAX_SPECULATE_TOKENS)
    """Drafts per pass (transformers' prompt_lookup_num_tokens / num_assistant_tokens); with
    "auto", the most it may choose. None: the drafter's default."""

    def check(self) -> None:
        if self.speculate not in ("auto", "ngram", "off") and not (
            self.speculate.startswith("draft:") and len(self.speculate) > len("draft:")
        ):
            raise ValueError(
                f"speculate {self.speculate[:80]!r}: give auto, ngram, draft:PATH or off"
            )
        given = sum(x is not None for x in (self.prompt, self.input_ids, self.prompts))
        if given != 1:
            raise ValueError(
                "give exactly one of prompt (text), input_ids (token ids) and prompts (a batch)"
            )
        if self.prompts is not None and self.session_id is not None:
            raise ValueError("a batch of prompts runs in a session of its own: no session_id")


@message("hello")
class Hello(Message):
    """A client's first message on a connection: who it is (the envelope carries the protocol
    version, so a client of another version gets VersionMismatch at once)."""

    client: str = spec(default="peerd-client", max_len=128)


@message("welcome")
class Welcome(Message):
    """The daemon's answer to Hello: what it runs."""

    version: str = spec(min_len=1, max_len=64)
    peer_id: str = spec(min_len=1, max_len=MAX_ID_LEN)
    model: str = spec(min_len=1, max_len=MAX_MODEL_LEN)
    num_blocks: int = spec(ge=1)
    hidden_size: int = spec(ge=1)


@message("open_inference")
class OpenInference(Message):
    """Open an inference session through the swarm, owned by this connection (closed with it)."""

    max_length: int = spec(ge=1, le=MAX_SESSION_TOKENS)
    batch_size: int = spec(default=1, ge=1, le=MAX_BATCH_SIZE)
    active_adapter: str | None = spec(default=None, min_len=1, max_len=MAX_ADAPTER_NAME_LEN)
    """Run the session's blocks with this LoRA adapter, only on servers that list it."""
    routing: RouteOptions | None = None
    left_padding: tuple[int, ...] = spec(default=(), max_items=MAX_BATCH_SIZE, ge=0)
    """Per row, how many of its first positions are padding (prompts of different lengths,
    left-padded); () for none. The servers never attend to them."""
    model: str | None = spec(default=None, min_len=1, max_len=MAX_MODEL_LEN)
    """The swarm model to run the session on, by name (StatusResponse.models); None: the
    daemon's own model."""


@message("inference_opened")
class InferenceOpened(Message):
    session_id: str = spec(min_len=1, max_len=MAX_ID_LEN)
    route: tuple[str, ...] = spec(default=(), max_items=4096, max_len=512)
    """The hops, as "peer_id[start:end)"."""


@message("inference_step")
class InferenceStep(Message):
    """Run hidden states (after the embeddings) through every block in the session."""

    session_id: str = spec(min_len=1, max_len=MAX_ID_LEN)
    hidden_states: torch.Tensor = spec(ndim=3, floating=True)  # [batch, tokens, hidden]


@message("inference_output")
class InferenceOutput(Message):
    hidden_states: torch.Tensor = spec(ndim=3, floating=True)  # [batch, tokens, hidden]
    position: int = spec(ge=0)
    """Tokens the session holds after this step."""


@message("close_inference")
class CloseInference(Message):
    session_id: str = spec(min_len=1, max_len=MAX_ID_LEN)


@message("inference_closed")
class InferenceClosed(Message):
    session_id: str = spec(min_len=1, max_len=MAX_ID_LEN)


@message("training_forward")
class TrainingForward(Message):
    """Run hidden states (after the embeddings) through every block with no KV cache, on a
    training route; with `keep`, the daemon keeps what TrainingBackward needs under the
    returned forward_id (docs/finetuning.md)."""

    hidden_states: torch.Tensor = spec(ndim=3, floating=True)  # [batch, tokens, hidden]
    prompts: torch.Tensor | None = spec(default=None, ndim=4, floating=True)
    """Deep prompts for every block: [num_blocks, batch or 1, prefix, hidden]."""
    keep: bool = True
    """Keep the inputs for a TrainingBackward (False for evaluation: nothing is kept)."""


@message("training_output")
class TrainingOutput(Message):
    hidden_states: torch.Tensor = spec(ndim=3, floating=True)  # [batch, tokens, hidden]
    forward_id: str | None = spec(default=None, min_len=1, max_len=MAX_ID_LEN)
    """Names the kept pass for TrainingBackward (None when the request did not keep it)."""
    route: tuple[str, ...] = spec(default=(), max_items=4096, max_len=512)
    """The hops, as "peer_id[start:end)", after any re-routing during the pass."""


@message("training_backward")
class TrainingBackward(Message):
    """Gradients of a kept TrainingForward's inputs (and deep prompts), given its outputs'
    gradient. The kept pass is released, whatever the outcome."""

    forward_id: str = spec(min_len=1, max_len=MAX_ID_LEN)
    grad_outputs: torch.Tensor = spec(ndim=3, floating=True)  # [batch, tokens, hidden]


@message("training_gradients")
class TrainingGradients(Message):
    grad_inputs: torch.Tensor = spec(ndim=3, floating=True)  # [batch, tokens, hidden]
    grad_prompts: torch.Tensor | None = spec(default=None, ndim=4, floating=True)
    """Same shape as the forward's prompts, when it had some."""
    route: tuple[str, ...] = spec(default=(), max_items=4096, max_len=512)
    """The hops the backward pass went through (a replacement's, after a failure)."""


@message("generated_token")
class GeneratedToken(Message):
    """One new token: its id and the text it adds (may be empty mid-character)."""

    text: str = spec(max_len=4096)
    token_id: int = spec(ge=0, le=MAX_TOKEN_ID)
    row: int = spec(default=0, ge=0, lt=MAX_BATCH_SIZE)
    """The prompt of a batch (index in Generate.prompts) this token continues."""


@message("generate_done")
class GenerateDone(Message):
    """The generation ended: max_new_tokens reached, a stop sequence, end of sequence, or Cancel."""

    reason: Literal["length", "stop", "eos", "cancelled"]
    token_count: int = spec(ge=0, le=MAX_NEW_TOKENS)
    route: tuple[str, ...] = spec(default=(), max_items=MAX_HOPS, max_len=512)
    """The hops the generation ended on, as "peer_id[start:end)" (after any failover)."""
    row: int = spec(default=0, ge=0, lt=MAX_BATCH_SIZE)
    """The row of a batch that ended; a batch ends when every row has had its GenerateDone."""


@message("cancel")
class Cancel(Message):
    """Stop the generation in flight on this connection (answered by GenerateDone cancelled)."""


@message("status_request")
class StatusRequest(Message):
    """Ask the daemon what it serves and what it knows of the swarm."""


MAX_SWARM_MODELS = 64
"""Models one StatusResponse lists: a swarm runs a handful (chat.petals.dev offers a few)."""


@record
class SwarmModel(Record):
    """One model served in the swarm, as a daemon knows it (docs/swarm.md#several-models)."""

    name: str = spec(min_len=1, max_len=MAX_MODEL_LEN)
    servers: int = spec(default=0, ge=0)
    """Servers of the model this daemon knows of."""
    num_blocks: int = spec(default=0, ge=0, le=MAX_BLOCKS)
    """The model's blocks; 0: unknown here (this daemon has no checkpoint of it)."""
    blocks_served: int = spec(default=0, ge=0, le=MAX_BLOCKS)
    """Blocks at least one online server holds: all of them (== num_blocks) is full coverage."""
    checkpoint: str = spec(default="", max_len=4096)
    """Where this daemon loads the model's client side from (a local directory); "": it has no
    checkpoint of the model, so local programs cannot generate with it here."""


@message("status_response")
class StatusResponse(Message):
    peer_id: str = spec(min_len=1, max_len=MAX_ID_LEN)
    version: str = spec(min_len=1, max_len=64)
    uptime_s: float = spec(ge=0.0)
    serving: ServerInfo | None = None
    """This daemon's own record when it serves blocks."""
    swarm: tuple[ServerInfo, ...] = spec(default=(), max_items=MAX_SWARM_RECORDS)
    """The servers this daemon knows of, as last seen."""
    rtts: tuple[float, ...] = spec(default=(), max_items=MAX_SWARM_RECORDS)
    """Smoothed round trip to each server in `swarm`, seconds (-1: not measured)."""
    steps_served: int = spec(default=0, ge=0)
    """Inference steps this daemon's block server has run."""
    tokens_served: int = spec(default=0, ge=0)
    """Tokens (batch x positions) that went through this daemon's blocks."""
    reachability: str = spec(default="unknown", max_len=16)
    """Whether peers can dial this daemon: public, private (behind NAT) or unknown."""
    links: tuple[str, ...] = spec(default=(), max_items=MAX_SWARM_RECORDS)
    """How this daemon is connected to each server in `swarm` now: direct, relayed or none."""
    num_blocks: int = spec(default=0, ge=0, le=MAX_BLOCKS)
    """Blocks of the daemon's model (0: a daemon before this field), so blocks past the last one
    any server holds count as missing."""
    addrs: tuple[str, ...] = spec(default=(), max_items=MAX_ADDRS, min_len=1, max_len=MAX_ADDR_LEN)
    """Where other machines dial this daemon (its banner's addresses), best first."""
    models: tuple[SwarmModel, ...] = spec(default=(), max_items=MAX_SWARM_MODELS)
    """Every model this daemon knows to be served in the swarm (its own first), and the ones it
    can load; generate with one by naming it in Generate.model / OpenInference.model."""
    standing: float = spec(default=0.0, ge=0.0, le=2.0)
    """This daemon's standing as the servers it used lately grant it (their median)."""
    contributor_share: float = spec(default=0.0, ge=0.0, le=1.0)
    """Share of this daemon's block server's work that went to peers with standing."""
