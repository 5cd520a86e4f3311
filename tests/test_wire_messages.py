"""wire messages: every message round-trips, every field is validated on construction and on
decoding, versions are checked first, and the spec in docs/wire.md matches the code."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

import wire
from wire import (
    PROTOCOL_VERSION,
    Backward,
    BackwardResult,
    Cancel,
    CloseInference,
    CloseSession,
    Error,
    Forward,
    ForwardResult,
    Generate,
    GenerateDone,
    GeneratedToken,
    Hello,
    InferenceClosed,
    InferenceOpened,
    InferenceOutput,
    InferenceStep,
    InfoRequest,
    InfoResponse,
    MalformedMessage,
    MalformedTensor,
    Message,
    MessageDecoder,
    NextHop,
    OpenInference,
    OpenSession,
    ProtocolError,
    RecordsReply,
    RecordsRequest,
    RouteOptions,
    Sampling,
    ServerInfo,
    SessionOpened,
    StatusRequest,
    StatusResponse,
    Step,
    StepResult,
    TrainingBackward,
    TrainingForward,
    TrainingGradients,
    TrainingOutput,
    UnexpectedMessage,
    UnknownMessageType,
    VersionMismatch,
    Welcome,
    decode_message,
    encode_message,
    message_types,
    to_envelope,
)
from wire.packing import packb, unpack
from wire.peer_protocol import CompressionName

DOC = Path(__file__).resolve().parent.parent / "docs" / "wire.md"

HIDDEN = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
PROMPTS = torch.randn(2, 1, 2, 8, generator=torch.Generator().manual_seed(1))  # 2 blocks, prefix 2
HOP = NextHop(
    peer_id="12D3KooWB", addrs=("/ip4/10.0.0.2/tcp/4001",), session_id="s2", start=10, end=20
)
INFO = ServerInfo(
    peer_id="12D3KooWA",
    model="smollm2-135m-instruct",
    start=0,
    end=10,
    throughput=12.5,
    free_cache_tokens=4096,
    state="online",
    version="0.1.0",
    addrs=("/ip4/10.0.0.1/tcp/4001", "/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWR/p2p-circuit"),
    relayed=True,
    adapters=("lora-a",),
    max_session_length=8192,
    max_sessions_per_peer=64,
    max_inflight_bytes_per_peer=256 << 20,
    queued_sessions=1,
    swarm="lab",
)

# Real peer ids (an Ed25519 one as 12D3KooW..., an RSA-style sha2-256 one as Qm...): routing
# controls check them.
PEER_A = "12D3KooWPTCWpA2Xi73a1uREdWgF3ssywwth3Sd8A7M5vm3zgdKp"
PEER_B = "12D3KooWDzwCfugwoor3LkCipVDjLhD22bJaQ1ontrVydY2eiiMz"
PEER_Q = "QmRU8AbmfH5aRkC5LebWmsbZGFGuqf332kUJKWgB3LJHeD"
ROUTING = RouteOptions(
    allowed_servers=(PEER_A, PEER_Q),
    blocked_servers=(PEER_B,),
    max_retries=2,
    connect_timeout=5.0,
    request_timeout=30.0,
)

EXAMPLES: list[Message] = [
    InfoRequest(),
    InfoResponse(record=INFO),
    OpenSession(
        session_id="s1",
        model="smollm2-135m-instruct",
        start=0,
        end=10,
        max_length=512,
        batch_size=2,
        next_hops=(HOP,),
        reply_compression="float16",
        active_adapter="lora-a",
        wait_timeout=10.0,
        left_padding=(3, 0),
    ),
    SessionOpened(session_id="s1", max_length=512),
    Step(session_id="s1", step_id=0, hidden_states=HIDDEN),
    Step(session_id="s1", step_id=9, hidden_states=HIDDEN, start_position=4, next_hops=(HOP,)),
    Step(session_id="s1", step_id=9, hidden_states=HIDDEN, next_hops=(HOP,), micro_batch=1),
    StepResult(session_id="s1", step_id=9, hidden_states=HIDDEN),
    CloseSession(session_id="s1"),
    Forward(model="m", start=3, end=5, hidden_states=HIDDEN.to(torch.bfloat16)),
    ForwardResult(hidden_states=HIDDEN),
    Backward(model="m", start=3, end=5, hidden_states=HIDDEN, grad_outputs=-HIDDEN),
    BackwardResult(grad_inputs=HIDDEN.to(torch.float16)),
    Forward(model="m", start=3, end=5, hidden_states=HIDDEN, prompts=PROMPTS),
    Backward(
        model="m", start=3, end=5, hidden_states=HIDDEN, grad_outputs=-HIDDEN, prompts=PROMPTS
    ),
    BackwardResult(grad_inputs=HIDDEN, grad_prompts=PROMPTS),
    Error(
        code=wire.ErrorCode.SESSION_NOT_FOUND,
        message="no session s9 here: open one with OpenSession",
    ),
    Generate(prompt="Once upon a time", max_new_tokens=20),
    Generate(
        input_ids=(1, 2, 3),
        model="smollm2-135m-instruct",
        max_new_tokens=5,
        sampling=Sampling(
            do_sample=True,
            temperature=0.7,
            top_k=50,
            top_p=0.9,
            repetition_penalty=1.1,
            seed=(1 << 64) - 1,
        ),
        stop=("\n\n", "User:"),
        active_adapter="lora-a",
        routing=ROUTING,
    ),
    Generate(prompts=("Once upon a time", "The capital of France is"), max_new_tokens=8),
    GeneratedToken(text=" girl", token_id=3304),
    GeneratedToken(text=" Paris", token_id=7042, row=1),
    GenerateDone(reason="length", token_count=20),
    GenerateDone(reason="eos", token_count=3, route=(f"{PEER_A}[0:10)", f"{PEER_Q}[10:30)")),
    GenerateDone(reason="eos", token_count=3, row=1),
    Cancel(),
    StatusRequest(),
    StatusResponse(peer_id="12D3KooWA", version="0.1.0", uptime_s=3.5, serving=INFO, swarm=(INFO,)),
    StatusResponse(
        peer_id="12D3KooWA",
        version="0.1.0",
        uptime_s=3.5,
        swarm=(INFO,),
        reachability="private",
        links=("relayed",),
    ),
    Hello(client="peerd.client 0.1.0"),
    Welcome(version="0.1.0", peer_id="12D3KooWA", model="m", num_blocks=30, hidden_size=576),
    OpenInference(max_length=512, batch_size=2),
    OpenInference(max_length=64, active_adapter="lora-a"),
    OpenInference(max_length=64, routing=RouteOptions(blocked_servers=(PEER_A,))),
    OpenInference(max_length=512, batch_size=2, left_padding=(0, 4)),
    InferenceOpened(session_id="s1", route=("12D3KooWA[0:10)", "12D3KooWB[10:30)")),
    InferenceStep(session_id="s1", hidden_states=torch.zeros(2, 1, 8)),
    InferenceOutput(hidden_states=torch.ones(2, 1, 8), position=7),
    CloseInference(session_id="s1"),
    InferenceClosed(session_id="s1"),
    TrainingForward(hidden_states=HIDDEN, prompts=PROMPTS),
    TrainingForward(hidden_states=HIDDEN, keep=False),
    TrainingOutput(hidden_states=HIDDEN, forward_id="f1", route=("12D3KooWA[0:2)",)),
    TrainingBackward(forward_id="f1", grad_outputs=-HIDDEN),
    TrainingGradients(grad_inputs=HIDDEN, grad_prompts=PROMPTS, route=("12D3KooWA[0:2)",)),
    RecordsRequest(swarm="", model="m", num_blocks=30, shard=3, shards=8, record=b"\x92\xc4"),
    RecordsRequest(swarm="lab", model="m", num_blocks=30, shard=0, shards=1),
    RecordsReply(records=(b"\x92\xc4\x01a\xc4\x01b",)),
]


def test_every_registered_message_has_an_example() -> None:
    assert {type(example) for example in EXAMPLES} == set(message_types().values())


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda example: example.TYPE)
@pytest.mark.parametrize("compression", ["raw", "raw+lz4", "bfloat16"])
def test_round_trip(example: Message, compression: str) -> None:
    frame = encode_message(example, compression)
    decoded = decode_message(frame)
    if compression == "raw" or not any(
        isinstance(value, torch.Tensor) and value.is_floating_point()
        for value in vars(example).values()
    ):
        assert decoded == example
    assert type(decoded) is type(example)
    assert decode_message(unpack(packb(to_envelope(example, compression))), expect=type(example))


def test_message_decoder_over_a_chunked_stream() -> None:
    stream = b"".join(bytes(encode_message(example)) for example in EXAMPLES)
    decoder = MessageDecoder()
    received: list[Message] = []
    for start in range(0, len(stream), 97):
        decoder.receive_data(stream[start : start + 97])
        received.extend(decoder)
    decoder.receive_data(b"")
    assert decoder.next_message() is None and decoder.ended
    assert received == EXAMPLES


def test_equality_and_repr() -> None:
    assert Step(session_id="a", step_id=1, hidden_states=HIDDEN) != Step(
        session_id="a", step_id=1, hidden_states=HIDDEN + 1
    )
    assert CloseSession(session_id="a") != Cancel()
    assert "hidden_states=tensor(float32, [2, 3, 8])" in repr(EXAMPLES[4])


# --- golden bytes, pinned here and in docs/wire.md ----------------------------------------------

GOLDEN_CLOSE_SESSION = (
    "0000003283a870726f746f636f6c01a474797065ad636c6f73655f73657373696f6ea4626f647981aa7365737369"
    "6f6e5f6964a27331"
)
GOLDEN_STEP_FLOAT16 = (
    "0000009283a870726f746f636f6c01a474797065a473746570a4626f647985aa73657373696f6e5f6964a27331a7"
    "737465705f696407ad68696464656e5f73746174657385a56474797065a7666c6f61743332a5736861706593010102"
    "a5636f646563a7666c6f61743136a36c7a34c2a464617461c404003c00c0ae73746172745f706f736974696f6e03a9"
    "6e6578745f686f707390"
)


def golden_step() -> Step:
    hidden = torch.tensor([[[1.0, -2.0]]])
    return Step(session_id="s1", step_id=7, hidden_states=hidden, start_position=3)


def test_golden_messages() -> None:
    assert bytes(encode_message(CloseSession(session_id="s1"))).hex() == GOLDEN_CLOSE_SESSION
    assert bytes(encode_message(golden_step(), "float16")).hex() == GOLDEN_STEP_FLOAT16
    assert decode_message(bytes.fromhex(GOLDEN_STEP_FLOAT16)) == golden_step()


def doc_hex() -> str:
    """Every hex digit in the doc's code blocks, whitespace removed, so wrapped dumps match."""
    blocks = re.findall(r"```(?:hex)?\n(.*?)```", DOC.read_text(), flags=re.S)
    return "".join(re.sub(r"\s+", "", block) for block in blocks)


