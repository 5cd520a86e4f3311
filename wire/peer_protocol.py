"""Messages peers exchange over libp2p streams: info, inference sessions, forward/backward, errors.

Each message is one frame (docs/wire.md#peer-protocol). A session is opened once per route hop
(OpenSession -> SessionOpened), then driven one Step per generated token (Step -> StepResult, or
pushed on to the next hop when the Step names next_hops), then closed. Forward and Backward are
stateless calls for training and prompt tuning (any number on one training stream). Any request
may be answered with Error.
"""

from __future__ import annotations

import enum
from typing import Literal

import torch

from wire.schema import Message, Record, message, record, spec

CompressionName = Literal[
    "raw",
    "raw+lz4",
    "float16",
    "float16+lz4",
    "bfloat16",
    "bfloat16+lz4",
    "int8-blockwise",
    "int8-blockwise+lz4",
]
"""Tensor compression names a request may ask its answer to use (wire.tensors.COMPRESSIONS)."""

MAX_ID_LEN = 128
"""Peer ids (base58 multihash, 52 characters for Ed25519) and session ids (a uuid is 36)."""

MAX_MODEL_LEN = 256
"""Model names: Hugging Face repo ids are at most 96 characters."""

MAX_ADDR_LEN = 1024
"""One multiaddr; relayed addresses (/p2p-circuit) stack two peer ids and two transports."""

MAX_ADDRS = 32
"""Addresses one peer announces: a few interfaces times transports, plus relays."""

MAX_ADAPTERS = 64
"""Adapters one server offers."""

MAX_ADAPTER_NAME_LEN = 256
"""An adapter's name (its directory's name)."""

MAX_PUBLIC_NAME_LEN = 64
"""A server's public name (`peerd start --public-name`): a short label people read in status pages;
printable text only (it ends up in terminals and web pages)."""

MAX_SERVING_LEN = 16
"""A server's device, dtype or quant name ("cuda:15", "bfloat16", "nf4"): short names only."""

MAX_BLOCKS = 4096
"""Upper bound on a block index; the deepest open models have ~130 transformer blocks."""

MAX_HOPS = 512
"""Hops in a route that a Step may carry for server-to-server push (one per span, <= blocks)."""

MAX_SESSION_TOKENS = 1 << 20
"""Most tokens an inference session may reserve (max_length); 1M-token contexts exist."""

MAX_BATCH_SIZE = 1024
"""Sequences in one session batch."""

DEFAULT_SESSIONS_PER_PEER = 64
"""Sessions a server takes from one peer by default. A daemon opens one session per local client
on every hop, so one peer may carry many users (a gateway, a shared daemon); a gateway sizes its
slots to it."""

MAX_PUSH_TOKEN_LEN = 128
"""A session's push token: a client draws 32 hex characters (128 random bits)."""

MAX_MICRO_BATCHES = 64
"""Groups a client may split its concurrent sessions' steps into (Step.micro_batch); peerd: 2."""

MAX_ERROR_MESSAGE_LEN = 4096
"""An error's text: one or two sentences, or a short traceback summary."""

MAX_WAIT_TIMEOUT_S = 3600.0
"""Longest wait for cache a client may ask for (servers cap it lower: docs/wire.md)."""

# Frame limits of the messages without tensors (Message.MAX_FRAME), far below the 256 MiB a
# tensor may need: a stranger's request is refused at its length prefix, before it is read.
TINY_FRAME = 4 << 10
"""info_request, close_session, session_opened: a few short fields."""

RECORD_FRAME = 256 << 10
"""info_response, error: a ServerInfo with every address and adapter at its longest is ~200 KiB
of UTF-8 (an error's text is 16 KiB at most)."""

ROUTE_FRAME = 1 << 20
"""open_session: its next_hops name the rest of a route, a few hundred bytes per hop (peer id,
session id, a few addresses), ~100 KiB for a route through every block of the deepest model."""


class _Span(Record):
    """Records and messages with a block span [start, end) check end > start."""

    start: int
    end: int

    def check(self) -> None:
        if self.end <= self.start:
            raise ValueError(
                f"block span end ({self.end}) must be greater than start ({self.start})"
            )


class ServerState(enum.StrEnum):
    """Where a server is in its life; only `ONLINE` servers take new sessions."""

    JOINING = "joining"  # announced its span, still loading weights or measuring throughput
    ONLINE = "online"
    DRAINING = "draining"  # finishing open sessions before it leaves or moves; takes no new ones


