"""wire.conversation driven by messages alone: the inference (and push) conversation of each role
and the training conversation, each rule breaking with the ConversationError that names it."""

from __future__ import annotations

import pytest
import torch

import wire
from wire.conversation import (
    BadStartPosition,
    ClientInference,
    CloseRequested,
    LateReply,
    Opened,
    OpenRequested,
    OutOfTurn,
    Phase,
    PushRefused,
    Refused,
    ServerInference,
    StepDone,
    StepOutOfOrder,
    StepRequested,
    TooManyPushed,
    UnexpectedReply,
    WrongSession,
)
from wire.training_conversation import (
    ClientTraining,
    ServerTraining,
    TrainingDone,
    TrainingRequested,
)

UPSTREAM = "12D3KooWUpstream"


def _open(**fields: object) -> wire.OpenSession:
    values: dict[str, object] = dict(session_id="s", model="m", start=0, end=2, max_length=8)
    values.update(fields)
    return wire.OpenSession(**values)  # type: ignore[arg-type]


def _step(step_id: int, tokens: int = 1, start_position: int | None = None) -> wire.Step:
    return wire.Step(
        session_id="s",
        step_id=step_id,
        hidden_states=torch.zeros(1, tokens, 4),
        start_position=start_position,
    )


def _result(step_id: int) -> wire.StepResult:
    return wire.StepResult(session_id="s", step_id=step_id, hidden_states=torch.zeros(1, 1, 4))


def _server(**fields: object) -> ServerInference:
    """A server conversation with its session open (max_length 8)."""
    conv = ServerInference()
    assert isinstance(conv.receive(_open(**fields)), OpenRequested)
    assert conv.opened(8) == wire.SessionOpened(session_id="s", max_length=8)
    return conv


def _client() -> ClientInference:
    conv = ClientInference(_open())
    assert isinstance(conv.received(wire.SessionOpened(session_id="s", max_length=8)), Opened)
    return conv


# --- server side --------------------------------------------------------------------------------


def test_a_session_opens_steps_in_order_and_closes() -> None:
    conv = _server()
    for step_id, tokens in [(0, 3), (1, 1), (5, 2)]:  # ids increase; gaps are fine
        event = conv.receive(_step(step_id, tokens))
        assert isinstance(event, StepRequested) and not event.pushed
        assert conv.start_step(event.step)
    assert conv.position == 6
    assert isinstance(conv.receive(wire.CloseSession(session_id="s")), CloseRequested)
    assert conv.phase is Phase.CLOSED
    with pytest.raises(OutOfTurn):
        conv.receive(_step(6))


def test_the_first_message_must_open_a_session() -> None:
    with pytest.raises(OutOfTurn, match="OpenSession"):
        ServerInference().receive(_step(0))


def test_a_repeated_or_earlier_step_id_is_out_of_order() -> None:
    conv = _server()
    assert conv.start_step(_step(3))
    for step_id in (3, 2):
        with pytest.raises(StepOutOfOrder, match="must increase") as broke:
            conv.start_step(_step(step_id))
        assert broke.value.code == wire.ErrorCode.BAD_REQUEST


def test_start_positions_roll_back_but_never_pass_the_cache_or_max_length() -> None:
    conv = _server()
    assert conv.start_step(_step(0, tokens=4))
    with pytest.raises(BadStartPosition, match="past the session's 4 cached tokens"):
        conv.start_step(_step(1, start_position=5))
    assert conv.start_step(_step(2, tokens=2, start_position=1))  # rolls back to 1
    assert conv.position == 3
    with pytest.raises(BadStartPosition, match="max_length of 8"):
        conv.start_step(_step(3, tokens=6))
    assert conv.position == 3  # a refused step counts nothing


def test_a_step_for_another_session_is_refused() -> None:
    conv = _server()
    step = wire.Step(session_id="other", step_id=0, hidden_states=torch.zeros(1, 1, 4))
    with pytest.raises(WrongSession):
        conv.receive(step)