def test_doc_pins_the_same_golden_bytes() -> None:
    from tests.test_wire_framing import GOLDEN_FRAME
    from tests.test_wire_tensors import GOLDEN_INT8, GOLDEN_RAW

    text = doc_hex()
    for golden in (
        GOLDEN_FRAME,
        GOLDEN_RAW,
        GOLDEN_INT8,
        GOLDEN_CLOSE_SESSION,
        GOLDEN_STEP_FLOAT16,
    ):
        assert golden in text, f"docs/wire.md lacks the golden bytes {golden[:40]}..."


def test_doc_lists_every_message_and_its_fields() -> None:
    text = DOC.read_text()
    for tag, cls in message_types().items():
        assert f"`{tag}`" in text, f"docs/wire.md does not describe message {tag}"
        for field in cls._wire_fields:
            assert f"`{field.name}`" in text, f"docs/wire.md lacks {tag}.{field.name}"
    for field in ServerInfo._wire_fields + NextHop._wire_fields + RouteOptions._wire_fields:
        assert f"`{field.name}`" in text


# --- envelope and version ------------------------------------------------------------------------


def envelope(**change: Any) -> dict[str, Any]:
    return {**to_envelope(CloseSession(session_id="s1")), **change}


def test_version_mismatch_names_both_versions_and_who_must_upgrade() -> None:
    with pytest.raises(
        VersionMismatch, match="version 2, this peerd speaks version 1: upgrade this"
    ):
        decode_message(envelope(protocol=PROTOCOL_VERSION + 1))
    with pytest.raises(VersionMismatch, match="the peer must upgrade") as caught:
        decode_message(envelope(protocol=0))
    assert (caught.value.remote, caught.value.local) == (0, PROTOCOL_VERSION)