@record
class ServerInfo(_Span):
    """A server's live record, as answered to InfoRequest and kept in swarm snapshots."""

    peer_id: str = spec(min_len=1, max_len=MAX_ID_LEN)
    model: str = spec(min_len=1, max_len=MAX_MODEL_LEN)
    start: int = spec(ge=0, lt=MAX_BLOCKS)
    end: int = spec(gt=0, le=MAX_BLOCKS)
    throughput: float = spec(ge=0.0)  # requests*blocks/s the server can serve, as Petals measures
    free_cache_tokens: int = spec(ge=0, le=1 << 40)
    state: ServerState
    version: str = spec(min_len=1, max_len=64)  # peerd software version, e.g. "0.1.0"
    addrs: tuple[str, ...] = spec(default=(), max_items=MAX_ADDRS, min_len=1, max_len=MAX_ADDR_LEN)
    relayed: bool = False
    adapters: tuple[str, ...] = spec(
        default=(), max_items=MAX_ADAPTERS, min_len=1, max_len=MAX_ADAPTER_NAME_LEN
    )
    """Names of the adapters (e.g. LoRA) the server can apply on top of its blocks."""
    max_session_length: int = spec(default=0, ge=0, le=MAX_SESSION_TOKENS)
    """Longest session (max_length) the server opens; 0: not announced."""
    max_sessions_per_peer: int = spec(default=0, ge=0, le=1 << 20)
    """Sessions one peer may hold open or queued there; 0: not announced."""
    max_inflight_bytes_per_peer: int = spec(default=0, ge=0, le=1 << 40)
    """Bytes of steps one peer may have queued or computing there; 0: not announced."""
    queued_sessions: int = spec(default=0, ge=0, le=1 << 20)
    """Sessions waiting for cache there now (free_cache_tokens already counts them as taken)."""
    swarm: str = spec(default="", max_len=MAX_MODEL_LEN)
    """The private swarm's name (`peerd start --swarm`); "" for the public swarm. Peers of other
    swarms can still meet (mDNS, shared DHT nodes): a record of another swarm is never used."""
    public_name: str = spec(default="", max_len=MAX_PUBLIC_NAME_LEN)
    """What the server's operator calls it (`peerd start --public-name`, as Petals' public_name):
    shown by `peerd status` and the gateway's /swarm page; "" if none."""
    device: str = spec(default="", max_len=MAX_SERVING_LEN)
    """Where the blocks run: "cpu", "cuda:0", "mps" (`peerd start --device`); "" if not said."""
    dtype: str = spec(default="", max_len=MAX_SERVING_LEN)
    """The serving dtype of activations and KV cache: float32, bfloat16 or float16 (what the
    server's replies carry by default); "" if not said."""
    quant: str = spec(default="", max_len=MAX_SERVING_LEN)
    """Weight quantization of the blocks: none, int8 or nf4 (`peerd start --quant`)."""

    def check(self) -> None:
        super().check()
        if not self.public_name.isprintable():
            raise ValueError("public_name must be printable text (no control characters)")
        for name in ("device", "dtype", "quant"):
            value = getattr(self, name)
            if not all(c.isalnum() or c in ":_-." for c in value):
                raise ValueError(f"{name} must be a name like cuda:0 or bfloat16, got {value!r}")


@record
class NextHop(_Span):
    """Where a server pushes its output for server-to-server push: the next span's session."""

    peer_id: str = spec(min_len=1, max_len=MAX_ID_LEN)
    addrs: tuple[str, ...] = spec(default=(), max_items=MAX_ADDRS, min_len=1, max_len=MAX_ADDR_LEN)
    session_id: str = spec(min_len=1, max_len=MAX_ID_LEN)
    start: int = spec(ge=0, lt=MAX_BLOCKS)
    end: int = spec(gt=0, le=MAX_BLOCKS)
    push_token: str | None = spec(default=None, min_len=1, max_len=MAX_PUSH_TOKEN_LEN)
    """That session's push token (OpenSession.push_token): the pushing server puts it in the
    step it pushes there."""


@message("info_request", max_frame=TINY_FRAME)
class InfoRequest(Message):
    """Ask a server for its live record."""


