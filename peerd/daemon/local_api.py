"""The daemon's local API: wire frames over a Unix socket (mode 0600) for local programs.

One connection is one client. It says Hello, then sends requests one at a time: Generate
(answered by a GeneratedToken per token, then GenerateDone; Cancel stops it), OpenInference /
InferenceStep / CloseInference (hidden states through every block, for the transformers-compatible
model), TrainingForward / TrainingBackward (cache-less passes for fine-tuning,
peerd.session.training),
and StatusRequest. Sessions a connection opens die with it. A malformed request gets an
Error reply and, when the framing itself is broken, the connection is closed; the daemon and its
other clients go on. The spec is docs/api.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import trio

import wire
from peerd import __version__
from peerd.session.generation import Generator, SamplingParams, encode_prompt, left_pad
from peerd.session.inference import AdapterUnavailable, InferenceFailed, InferenceSession
from peerd.session.training import Trainer
from routing.planner import NoRouteError, route_hops
from routing.records import record_to_info

log = logging.getLogger(__name__)

# A local client that sends nothing for this long is disconnected (its sessions freed).
IDLE_TIMEOUT_S = 3600.0
READ_CHUNK = 1 << 16
MAX_CONNECTIONS = 256


@dataclass
class ApiSession:
    """An inference session a client opened, with what it fed so far (for chat turns)."""

    inference: InferenceSession
    fed: list[int] = field(default_factory=list)  # token ids the servers' caches hold
    pending: list[int] = field(default_factory=list)  # sampled but not yet run through blocks
    messages: list[dict[str, str]] = field(default_factory=list)  # the chat so far


class ApiError(Exception):
    """A request we refuse; becomes an Error reply with this code and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class LocalApi:
    """Serves one daemon's Unix socket."""

    def __init__(
        self,
        *,
        socket_path: Path,
        get_generator: Callable[[], Any],
        status: Callable[[], wire.StatusResponse],
        welcome: Callable[[], wire.Welcome],
    ) -> None:
        self.socket_path = socket_path
        self._get_generator = get_generator
        self._status = status
        self._welcome = welcome
        self.connections = 0
        self.generations = 0  # Generate requests answered (peerd_generations_total)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        path = self.socket_path
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.exists():
            if _socket_in_use(path):
                raise OSError(
                    f"another peerd daemon is listening on {path}; stop it or give this one "
                    "another --socket"
                )
            path.unlink()
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket file is created 0600: only its owner may talk
        try:
            await sock.bind(str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        sock.listen(64)
        listener = trio.SocketListener(sock)
        try:
            task_status.started(path)
            async with trio.open_nursery() as nursery:
                while True:
                    stream = await listener.accept()
                    if self.connections >= MAX_CONNECTIONS:
                        await stream.aclose()
                        continue
                    nursery.start_soon(self._serve_connection, stream)
        finally:
            with trio.CancelScope(shield=True):
                await listener.aclose()
            path.unlink(missing_ok=True)

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        connection = _Connection(self, stream)
        try:
            await connection.run()
        finally:
            self.connections -= 1
            with trio.CancelScope(shield=True):
                await connection.close()


def _socket_in_use(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


class _Connection:
    def __init__(self, api: LocalApi, stream: trio.SocketStream) -> None:
        self.api = api
        self.stream = stream
        self.decoder = wire.MessageDecoder()
        self.sessions: dict[str, ApiSession] = {}
        self.trainer: Trainer | None = None  # made on the first training request
        self.requests: trio.MemorySendChannel[wire.Message]
        self._generation: trio.CancelScope | None = None
        # Generate requests read but not started yet, and whether a Cancel came for the next one
        # (a client may send Cancel before the daemon got round to its Generate).
        self._generates_queued = 0
        self._cancel_queued = False
        self._send_lock = trio.Lock()

    async def send(self, message: wire.Message) -> None:
        async with self._send_lock:
            await self.stream.send_all(wire.encode_message(message))

    async def error(self, code: str, text: str) -> None:
        await self.send(wire.Error(code=code, message=text))

    async def run(self) -> None:
        """Read messages; run one request at a time in a worker task so a Cancel can arrive
        while a generation streams."""
        send, receive = trio.open_memory_channel[wire.Message](16)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._work, receive)
            # When the client stops sending, requests already read are still answered (a
            # client may half-close after its last request); a generation in flight stops.
            await self._read(send)
            if self._generation is not None:
                self._generation.cancel()

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
                    continue
                if isinstance(message, wire.Cancel):
                    if self._generation is not None:
                        self._generation.cancel()
                    elif self._generates_queued:
                        self._cancel_queued = True
                    continue
                if isinstance(message, wire.Generate):
                    self._generates_queued += 1
                await requests.send(message)

    async def _refuse_bytes(self, error: wire.ProtocolError) -> None:
        """Framing broke: say why, then hang up (the byte stream can no longer be trusted)."""
        if self._generation is not None:
            self._generation.cancel()
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.error("bad_request", f"{error}; closing this connection")

    async def _work(self, requests: trio.MemoryReceiveChannel[wire.Message]) -> None:
        async for message in requests:
            try:
                await self._handle(message)
            except ApiError as e:
                await self.error(e.code, str(e))
            except NoRouteError as e:
                await self.error("no_route", str(e))
            except AdapterUnavailable as e:
                await self.error(wire.ErrorCode.ADAPTER_NOT_FOUND, str(e))
            except InferenceFailed as e:
                await self.error("inference_failed", str(e))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

    async def _handle(self, message: wire.Message) -> None:
        if isinstance(message, wire.Hello):
            await self.send(self.api._welcome())
        elif isinstance(message, wire.StatusRequest):
            await self.send(self.api._status())
        elif isinstance(message, wire.Generate):
            try:
                await self._generate(message)
            finally:
                self._generates_queued -= 1
                self._cancel_queued = False
        elif isinstance(message, wire.OpenInference):
            await self._open_inference(message)
        elif isinstance(message, wire.InferenceStep):
            await self._inference_step(message)
        elif isinstance(message, wire.TrainingForward):
            await self._training_forward(message)
        elif isinstance(message, wire.TrainingBackward):
            await self._training_backward(message)
        elif isinstance(message, wire.CloseInference):
            session = self.sessions.pop(message.session_id, None)
            if session is None:
                raise ApiError("session_not_found", f"no open session {message.session_id!r}")
            await session.inference.close()
            await self.send(wire.InferenceClosed(session_id=message.session_id))
        else:
            raise ApiError(
                "bad_request",
                f"{type(message).__name__} is not a local API request; send Hello, Generate, "
                "OpenInference, InferenceStep, CloseInference, TrainingForward, TrainingBackward, "
                "Cancel or StatusRequest",
            )

    # --- sessions ---------------------------------------------------------------------------

    async def _open_inference(self, request: wire.OpenInference) -> None:
        generator: Generator = await self.api._get_generator()
        try:
            inference = InferenceSession(
                generator.swarm,
                max_length=request.max_length,
                batch_size=request.batch_size,
                adapter=request.active_adapter,
                routing=request.routing,
                left_padding=request.left_padding,
            )
        except ValueError as e:
            raise ApiError("bad_request", str(e)) from e
        await inference.__aenter__()
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = ApiSession(inference)
        await self.send(wire.InferenceOpened(session_id=session_id, route=_hops(inference)))

    def _session(self, session_id: str) -> ApiSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise ApiError(
                "session_not_found",
                f"no open session {session_id!r} on this connection; open one with OpenInference",
            )
        return session

    async def _inference_step(self, request: wire.InferenceStep) -> None:
        session = self._session(request.session_id)
        try:
            output = await session.inference.step(request.hidden_states)
        except ValueError as e:
            raise ApiError("bad_request", str(e)) from e
        await self.send(
            wire.InferenceOutput(hidden_states=output, position=session.inference.position)
        )

    # --- training ---------------------------------------------------------------------------

    async def _trainer(self) -> Trainer:
        if self.trainer is None:
            generator: Generator = await self.api._get_generator()
            self.trainer = Trainer(generator.swarm)
        return self.trainer

    async def _training_forward(self, request: wire.TrainingForward) -> None:
        trainer = await self._trainer()
        try:
            output, forward_id, route = await trainer.forward(
                request.hidden_states, request.prompts, request.keep
            )
        except ValueError as e:
            raise ApiError("bad_request", str(e)) from e
        await self.send(
            wire.TrainingOutput(hidden_states=output, forward_id=forward_id, route=route)
        )

    async def _training_backward(self, request: wire.TrainingBackward) -> None:
        trainer = await self._trainer()
        try:
            grad_inputs, grad_prompts, route = await trainer.backward(
                request.forward_id, request.grad_outputs
            )
        except KeyError as e:
            raise ApiError("forward_not_found", str(e.args[0])) from e
        except ValueError as e:
            raise ApiError("bad_request", str(e)) from e
        await self.send(
            wire.TrainingGradients(grad_inputs=grad_inputs, grad_prompts=grad_prompts, route=route)
        )

    # --- generation -------------------------------------------------------------------------

    async def _generate(self, request: wire.Generate) -> None:
        generator: Generator = await self.api._get_generator()
        self.api.generations += 1
        tokenizer = generator.client.tokenizer
        if request.model is not None and request.model != generator.swarm.model:
            raise ApiError(
                "unsupported",
                f"this daemon runs {generator.swarm.model}, not {request.model}",
            )
        try:
            params = SamplingParams(
                do_sample=request.do_sample,
                temperature=request.temperature,
                top_k=request.top_k or 0,
                top_p=request.top_p or 1.0,
                repetition_penalty=request.repetition_penalty,
                seed=request.seed,
            )
        except ValueError as e:
            raise ApiError("bad_request", str(e)) from e
        if request.prompts is not None:
            await self._generate_batch(request, generator, params)
            return
        session = self._session(request.session_id) if request.session_id else None
        if session is not None and request.active_adapter not in (None, session.inference.adapter):
            raise ApiError(
                "bad_request",
                f"session {request.session_id} runs with adapter {session.inference.adapter!r}, "
                f"not {request.active_adapter!r}: open another session for that adapter",
            )
        new_ids = self._prompt_ids(tokenizer, request, session)
        if session is not None:
            room = session.inference.max_length - session.inference.position
            if len(new_ids) + request.max_new_tokens > room:
                raise ApiError(
                    "out_of_cache",
                    f"the session has room for {room} more tokens; this turn needs "
                    f"{len(new_ids)} + {request.max_new_tokens}: open a longer session",
                )
        eos = _eos_ids(tokenizer)
        prompt = torch.tensor([new_ids], dtype=torch.long)
        tokens: list[int] = []
        emitted = ""
        reason: Literal["length", "stop", "eos", "cancelled"] = "length"
        route: tuple[str, ...] = ()
        with trio.CancelScope() as scope:
            self._generation = scope
            if self._cancel_queued:  # the client cancelled before we started
                scope.cancel()
            async with contextlib.AsyncExitStack() as own:
                if session is not None:
                    inference = session.inference
                else:  # a session of this generation's own, routed as the request asks
                    inference = await own.enter_async_context(
                        InferenceSession(
                            generator.swarm,
                            max_length=len(new_ids) + request.max_new_tokens,
                            adapter=request.active_adapter,
                            routing=request.routing,
                        )
                    )
                stream = generator.generate(
                    prompt,
                    request.max_new_tokens,
                    params,
                    session=inference,
                    eos_token_ids=eos,
                )
                try:
                    async for token in stream:
                        token_id = int(token[0, 0])
                        tokens.append(token_id)
                        if token_id in eos:
                            reason = "eos"
                            await self.send(wire.GeneratedToken(text="", token_id=token_id))
                            break
                        text = str(tokenizer.decode(tokens, skip_special_tokens=True))
                        if text.endswith("\ufffd"):  # half a UTF-8 character: wait for the rest
                            await self.send(wire.GeneratedToken(text="", token_id=token_id))
                            continue
                        piece = text[len(emitted) :]
                        cut = _find_stop(text, request.stop, len(emitted))
                        if cut is not None:
                            piece = text[len(emitted) : cut]
                            reason = "stop"
                        await self.send(wire.GeneratedToken(text=piece, token_id=token_id))
                        emitted = text if cut is None else text[:cut]
                        if cut is not None:
                            break
                finally:
                    route = _hops(inference)  # where the generation ended, after any failover
        self._generation = None
        if scope.cancelled_caught:
            reason = "cancelled"
        if session is not None:
            # Every token but the last sampled one went through the blocks.
            session.fed += new_ids + tokens[:-1]
            session.pending = tokens[-1:]
            if request.chat:
                session.messages.append({"role": "assistant", "content": emitted})
        await self.send(wire.GenerateDone(reason=reason, token_count=len(tokens), route=route))

    async def _generate_batch(
        self, request: wire.Generate, generator: Generator, params: SamplingParams
    ) -> None:
        """Every prompt of request.prompts in one inference session, left-padded; each row's
        tokens stream with its row index and it ends on its own (EOS, a stop sequence)."""
        assert request.prompts is not None
        tokenizer = generator.client.tokenizer
        eos = _eos_ids(tokenizer)
        encoded = [
            encode_prompt(tokenizer, text, chat=request.chat)[0].tolist()
            for text in request.prompts
        ]
        if not all(encoded):
            raise ApiError("bad_request", "a prompt of the batch encodes to no tokens")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or [0])[0]
        prompt, padding = left_pad(encoded, int(pad_id))
        rows = [_RowText(tokenizer, request.stop, eos) for _ in encoded]
        route: tuple[str, ...] = ()
        with trio.CancelScope() as scope:
            self._generation = scope
            if self._cancel_queued:  # the client cancelled before we started
                scope.cancel()
            try:
                inference = InferenceSession(
                    generator.swarm,
                    max_length=prompt.shape[1] + request.max_new_tokens,
                    batch_size=len(encoded),
                    adapter=request.active_adapter,
                    routing=request.routing,
                    left_padding=padding,
                )
            except ValueError as e:
                raise ApiError("bad_request", str(e)) from e
            async with inference:
                stream = generator.generate(
                    prompt, request.max_new_tokens, params, session=inference, eos_token_ids=eos
                )
                try:
                    async for tokens in stream:
                        for index, row in enumerate(rows):
                            if row.reason is not None:
                                continue  # ended: its later samples are nobody's
                            token_id = int(tokens[index, 0])
                            text = row.add(token_id)
                            await self.send(
                                wire.GeneratedToken(text=text, token_id=token_id, row=index)
                            )
                            if row.reason is not None:
                                done = wire.GenerateDone(
                                    reason=row.reason, token_count=len(row.tokens), row=index
                                )
                                await self.send(done)
                        if all(row.reason is not None for row in rows):
                            break
                finally:
                    route = _hops(inference)
        self._generation = None
        last: Literal["cancelled", "length"] = "cancelled" if scope.cancelled_caught else "length"
        for index, row in enumerate(rows):
            if row.reason is None:
                await self.send(
                    wire.GenerateDone(
                        reason=last, token_count=len(row.tokens), row=index, route=route
                    )
                )

    def _prompt_ids(
        self, tokenizer: Any, request: wire.Generate, session: ApiSession | None
    ) -> list[int]:
        """The token ids to feed for this request: the whole prompt without a session; with one,
        only what the servers' caches do not hold yet."""
        if request.input_ids is not None:
            ids = list(request.input_ids)
            return (session.pending + ids) if session else ids
        assert request.prompt is not None
        if not request.chat:
            ids = tokenizer(request.prompt, add_special_tokens=session is None)["input_ids"]
            return (session.pending + list(ids)) if session else list(ids)
        turn = {"role": "user", "content": request.prompt}
        messages = [*(session.messages if session else []), turn]
        full = list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        if session is None:
            return full
        session.messages.append(turn)
        held = session.fed
        common = 0
        while common < min(len(held), len(full)) and held[common] == full[common]:
            common += 1
        if common < len(held):
            # The template renders the last answer differently from how it was sampled (e.g.
            # an end-of-turn token): roll the servers' caches back to where they agree.
            session.inference.rollback(common)
            session.fed = held[:common]
        session.pending = []
        return full[common:]

    async def close(self) -> None:
        for session in self.sessions.values():
            await session.inference.close()
        self.sessions.clear()
        await self.stream.aclose()