def test_version_is_checked_before_anything_else_in_the_envelope() -> None:
    future = {"protocol": 7, "type": ["whatever"], "payload": 1}
    with pytest.raises(VersionMismatch):
        decode_message(future)
    with pytest.raises(VersionMismatch):
        decode_message(packb(future)[:0] + bytes(wire.encode_frame(future)))


@pytest.mark.parametrize(
    ("obj", "error", "reason"),
    [
        ({"type": "close_session", "body": {}}, MalformedMessage, "no 'protocol' field"),
        (envelope(protocol=True), MalformedMessage, "protocol must be an integer"),
        (envelope(protocol="1"), MalformedMessage, "protocol must be an integer"),
        (envelope(type=5), MalformedMessage, "type must be a string"),
        (envelope(type="teleport"), UnknownMessageType, "unknown message type 'teleport'"),
        ({"protocol": 1, "type": "cancel"}, MalformedMessage, "no body field"),
        (envelope(body=[1]), MalformedMessage, "close_session: must be a map of fields"),
        (
            envelope(body={}),
            MalformedMessage,
            "close_session.session_id: required field is missing",
        ),
        (envelope(body={"session_id": 3}), MalformedMessage, "session_id: must be a string"),
        (envelope(body={"session_id": ""}), MalformedMessage, "at least 1 characters"),
        (envelope(body={"session_id": None}), MalformedMessage, "required, got nothing"),
        ([1, 2], MalformedMessage, "holds a map"),
    ],
)
def test_malformed_envelopes(obj: Any, error: type[ProtocolError], reason: str) -> None:
    with pytest.raises(error, match=reason):
        decode_message(obj)