@message("info_response", max_frame=RECORD_FRAME)
class InfoResponse(Message):
    record: ServerInfo


MAX_SIGNED_RECORD_LEN = 2048
"""A signed server record (routing.discovery.MAX_SIGNED_RECORD_BYTES); one with one address is
~200 bytes."""

MAX_SHARD_RECORDS = 256
"""Records one DHT node keeps under one shard key (routing.discovery.RECORDS_PER_SHARD)."""

MAX_SHARDS = 1 << 13
"""Shard counts a key may name (routing.discovery keeps at most 4096, published up to twice)."""


@message("records_request", max_frame=TINY_FRAME)
class RecordsRequest(Message):
    """Keep a server's signed record (routing.discovery.SignedRecord bytes) under a shard key
    (`record` given), or ask for the records kept under it (`record` None). A DHT node keeps
    the records of each (swarm, model, num_blocks, shard, shards) apart from every other."""

    swarm: str = spec(max_len=MAX_MODEL_LEN)
    model: str = spec(min_len=1, max_len=MAX_MODEL_LEN)
    num_blocks: int = spec(ge=1, le=MAX_BLOCKS)
    shard: int = spec(ge=0, lt=MAX_SHARDS)
    shards: int = spec(ge=1, le=MAX_SHARDS)
    record: bytes | None = spec(default=None, min_len=1, max_len=MAX_SIGNED_RECORD_LEN)


@message("records_reply", max_frame=ROUTE_FRAME)
class RecordsReply(Message):
    """The signed records kept under the key asked for (none, in answer to a put)."""

    records: tuple[bytes, ...] = spec(
        default=(), max_items=MAX_SHARD_RECORDS, max_len=MAX_SIGNED_RECORD_LEN
    )


@message("open_session", max_frame=ROUTE_FRAME)
class OpenSession(_Span, Message):
    """Open an inference session on blocks [start, end) with a KV cache of max_length tokens."""

    session_id: str = spec(min_len=1, max_len=MAX_ID_LEN)
    model: str = spec(min_len=1, max_len=MAX_MODEL_LEN)
    start: int = spec(ge=0, lt=MAX_BLOCKS)
    end: int = spec(gt=0, le=MAX_BLOCKS)
    max_length: int = spec(ge=1, le=MAX_SESSION_TOKENS)
    batch_size: int = spec(default=1, ge=1, le=MAX_BATCH_SIZE)
    next_hops: tuple[NextHop, ...] = spec(default=(), max_items=MAX_HOPS)
    """Default push route for this session's steps (a Step's own next_hops override it)."""
    reply_compression: CompressionName = "raw"
    """How the server encodes the tensors it sends in this session (results and pushes)."""
    active_adapter: str | None = spec(default=None, min_len=1, max_len=MAX_ADAPTER_NAME_LEN)
    """Run every step of the session with this LoRA adapter (one the server's record lists);
    a server without it refuses the session with `adapter_not_found`."""
    wait_timeout: float = spec(default=0.0, ge=0.0, le=MAX_WAIT_TIMEOUT_S)
    """Seconds the client will wait in the server's queue when the cache is full (0: refuse at
    once); past it the server answers Error `cache_full_timeout`."""
    left_padding: tuple[int, ...] = spec(default=(), max_items=MAX_BATCH_SIZE, ge=0)
    """Per row, how many of its first positions are padding, not tokens (a batch of prompts of
    different lengths, left-padded); () for none. The blocks never attend to them and count
    positions after them."""
    upstream: str | None = spec(default=None, min_len=1, max_len=MAX_ID_LEN)
    """The peer whose pushed steps this session takes: the hop before this one in the client's
    route. Pushes from any other peer are refused. None: from any peer (clients before this
    field; they are open to push spoofing)."""
    push_token: str | None = spec(default=None, min_len=1, max_len=MAX_PUSH_TOKEN_LEN)
    """A secret the client drew for this session: a pushed step must carry it (and come from
    `upstream`). The client hands it only in the next_hops naming this session. None: pushes
    need no token (clients before this field)."""

    def check(self) -> None:
        super().check()
        if self.left_padding and len(self.left_padding) != self.batch_size:
            raise ValueError(
                f"left_padding has {len(self.left_padding)} rows, batch_size is {self.batch_size}"
            )
        if any(pad >= self.max_length for pad in self.left_padding):
            raise ValueError("left_padding must leave each row a position for a token")