def test_pushed_steps_are_taken_only_from_the_named_upstream() -> None:
    conv = _server(upstream=UPSTREAM)
    with pytest.raises(PushRefused, match="only from"):
        conv.receive_pushed(_step(0), sender="12D3KooWStranger")
    event = conv.receive_pushed(_step(0), sender=UPSTREAM)
    assert event.pushed and conv.start_step(event.step, pushed=True)


def test_a_session_that_names_no_upstream_takes_pushes_from_any_peer() -> None:
    conv = _server()
    assert conv.receive_pushed(_step(0), sender="12D3KooWAnyone").pushed


def test_no_push_into_a_session_not_yet_open() -> None:
    conv = ServerInference()
    conv.receive(_open())
    with pytest.raises(PushRefused, match="no open session"):
        conv.receive_pushed(_step(0), sender=UPSTREAM)


def test_too_many_pushed_steps_waiting_break_the_session() -> None:
    conv = ServerInference(max_pushed=2)
    conv.receive(_open())
    conv.opened(8)
    conv.receive_pushed(_step(0), sender=UPSTREAM)
    conv.receive_pushed(_step(1), sender=UPSTREAM)
    with pytest.raises(TooManyPushed, match="pushed steps wait"):
        conv.receive_pushed(_step(2), sender=UPSTREAM)
    assert conv.start_step(_step(0), pushed=True)  # one ran: room for one more
    conv.receive_pushed(_step(2), sender=UPSTREAM)


def test_a_stale_pushed_step_is_dropped_without_error() -> None:
    """The client relayed step 2 itself after the push chain broke; step 1's push comes late."""
    conv = _server()
    assert conv.start_step(_step(2))
    late = conv.receive_pushed(_step(1), sender=UPSTREAM)
    assert conv.start_step(late.step, pushed=True) is False
    assert conv.position == 1 and conv.pushed_waiting == 0


# --- client side --------------------------------------------------------------------------------


def test_a_client_session_opens_and_gets_its_steps_answered() -> None:
    conv = _client()
    conv.sent_step(0)
    event = conv.received(_result(0))
    assert isinstance(event, StepDone) and event.result.step_id == 0
    assert conv.closing() == wire.CloseSession(session_id="s")


def test_a_refused_open_is_an_event_not_an_exception() -> None:
    conv = ClientInference(_open())
    event = conv.received(wire.Error(code=wire.ErrorCode.OUT_OF_CACHE, message="full"))
    assert isinstance(event, Refused) and event.error.code == wire.ErrorCode.OUT_OF_CACHE
    assert conv.phase is Phase.CLOSED


def test_a_cancelled_steps_late_reply_is_dropped_not_a_failure() -> None:
    """Ctrl-C during step 0; the next turn's step 1 first reads step 0's reply, then its own."""
    conv = _client()
    conv.sent_step(0)
    conv.cancelled(0)
    conv.sent_step(1)
    assert isinstance(conv.received(_result(0)), LateReply)
    assert isinstance(conv.received(_result(1)), StepDone)


def test_a_new_step_gives_up_on_an_unanswered_one() -> None:
    """A push chain broke at an earlier hop: the client relays step 4 to this server while
    step 3's pushed reply may still come."""
    conv = _client()
    conv.sent_step(3)
    conv.sent_step(4)
    assert isinstance(conv.received(_result(3)), LateReply)
    assert isinstance(conv.received(_result(4)), StepDone)


def test_a_reply_to_a_step_never_sent_is_unexpected() -> None:
    conv = _client()
    conv.sent_step(0)
    with pytest.raises(UnexpectedReply, match="never sent"):
        conv.received(_result(7))
    conv2 = _client()
    conv2.sent_step(0)
    assert isinstance(conv2.received(_result(0)), StepDone)
    with pytest.raises(UnexpectedReply):  # answered twice
        conv2.received(_result(0))