def test_expect_restricts_the_types_accepted() -> None:
    frame = encode_message(Cancel())
    assert decode_message(frame, expect=Cancel) == Cancel()
    with pytest.raises(UnexpectedMessage, match="got a cancel message where only step, close"):
        decode_message(frame, expect=(Step, CloseSession))
    decoder = MessageDecoder(expect=Step)
    decoder.receive_data(frame)
    with pytest.raises(UnexpectedMessage):
        decoder.next_message()
    with pytest.raises(UnexpectedMessage):  # the error stays
        decoder.next_message()


def test_unknown_fields_are_ignored_and_optional_fields_may_be_nil() -> None:
    body = {"session_id": "s1", "step_id": 1, "hidden_states": wire.encode_tensor(HIDDEN)}
    body |= {"start_position": None, "added_in_a_later_version": {"x": [1]}}
    step = decode_message({"protocol": 1, "type": "step", "body": body})
    assert isinstance(step, Step) and step.start_position is None and step.next_hops == ()


# --- field validation, on construction and on the wire -------------------------------------------


def step_body(**change: Any) -> dict[str, Any]:
    body = {"session_id": "s1", "step_id": 1, "hidden_states": wire.encode_tensor(HIDDEN)}
    return {"protocol": 1, "type": "step", "body": {**body, **change}}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"step_id": -1}, r"step\.step_id: must be >= 0, got -1"),
        ({"step_id": 1 << 63}, "does not fit in 64 bits"),
        ({"step_id": 1.0}, "must be an integer"),
        ({"step_id": True}, "must be an integer"),
        ({"hidden_states": {"dtype": "float32"}}, r"step\.hidden_states: .*shape"),
        ({"hidden_states": wire.encode_tensor(HIDDEN[0])}, "must have 3 dimensions"),
        ({"hidden_states": wire.encode_tensor(torch.ones(1, 1, 2, dtype=torch.int64))}, "floating"),
        ({"hidden_states": [1.0]}, "encoded tensor is a map"),
        ({"next_hops": {"peer_id": "x"}}, r"next_hops: must be a list"),
        ({"next_hops": [1]}, r"next_hops\[0\]: must be a map of fields"),
        ({"next_hops": [{"peer_id": "p"}]}, r"next_hops\[0\]\.addrs|next_hops\[0\]\.session_id"),
        (
            {"next_hops": [{"peer_id": "p", "session_id": "s", "start": 5, "end": 5}]},
            r"next_hops\[0\]: block span end \(5\) must be greater than start \(5\)",
        ),
        ({"next_hops": [HOP.to_dict()] * 513}, "at most 512 items"),
        ({"session_id": "x" * 129}, "at most 128 characters"),
        ({"start_position": -2}, "must be >= 0"),
    ],
)
def test_step_fields_are_validated_on_the_wire(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(MalformedMessage, match=reason):
        decode_message(step_body(**change))


def test_tensor_errors_are_malformed_tensor_with_the_field_path() -> None:
    bad = {**wire.encode_tensor(HIDDEN), "dtype": "float8"}
    with pytest.raises(MalformedTensor, match=r"^step\.hidden_states: tensor dtype 'float8'"):
        decode_message(step_body(hidden_states=bad))


def test_a_tensor_bigger_than_the_frame_limit_is_refused_even_when_lz4_makes_it_small() -> None:
    zeros = torch.zeros(1, 1024, 1024)  # 4 MiB of zeros, ~16 KiB once lz4-compressed
    frame = encode_message(ForwardResult(hidden_states=zeros), "raw+lz4")
    assert len(frame) < 64 << 10
    with pytest.raises(MalformedTensor, match="over the 65536-byte limit"):
        decode_message(frame, max_frame_size=64 << 10)


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (lambda: ServerInfo.from_dict({**INFO.to_dict(), "state": "asleep"}), "must be one of"),
        (lambda: ServerInfo.from_dict({**INFO.to_dict(), "throughput": float("nan")}), "finite"),
        (lambda: ServerInfo.from_dict({**INFO.to_dict(), "throughput": -1}), ">= 0.0"),
        (lambda: ServerInfo.from_dict({**INFO.to_dict(), "start": 10}), "greater than start"),
        (lambda: ServerInfo.from_dict({**INFO.to_dict(), "addrs": [""]}), "at least 1 char"),
        (lambda: ServerInfo.from_dict({**INFO.to_dict(), "relayed": 1}), "true or false"),
        (lambda: OpenSession.from_dict({}), "required field is missing"),
        (lambda: Generate(max_new_tokens=5), "exactly one of prompt"),
        (lambda: Generate(prompt="a", prompts=("b",), max_new_tokens=5), "exactly one of"),
        (lambda: Generate(prompts=("a", "b"), session_id="s", max_new_tokens=5), "no session_id"),
        (lambda: Generate(prompt="a", input_ids=(1,), max_new_tokens=5), "exactly one of prompt"),
        (lambda: Generate(prompt="a", max_new_tokens=0), ">= 1"),
        (lambda: Sampling(temperature=0.0), r"Sampling\.temperature: must be > 0\.0"),
        (lambda: Sampling(top_p=1.5), r"Sampling\.top_p: must be <= 1\.0"),
        (
            lambda: Generate.from_dict(
                {"prompt": "a", "max_new_tokens": 5, "sampling": {"top_k": 0}}
            ),
            r"generate\.sampling\.top_k: must be >= 1",
        ),
        (lambda: Generate(input_ids=(1, -1), max_new_tokens=5), r"input_ids\[1\]: must be >= 0"),
        (lambda: Generate(prompt="a", max_new_tokens=5, stop=("",)), "at least 1 characters"),
        (lambda: GenerateDone(reason="tired", token_count=1), "length, stop, eos, cancelled"),
        (
            lambda: Backward(
                model="m", start=0, end=1, hidden_states=HIDDEN, grad_outputs=HIDDEN[:1]
            ),
            "grad_outputs shape",
        ),
        (lambda: Step(session_id="s", step_id=0, hidden_states="not a tensor"), "must be a tensor"),
        (lambda: Step(session_id="s", step_id=0, hidden_states=HIDDEN, micro_batch=-1), ">= 0"),
        (lambda: Step(session_id="s", step_id=0, hidden_states=HIDDEN, micro_batch=64), "< 64"),
        (
            lambda: OpenSession(
                session_id="s", model="m", start=0, end=1, max_length=1, reply_compression="zip"
            ),
            "must be one of raw",
        ),
        (lambda: InfoResponse(record=HOP), "must be a ServerInfo"),
    ],
)
def test_construction_validates(build: Any, reason: str) -> None:
    with pytest.raises(MalformedMessage, match=reason):
        build()