@message("session_opened", max_frame=TINY_FRAME)
class SessionOpened(Message):
    session_id: str = spec(min_len=1, max_len=MAX_ID_LEN)
    max_length: int = spec(ge=1, le=MAX_SESSION_TOKENS)  # tokens actually reserved
    # The standing this server grants the session's peer (peerd.server.standing: 0..2).
    standing: float = spec(default=0.0, ge=0.0, le=2.0)


@message("step")
class Step(Message):
    """Run hidden_states through the session's blocks, appending to (or rolling back) its cache."""

    session_id: str = spec(min_len=1, max_len=MAX_ID_LEN)
    step_id: int = spec(ge=0)
    hidden_states: torch.Tensor = spec(ndim=3, floating=True)  # [batch, tokens, hidden]
    start_position: int | None = spec(default=None, ge=0, lt=MAX_SESSION_TOKENS)
    """Cache position of the first token; earlier than the cache's length rolls the cache back."""
    next_hops: tuple[NextHop, ...] = spec(default=(), max_items=MAX_HOPS)
    """When set, push the output to next_hops[0] (carrying the rest) instead of replying."""
    push_token: str | None = spec(default=None, min_len=1, max_len=MAX_PUSH_TOKEN_LEN)
    """On a pushed step: the receiving session's push token (from the NextHop naming it)."""
    reply_last: int | None = spec(default=None, ge=1, le=MAX_SESSION_TOKENS)
    """The client needs only the last `reply_last` positions of the route's output (a prompt's
    next token needs one): the server that ends the chain (a step without next_hops) replies
    with those alone, and a server pushing its output on passes this on with it. The servers
    before the last reply whole: their outputs are the next hops' inputs, which the client
    keeps to replay them to a replacement."""
    micro_batch: int | None = spec(default=None, ge=0, lt=MAX_MICRO_BATCHES)
    """The group of its client's concurrent sessions this step belongs to: a server merges it
    with that client's steps of the same group only (other clients' steps merge as ever), so the
    groups take turns on the route's servers, one computing while the next hop computes the
    other (peerd.session.coalesce). A server pushing its output on puts the same value in the
    pushed step. None: it merges with any."""


@message("step_result")
class StepResult(Message):
    session_id: str = spec(min_len=1, max_len=MAX_ID_LEN)
    step_id: int = spec(ge=0)
    hidden_states: torch.Tensor = spec(ndim=3, floating=True)  # [batch, tokens, hidden]
    push_failed: bool = False
    """The Step named next_hops but this server could not push its output to the next one:
    the client must send it there itself (client-relayed fallback)."""


@message("close_session", max_frame=TINY_FRAME)
class CloseSession(Message):
    session_id: str = spec(min_len=1, max_len=MAX_ID_LEN)


@message("forward")
class Forward(_Span, Message):
    """Stateless forward pass through blocks [start, end) (training, prompt tuning)."""

    model: str = spec(min_len=1, max_len=MAX_MODEL_LEN)
    start: int = spec(ge=0, lt=MAX_BLOCKS)
    end: int = spec(gt=0, le=MAX_BLOCKS)
    hidden_states: torch.Tensor = spec(ndim=3, floating=True)  # [batch, tokens, hidden]
    prompts: torch.Tensor | None = spec(default=None, ndim=4, floating=True)
    """Deep prompts [end - start, batch or 1, prefix, hidden]: block i's is added to the first
    `prefix` positions of its input (docs/finetuning.md)."""
    reply_compression: CompressionName = "raw"

    def check(self) -> None:
        super().check()
        check_prompts(self.prompts, self.hidden_states, self.end - self.start)


def check_prompts(prompts: torch.Tensor | None, hidden: torch.Tensor, blocks: int) -> None:
    """ValueError unless `prompts` are deep prompts for `blocks` blocks that can be added to
    `hidden` [batch, tokens, width]: shape [blocks, batch or 1, prefix <= tokens, width]."""
    if prompts is None:
        return
    batch, tokens, width = hidden.shape
    shape = tuple(prompts.shape)
    if shape[0] != blocks or shape[1] not in (1, batch) or shape[2] > tokens or shape[3] != width:
        raise ValueError(
            f"deep prompts must have shape [{blocks}, {batch} or 1, prefix <= {tokens}, "
            f"{width}] for these hidden_states, got {list(shape)}: one [prefix, {width}] prompt "
            "per block, prefix no longer than the sequence"
        )


