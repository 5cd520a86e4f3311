"""peerd's wire layer, sans-IO: frames, tensors and typed messages; bytes in, events out.

Nothing here reads or writes a socket or imports the rest of peerd. The byte-level spec is
docs/wire.md; the tests in tests/test_wire_*.py hold it to this code.

    frame = encode_message(Step(session_id="s", step_id=0, hidden_states=h), "float16")
    decoder = MessageDecoder()
    decoder.receive_data(chunk)          # any chunking; b"" at end of stream
    for msg in decoder: ...              # validated Step, CloseSession, ...; or ProtocolError
"""

from wire.errors import (
    FrameTooLarge,
    MalformedFrame,
    MalformedMessage,
    MalformedTensor,
    ProtocolError,
    UnexpectedMessage,
    UnknownMessageType,
    VersionMismatch,
)
from wire.framing import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, decode_frame, encode_frame
from wire.local_api import (
    Cancel,
    Generate,
    GenerateDone,
    GeneratedToken,
    StatusRequest,
    StatusResponse,
)
from wire.peer_protocol import (
    Backward,
    BackwardResult,
    CloseSession,
    Error,
    ErrorCode,
    Forward,
    ForwardResult,
    InfoRequest,
    InfoResponse,
    NextHop,
    OpenSession,
    ServerInfo,
    SessionOpened,
    Step,
    StepResult,
)
from wire.schema import (
    PROTOCOL_VERSION,
    Message,
    MessageDecoder,
    Record,
    decode_message,
    encode_message,
    message,
    message_types,
    record,
    spec,
    to_envelope,
)
from wire.tensors import (
    CODECS,
    COMPRESSIONS,
    DTYPES,
    Compression,
    decode_tensor,
    encode_tensor,
    max_abs_error,
    round_trip_error,
    same_tensor,
)

__all__ = [
    "CODECS",
    "COMPRESSIONS",
    "DEFAULT_MAX_FRAME_SIZE",
    "DTYPES",
    "PROTOCOL_VERSION",
    "Backward",
    "BackwardResult",
    "Cancel",
    "CloseSession",
    "Compression",
    "Error",
    "ErrorCode",
    "Forward",
    "ForwardResult",
    "FrameDecoder",
    "FrameTooLarge",
    "Generate",
    "GenerateDone",
    "GeneratedToken",
    "InfoRequest",
    "InfoResponse",
    "MalformedFrame",
    "MalformedMessage",
    "MalformedTensor",
    "Message",
    "MessageDecoder",
    "NextHop",
    "OpenSession",
    "ProtocolError",
    "Record",
    "ServerInfo",
    "SessionOpened",
    "StatusRequest",
    "StatusResponse",
    "Step",
    "StepResult",
    "UnexpectedMessage",
    "UnknownMessageType",
    "VersionMismatch",
    "decode_frame",
    "decode_message",
    "decode_tensor",
    "encode_frame",
    "encode_message",
    "encode_tensor",
    "max_abs_error",
    "message",
    "message_types",
    "record",
    "round_trip_error",
    "same_tensor",
    "spec",
    "to_envelope",
]