def test_construction_normalises() -> None:
    generate = Generate(input_ids=[5, 6], max_new_tokens=1)  # type: ignore[arg-type]
    assert generate.input_ids == (5, 6) and generate.sampling == Sampling()  # greedy by default
    assert isinstance(Sampling(temperature=1).temperature, float)  # type: ignore[arg-type]
    assert ServerInfo.from_dict({**INFO.to_dict(), "updated_at": 5.0}) == INFO  # extra keys ignored


def test_reply_compression_names_match_the_codecs() -> None:
    assert typing.get_args(CompressionName) == wire.COMPRESSIONS


# --- adding a message ---------------------------------------------------------------------------


def test_adding_a_message_is_one_declaration() -> None:
    from wire.schema import _MESSAGE_TYPES, message, spec

    @message("ping_test")
    class PingTest(Message):
        nonce: int = spec(ge=0)
        note: str | None = None

    try:
        frame = encode_message(PingTest(nonce=5))
        assert decode_message(frame) == PingTest(nonce=5)
        with pytest.raises(MalformedMessage, match=r"ping_test\.nonce: must be >= 0"):
            PingTest(nonce=-1)
        with pytest.raises(ValueError, match="taken by PingTest"):
            message("ping_test")(type("Again", (Message,), {}))
    finally:
        del _MESSAGE_TYPES["ping_test"]


