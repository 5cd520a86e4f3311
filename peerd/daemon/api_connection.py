"""One local API connection: reads a client's requests and answers them one at a time.

A worker task answers the requests while the reader goes on reading, so a Cancel can arrive while
a generation streams. Each request is a fault boundary: a refusal becomes an Error with its own
code, and anything else that goes wrong in handling it (our bug, a checkpoint without a chat
template) becomes Error(internal) with the traceback in the daemon's log; the connection and the
daemon go on.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

import wire
from peerd.daemon.api_generation import Generations
from peerd.daemon.api_session import ApiError, ApiSession
from peerd.session.generation import Generator
from peerd.session.inference import AdapterUnavailable, InferenceFailed, InferenceSession
from peerd.session.training import Trainer
from routing.planner import NoRouteError, route_hops
from wire.peer_protocol import MAX_ERROR_MESSAGE_LEN

if TYPE_CHECKING:
    from peerd.daemon.local_api import LocalApi

log = logging.getLogger(__name__)

# A local client that sends nothing for this long is disconnected (its sessions freed).
IDLE_TIMEOUT_S = 3600.0
READ_CHUNK = 1 << 16
# Requests read ahead of the one being answered; past this the reader waits.
READ_AHEAD = 16

# Expected failures of a request and the code each is answered with.
_REFUSALS: tuple[tuple[type[Exception], wire.ErrorCode], ...] = (
    (NoRouteError, wire.ErrorCode.NO_ROUTE),
    (AdapterUnavailable, wire.ErrorCode.ADAPTER_NOT_FOUND),
    (InferenceFailed, wire.ErrorCode.INFERENCE_FAILED),
)


class ApiConnection:
    """A client of the local API, from Hello until it hangs up; its sessions die with it."""

    def __init__(self, api: LocalApi, stream: trio.abc.Stream) -> None:
        self.api = api
        self.stream = stream
        self.decoder = wire.MessageDecoder()
        self.sessions: dict[str, ApiSession] = {}
        self.trainer: Trainer | None = None  # made on the first training request
        self.generations = Generations(self.send)
        self._send_lock = trio.Lock()
        self._handlers: dict[type[wire.Message], Callable[[wire.Message], Awaitable[None]]] = {
            wire.Hello: self._hello,
            wire.StatusRequest: self._status,
            wire.Generate: self._generate,
            wire.OpenInference: self._open_inference,
            wire.InferenceStep: self._inference_step,
            wire.CloseInference: self._close_inference,
            wire.TrainingForward: self._training_forward,
            wire.TrainingBackward: self._training_backward,
        }

    async def send(self, message: wire.Message) -> None:
        async with self._send_lock:
            await self.stream.send_all(wire.encode_message(message))

    async def error(self, code: str, text: str) -> None:
        await self.send(wire.Error(code=code, message=text[:MAX_ERROR_MESSAGE_LEN]))

    async def run(self) -> None:
        """Read messages; run one request at a time in a worker task so a Cancel can arrive
        while a generation streams."""
        send, receive = trio.open_memory_channel[wire.Message](READ_AHEAD)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._work, receive)
            # When the client stops sending, requests already read are still answered (a
            # client may half-close after its last request); a generation in flight stops.
            await self._read(send)
            self.generations.stop()

    async def close(self) -> None:
        for session in self.sessions.values():
            await session.inference.close()
        self.sessions.clear()
        await self.stream.aclose()

    # --- reading ----------------------------------------------------------------------------

    async def _read(self, requests: trio.MemorySendChannel[wire.Message]) -> None:
        async with requests:
            while True:
                try:
                    message = self.decoder.next_message()
                except wire.ProtocolError as e:
                    await self._refuse_bytes(e)
                    return
                if message is None:
                    with trio.move_on_after(IDLE_TIMEOUT_S) as idle:
                        data = await self.stream.receive_some(READ_CHUNK)
                    if idle.cancelled_caught or not data:
                        return
                    self.decoder.receive_data(data)
                elif isinstance(message, wire.Cancel):
                    self.generations.cancel()
                else:
                    if isinstance(message, wire.Generate):
                        self.generations.queue()
                    await requests.send(message)

    async def _refuse_bytes(self, error: wire.ProtocolError) -> None:
        """Framing broke: say why, then hang up (the byte stream can no longer be trusted)."""
        self.generations.stop()
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.error(wire.ErrorCode.BAD_REQUEST, f"{error}; closing this connection")

    # --- answering --------------------------------------------------------------------------

    async def _work(self, requests: trio.MemoryReceiveChannel[wire.Message]) -> None:
        async for message in requests:
            try:
                await self._answer(message)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the client is gone: nobody to answer

    async def _answer(self, message: wire.Message) -> None:
        """Handle one request; whatever goes wrong ends this request with an Error."""
        try:
            await self._handle(message)
        except Exception as e:
            await self._refuse(message, e)

    async def _refuse(self, message: wire.Message, error: Exception) -> None:
        """Answer a failed request: a refusal or an expected failure with its own code, anything
        else with Error(internal) and its traceback in the log."""
        cause = sole_cause(error)
        if isinstance(cause, ApiError):
            await self.error(cause.code, str(cause))
            return
        code = next((c for kind, c in _REFUSALS if isinstance(cause, kind)), None)
        if code is not None:
            await self.error(code, str(cause))
            return
        name = type(message).__name__
        text = f"the daemon failed on {name}: {type(cause).__name__}: {cause}"
        # A broken stream may be this client's own (it hung up: no reply can reach it, and
        # that is no bug to log) or one of ours to a peer; the reply tells the two apart.
        gone = isinstance(cause, trio.BrokenResourceError | trio.ClosedResourceError)
        if not gone:
            log.error("local API: %s failed", name, exc_info=error)
        await self.error(wire.ErrorCode.INTERNAL, f"{text} (its log has the traceback)")
        if gone:
            log.error("local API: %s failed", name, exc_info=error)

    async def _handle(self, message: wire.Message) -> None:
        handler = self._handlers.get(type(message))
        if handler is None:
            raise ApiError(
                wire.ErrorCode.BAD_REQUEST,
                f"{type(message).__name__} is not a local API request; send Hello, Generate, "
                "OpenInference, InferenceStep, CloseInference, TrainingForward, TrainingBackward, "
                "Cancel or StatusRequest",
            )
        await handler(message)

    async def _hello(self, message: wire.Message) -> None:
        await self.send(self.api.welcome())

    async def _status(self, message: wire.Message) -> None:
        await self.send(self.api.status())

    async def _generate(self, message: wire.Message) -> None:
        assert isinstance(message, wire.Generate)
        await self.generations.run(message, self._generator_for_generate, self._session)

    async def _generator_for_generate(self, model: str | None) -> Generator:
        generator = await self.api.generator_for(model)
        self.api.generations += 1  # peerd_generations_total counts the ones that started
        return generator

    # --- sessions ---------------------------------------------------------------------------

    async def _open_inference(self, message: wire.Message) -> None:
        assert isinstance(message, wire.OpenInference)
        generator = await self.api.generator_for(message.model)
        try:
            inference = InferenceSession(
                generator.swarm,
                max_length=message.max_length,
                batch_size=message.batch_size,
                adapter=message.active_adapter,
                routing=message.routing,
                left_padding=message.left_padding,
            )
        except ValueError as e:
            raise ApiError(wire.ErrorCode.BAD_REQUEST, str(e)) from e
        await inference.__aenter__()
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = ApiSession(inference)
        await self.send(
            wire.InferenceOpened(session_id=session_id, route=route_hops(inference.route))
        )

    def _session(self, session_id: str) -> ApiSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise ApiError(
                wire.ErrorCode.SESSION_NOT_FOUND,
                f"no open session {session_id!r} on this connection; open one with OpenInference",
            )
        return session

    async def _inference_step(self, message: wire.Message) -> None:
        assert isinstance(message, wire.InferenceStep)
        session = self._session(message.session_id)
        try:
            output = await session.inference.step(message.hidden_states)
        except ValueError as e:
            raise ApiError(wire.ErrorCode.BAD_REQUEST, str(e)) from e
        await self.send(
            wire.InferenceOutput(hidden_states=output, position=session.inference.position)
        )

    async def _close_inference(self, message: wire.Message) -> None:
        assert isinstance(message, wire.CloseInference)
        session = self.sessions.pop(message.session_id, None)
        if session is None:
            raise ApiError(
                wire.ErrorCode.SESSION_NOT_FOUND, f"no open session {message.session_id!r}"
            )
        await session.inference.close()
        await self.send(wire.InferenceClosed(session_id=message.session_id))

    # --- training ---------------------------------------------------------------------------

    async def _trainer(self) -> Trainer:
        if self.trainer is None:
            generator: Generator = await self.api.generator()
            self.trainer = Trainer(generator.swarm)
        return self.trainer

    async def _training_forward(self, message: wire.Message) -> None:
        assert isinstance(message, wire.TrainingForward)
        trainer = await self._trainer()
        try:
            output, forward_id, route = await trainer.forward(
                message.hidden_states, message.prompts, message.keep
            )
        except ValueError as e:
            raise ApiError(wire.ErrorCode.BAD_REQUEST, str(e)) from e
        await self.send(
            wire.TrainingOutput(hidden_states=output, forward_id=forward_id, route=route)
        )

    async def _training_backward(self, message: wire.Message) -> None:
        assert isinstance(message, wire.TrainingBackward)
        trainer = await self._trainer()
        try:
            grad_inputs, grad_prompts, route = await trainer.backward(
                message.forward_id, message.grad_outputs
            )
        except KeyError as e:
            raise ApiError(wire.ErrorCode.FORWARD_NOT_FOUND, str(e.args[0])) from e
        except ValueError as e:
            raise ApiError(wire.ErrorCode.BAD_REQUEST, str(e)) from e
        await self.send(
            wire.TrainingGradients(grad_inputs=grad_inputs, grad_prompts=grad_prompts, route=route)
        )


def sole_cause(error: BaseException) -> BaseException:
    """The one exception inside nested exception groups of one (a nursery's), else `error`."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