def _hops(inference: InferenceSession) -> tuple[str, ...]:
    """A session's route as the local API reports it: "peer_id[start:end)" per hop."""
    return route_hops(inference.route)


class _RowText:
    """The text of one generated sequence as its tokens arrive, and why it ended (None: it goes
    on): an end-of-sequence token, or a stop sequence (the text is cut before it)."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], eos: list[int]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.eos = eos
        self.tokens: list[int] = []
        self.emitted = ""  # the text sent so far
        self.reason: Literal["stop", "eos"] | None = None

    def add(self, token_id: int) -> str:
        """The text this token adds ("" at EOS and mid-character)."""
        self.tokens.append(token_id)
        if token_id in self.eos:
            self.reason = "eos"
            return ""
        text = str(self.tokenizer.decode(self.tokens, skip_special_tokens=True))
        if text.endswith("\ufffd"):  # half a UTF-8 character: wait for the rest
            return ""
        cut = _find_stop(text, self.stops, len(self.emitted))
        if cut is not None:
            self.reason = "stop"
            text = text[:cut]
        piece = text[len(self.emitted) :]
        self.emitted = text
        return piece


def _eos_ids(tokenizer: Any) -> list[int]:
    eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [int(eos)]


def _find_stop(text: str, stops: tuple[str, ...], emitted: int) -> int | None:
    """Index where the earliest stop sequence starts in `text`, looking only where a new match
    can be (it must end after `emitted`)."""
    best: int | None = None
    for stop in stops:
        index = text.find(stop, max(0, emitted - len(stop) + 1))
        if index != -1 and (best is None or index < best):
            best = index
    return best


def build_status(
    *,
    peer_id: str,
    started_at: float,
    server: Any,
    swarm: Any,
) -> wire.StatusResponse:
    records = list(swarm.records.values()) if swarm is not None else []
    return wire.StatusResponse(
        peer_id=peer_id,
        version=__version__,
        uptime_s=max(0.0, time.time() - started_at),
        serving=record_to_info(server.record()) if server is not None else None,
        swarm=tuple(record_to_info(r) for r in records),
        rtts=tuple(float(swarm.rtts.get(r.peer_id, -1.0)) for r in records),
        steps_served=server.counters.steps if server is not None else 0,
        tokens_served=server.counters.tokens_processed if server is not None else 0,
        reachability=swarm.node.reachability.value if swarm is not None else "unknown",
        links=tuple(swarm.link(r.peer_id) for r in records) if swarm is not None else (),
    )