def test_declaration_mistakes_fail_at_import_time() -> None:
    from wire.schema import message, record

    with pytest.raises(ValueError, match="snake_case"):
        message("Bad-Tag")
    with pytest.raises(TypeError, match="no wire encoding"):

        @record
        class Bad(wire.Record):
            when: complex


# --- routing controls ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("12D3KooW0OIl", "'0IOl' is not base58"),
        ("12D3KooWA", "its multihash says 2 digest bytes but holds 5"),
        ("Qmabc", "not a multihash of a public key"),
        ("11", "an identity multihash holds a public key of 32 to 42 bytes"),
        (PEER_A[:-1], "holds 35"),
    ],
)
def test_route_options_name_a_malformed_peer_id(bad: str, why: str) -> None:
    with pytest.raises(MalformedMessage, match=re.escape(why)) as info:
        RouteOptions(blocked_servers=(PEER_A, bad))
    assert f"blocked_servers: {bad!r} is not a peer id" in str(info.value)
    with pytest.raises(MalformedMessage, match="allowed_servers"):
        RouteOptions(allowed_servers=(bad,))


def test_route_options_from_the_wire_are_checked_too() -> None:
    body = to_envelope(Generate(prompt="hi", max_new_tokens=1, routing=RouteOptions()))
    body["body"]["routing"]["blocked_servers"] = ["not-a-peer"]
    with pytest.raises(MalformedMessage, match="'not-a-peer' is not a peer id"):
        decode_message(body)


def test_route_options_limits() -> None:
    with pytest.raises(MalformedMessage, match="max_retries"):
        RouteOptions(max_retries=-1)
    with pytest.raises(MalformedMessage, match="connect_timeout"):
        RouteOptions(connect_timeout=0.0)
    with pytest.raises(MalformedMessage, match="allowed_servers"):
        RouteOptions(allowed_servers=())  # nobody allowed: say None for "anyone"


def test_peer_ids_libp2p_makes_are_accepted() -> None:
    from libp2p.crypto.ed25519 import create_new_key_pair as ed25519
    from libp2p.crypto.rsa import create_new_key_pair as rsa
    from libp2p.crypto.secp256k1 import create_new_key_pair as secp256k1
    from libp2p.peer.id import ID

    ids = [ID.from_pubkey(make().public_key).to_base58() for make in (ed25519, secp256k1, rsa)]
    assert [peer_id[:2] for peer_id in ids] == ["12", "16", "Qm"]
    assert RouteOptions(allowed_servers=tuple(ids)).allowed_servers == tuple(ids)