@message("forward_result")
class ForwardResult(Message):
    hidden_states: torch.Tensor = spec(ndim=3, floating=True)  # [batch, tokens, hidden]


@message("backward")
class Backward(_Span, Message):
    """Gradients of blocks [start, end) w.r.t. their inputs, given the outputs' gradients."""

    model: str = spec(min_len=1, max_len=MAX_MODEL_LEN)
    start: int = spec(ge=0, lt=MAX_BLOCKS)
    end: int = spec(gt=0, le=MAX_BLOCKS)
    hidden_states: torch.Tensor = spec(ndim=3, floating=True)  # [batch, tokens, hidden]
    grad_outputs: torch.Tensor = spec(ndim=3, floating=True)  # [batch, tokens, hidden]
    prompts: torch.Tensor | None = spec(default=None, ndim=4, floating=True)
    """The deep prompts the matching Forward had; their gradient comes back too."""
    reply_compression: CompressionName = "raw"

    def check(self) -> None:
        super().check()
        if self.grad_outputs.shape != self.hidden_states.shape:
            raise ValueError(
                f"grad_outputs shape {list(self.grad_outputs.shape)} must equal hidden_states "
                f"shape {list(self.hidden_states.shape)}"
            )
        check_prompts(self.prompts, self.hidden_states, self.end - self.start)


@message("backward_result")
class BackwardResult(Message):
    grad_inputs: torch.Tensor = spec(ndim=3, floating=True)  # [batch, tokens, hidden]
    grad_prompts: torch.Tensor | None = spec(default=None, ndim=4, floating=True)
    """Gradient of the Backward's prompts (same shape), when it had prompts."""


class ErrorCode(enum.StrEnum):
    """Every Error.code peerd sends, to peers and to local programs; compare and send these, never
    a string literal. (The wire allows any short snake_case string, so an older or newer peer's
    code still decodes.)"""

    BAD_REQUEST = "bad_request"  # the request broke the protocol or made no sense
    UNSUPPORTED = "unsupported"  # valid but this server does not do it (e.g. other model)
    NOT_SERVING = "not_serving"  # the blocks asked for are not (or no longer) served here
    SESSION_NOT_FOUND = "session_not_found"
    OUT_OF_CACHE = "out_of_cache"  # no room for max_length tokens right now
    BUSY = "busy"  # overloaded: retry elsewhere or later
    CACHE_FULL_TIMEOUT = "cache_full_timeout"  # waited wait_timeout in the queue, still no room
    TOO_MANY_SESSIONS = "too_many_sessions"  # this peer holds max_sessions_per_peer already
    INFLIGHT_LIMIT = "inflight_limit"  # this peer has max_inflight_bytes_per_peer in flight
    CANCELLED = "cancelled"
    INTERNAL = "internal"  # a bug on the answering side
    ADAPTER_NOT_FOUND = "adapter_not_found"  # no server (or not this one) has the adapter named
    # The server took back an idle or long-held session's cache for a request waiting for it:
    # not a fault; reopen the session (here or elsewhere) and replay its inputs.
    LEASE_EXPIRED = "lease_expired"
    # A step pushed into the session before it opened on this server was not kept (too many
    # such steps, or it came too early): not the client's fault; send it again.
    PUSH_DROPPED = "push_dropped"
    # Local API (daemon <-> its programs) and the client library.
    NO_ROUTE = "no_route"  # no chain of servers covers the model's blocks now
    INFERENCE_FAILED = "inference_failed"  # every route tried for a step failed
    CONNECTION_CLOSED = "connection_closed"  # the other side hung up mid-conversation
    BAD_REPLY = "bad_reply"  # the other side answered out of turn or with the wrong message
    NO_DAEMON = "no_daemon"  # no daemon listens on the socket
    FORWARD_NOT_FOUND = "forward_not_found"  # TrainingBackward names no forward this client ran


@message("error", max_frame=RECORD_FRAME)
class Error(Message):
    """A request failed; `message` is for a person, `code` for a program (see ErrorCode)."""

    code: str = spec(min_len=1, max_len=64)
    message: str = spec(max_len=MAX_ERROR_MESSAGE_LEN)