def test_queued_steps_are_owed_in_order_and_a_plain_one_gives_them_all_up() -> None:
    """A prompt pipelined in chunks: steps 2, 3 and 4 in flight at once, answered in order, each
    reply held to its own step's shape; a plain step after more queued ones abandons them all."""
    conv = _client()
    conv.sent_step(2, (1, 3, 4))
    conv.sent_step(3, (1, 2, 4), queued=True)
    conv.sent_step(4, (1, 1, 4), queued=True)
    replies = [
        wire.StepResult(session_id="s", step_id=i, hidden_states=torch.zeros(1, n, 4))
        for i, n in ((2, 3), (3, 2), (4, 1))
    ]
    for reply in replies:
        event = conv.received(reply)
        assert isinstance(event, StepDone) and event.result.step_id == reply.step_id
    conv.sent_step(5, (1, 1, 4))
    conv.sent_step(6, (1, 1, 4), queued=True)
    conv.sent_step(7, (1, 1, 4))  # a relayed step after a broken pipeline
    assert isinstance(conv.received(_result(5)), LateReply)
    assert isinstance(conv.received(_result(6)), LateReply)
    assert isinstance(conv.received(_result(7)), StepDone)


def test_a_queued_steps_reply_before_an_earlier_ones_is_unexpected() -> None:
    conv = _client()
    conv.sent_step(0)
    conv.sent_step(1, queued=True)
    with pytest.raises(UnexpectedReply, match="answers in order"):
        conv.received(_result(1))
    wrong_shape = _client()
    wrong_shape.sent_step(0, (1, 2, 4))
    wrong_shape.sent_step(1, (1, 1, 4), queued=True)
    with pytest.raises(wire.ConversationError, match="shape"):
        wrong_shape.received(_result(0))  # one token: step 0 had two


def test_client_step_ids_must_increase() -> None:
    conv = _client()
    conv.sent_step(5)
    with pytest.raises(StepOutOfOrder, match="one counter"):
        conv.sent_step(5)


def test_a_step_result_before_the_session_opened_is_out_of_turn() -> None:
    with pytest.raises(OutOfTurn, match="SessionOpened"):
        ClientInference(_open()).received(_result(0))


def test_an_error_mid_session_ends_it() -> None:
    conv = _client()
    conv.sent_step(0)
    event = conv.received(wire.Error(code=wire.ErrorCode.BAD_REQUEST, message="no"))
    assert isinstance(event, Refused)
    with pytest.raises(OutOfTurn):
        conv.received(_result(0))


# --- training -----------------------------------------------------------------------------------


def _forward() -> wire.Forward:
    return wire.Forward(model="m", start=0, end=2, hidden_states=torch.zeros(1, 2, 4))


def test_training_server_takes_forward_and_backward_and_refuses_the_rest() -> None:
    conv = ServerTraining()
    assert isinstance(conv.receive(_forward()), TrainingRequested)
    with pytest.raises(OutOfTurn, match="Forward or Backward"):
        conv.receive(_step(0))
    assert isinstance(conv.receive(_forward()), TrainingRequested)  # the stream goes on
    assert conv.requests == 2


def test_training_client_matches_each_reply_to_its_request() -> None:
    conv = ClientTraining()
    conv.sent(_forward())
    with pytest.raises(OutOfTurn):
        conv.sent(_forward())
    done = conv.received(wire.ForwardResult(hidden_states=torch.zeros(1, 2, 4)))
    assert isinstance(done, TrainingDone)
    conv.sent(_forward())
    with pytest.raises(UnexpectedReply, match="answered with BackwardResult"):
        conv.received(wire.BackwardResult(grad_inputs=torch.zeros(1, 2, 4)))
    with pytest.raises(UnexpectedReply, match="no request waiting"):
        conv.received(wire.ForwardResult(hidden_states=torch.zeros(1, 2, 4)))
    conv.sent(_forward())
    assert isinstance(
        conv.received(wire.Error(code=wire.ErrorCode.BAD_REQUEST, message="x")), Refused
    )
