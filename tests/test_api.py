"""The local API end to end: the client library, `peerd generate`, `peerd chat` in a
pseudo-terminal, and malformed input on the socket, against a live swarm of three daemons."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
from typing import Any

import pexpect
import pytest
import torch

import wire
from peerd.devtools.localswarm import LocalSwarm
from peerd.sdk.client import Client, DaemonNotRunning, PeerdError
from tests.conftest import greedy_continuation

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

PROMPT = "Once upon a time, there was a little"


def test_greedy_through_client_library_equals_transformers(
    swarm: LocalSwarm, local_model: Any, tokenizer: Any
) -> None:
    expected = greedy_continuation(local_model, tokenizer, PROMPT, 24)
    with Client(swarm.daemons[0].socket) as client:
        result = client.generate_full(PROMPT, max_new_tokens=24)
        streamed = "".join(client.generate(PROMPT, max_new_tokens=24, stream=True))
    assert result.token_ids == expected
    assert result.reason == "length"
    assert streamed == result.text
    assert result.text == tokenizer.decode(expected, skip_special_tokens=True)


def test_peerd_generate_command_equals_transformers(
    swarm: LocalSwarm, local_model: Any, tokenizer: Any
) -> None:
    expected = greedy_continuation(local_model, tokenizer, PROMPT, 16)
    run = subprocess.run(
        [sys.executable, "-m", "cli", "generate", PROMPT, "--max-new-tokens", "16",
         "--socket", str(swarm.daemons[1].socket)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert run.stdout.rstrip("\n") == tokenizer.decode(expected, skip_special_tokens=True)


BATCH = [
    "Once upon a time, there was a little",
    "The capital of France is",
    "Here is a list of three fruits:\n1.",
    "Q: What is two plus two?\nA:",
]


def test_a_batch_of_prompts_gives_what_each_prompt_gives_alone(
    swarm: LocalSwarm, tmp_path: Any
) -> None:
    """Four prompts of different lengths in one session (left-padded): row by row the tokens,
    text and ending of four single calls, each row stopping at its own stop sequence."""
    options = {"max_new_tokens": 20, "stop": ("\n",)}
    with Client(swarm.daemons[0].socket) as client:
        together = client.generate_batch(BATCH, **options)
        alone = [client.generate_full(prompt, **options) for prompt in BATCH]
        texts = client.generate(BATCH, **options)
    assert together == alone
    assert texts == [g.text for g in alone]
    assert {g.reason for g in together} == {"stop", "length"}, "rows should end differently"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(BATCH[:2]) + "\n\n")
    run = subprocess.run(
        [sys.executable, "-m", "cli", "generate", "--file", str(prompts), "--max-new-tokens",
         "20", "--stop", "\n", "--socket", str(swarm.daemons[1].socket)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    for number, (prompt, result) in enumerate(zip(BATCH[:2], alone, strict=False), 1):
        assert f"=== [{number}] {prompt}\n{result.text}\n--- (" in run.stdout


def test_sampling_with_a_seed_is_reproducible(swarm: LocalSwarm) -> None:
    with Client(swarm.daemons[0].socket) as client:
        options = {"do_sample": True, "temperature": 1.3, "top_k": 50, "top_p": 0.95}
        first = client.generate_full(PROMPT, max_new_tokens=12, seed=7, **options)
        again = client.generate_full(PROMPT, max_new_tokens=12, seed=7, **options)
        other = client.generate_full(PROMPT, max_new_tokens=12, seed=8, **options)
    assert first.token_ids == again.token_ids
    assert other.token_ids != first.token_ids


def test_stop_sequences_and_cancel(swarm: LocalSwarm) -> None:
    with Client(swarm.daemons[2].socket) as client:
        stopped = client.generate_full(PROMPT, max_new_tokens=30, stop=("Emma",))
        assert stopped.reason == "stop" and "Emma" not in stopped.text
        pieces = client.stream_tokens(PROMPT, max_new_tokens=200)
        for _ in range(3):
            next(pieces)
        pieces.close()  # cancels on the daemon, which answers GenerateDone(cancelled)
        assert client.generate_full(PROMPT, max_new_tokens=4).reason == "length"


CHAT_ARGS = ["-m", "cli", "chat", "--socket"]


def test_chat_in_a_terminal_reuses_the_session(swarm: LocalSwarm, tokenizer: Any) -> None:
    def served() -> int:
        total = 0
        for daemon in swarm.daemons:
            with Client(daemon.socket) as client:
                total += client.status().tokens_served
        return total

    chat = pexpect.spawn(
        sys.executable,
        # Speculation off: the servers' token count below would include drafts that fell.
        [*CHAT_ARGS, str(swarm.daemons[0].socket), "--max-new-tokens", "300", "--speculate", "off"],
        encoding="utf-8",
        # A guard against a hang, not a speed check: a loaded 2-core machine runs the chat at a
        # few tokens/s, and an answer may use most of its 300 tokens.
        timeout=300,
        # A terminal's foreground job takes Ctrl-C; a test run started in the background by a
        # non-interactive shell inherits SIGINT ignored, and Python then never raises on it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    chat.logfile_read = sys.stdout  # what the terminal showed, in the report of a failure
    try:
        chat.expect("peerd chat with smollm2-135m-instruct through 3 servers")
        chat.expect(">>> ")
        chat.sendline("What is the capital of France?")
        chat.expect(r"\[(\d+) tokens, [\d.]+ tokens/s\]")
        answer = chat.before
        assert "Paris" in answer
        chat.expect(">>> ")
        before = served()
        chat.sendline("And of Italy?")
        chat.expect(r"\[(\d+) tokens, [\d.]+ tokens/s\]")
        second_tokens = int(chat.match.group(1))
        assert "Rome" in chat.before
        chat.expect(">>> ")
        turn_two = (served() - before) // 3  # each of the three servers saw the same tokens
        chat.sendline("/route")
        chat.expect("route: .*->.*->")
        chat.expect(">>> ")
        # Ctrl-C stops a runaway answer, not the chat.
        chat.sendline("Write a very long story about a dragon.")
        chat.expect("dragon\\.\r\n")  # the terminal's echo of the question
        chat.expect(r"\w+ \w+ \w+")  # the answer has started streaming
        chat.sendintr()
        chat.expect(r"tokens/s \(stopped\)\]")
        chat.expect(">>> ")
        chat.sendline("/quit")
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)
    # Were the history re-sent, turn two would run the whole templated conversation (system
    # prompt, first question and answer, second question) through the servers.
    history = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": answer.strip()},
            {"role": "user", "content": "And of Italy?"},
        ],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    new_turn = tokenizer("And of Italy?")["input_ids"]
    assert turn_two < len(history) - 10, (turn_two, len(history))
    assert turn_two <= len(new_turn) + 12 + second_tokens


def test_no_daemon_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(DaemonNotRunning, match="peerd start"):
        Client(tmp_path / "nothing.sock")
    run = subprocess.run(
        [sys.executable, "-m", "cli", "chat", "--socket", str(tmp_path / "x.sock")],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert run.returncode == 2 and "peerd start" in run.stderr


def test_malformed_requests_get_errors_and_the_daemon_keeps_serving(swarm: LocalSwarm) -> None:
    path = str(swarm.daemons[0].socket)
    rng = random.Random(1234)
    valid = [
        bytes(wire.encode_message(m))
        for m in (
            wire.Hello(),
            wire.StatusRequest(),
            wire.Generate(prompt="hi", max_new_tokens=1),
            wire.InferenceStep(session_id="nope", hidden_states=torch.zeros(1, 1, 576)),
        )
    ]

    def mutate(frame: bytes) -> bytes:
        data = bytearray(frame)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data[: rng.randint(1, len(data))]) if rng.random() < 0.3 else bytes(data)

    answers = 0
    for i in range(300):
        kind = i % 3
        if kind == 0:
            payload = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        elif kind == 1:
            payload = mutate(rng.choice(valid))
        else:  # well-framed but not a request the daemon accepts
            payload = bytes(wire.encode_message(wire.StepResult(
                session_id="x", step_id=0, hidden_states=torch.zeros(1, 1, 2))))  # fmt: skip
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(path)
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        decoder = wire.MessageDecoder()
        decoder.receive_data(data)
        decoder.receive_data(b"")
        replies = list(decoder)
        answers += sum(isinstance(r, wire.Error) for r in replies)
        assert all(isinstance(r, wire.Message) for r in replies)
    assert answers > 100  # garbage is answered with an Error, not silence or a crash
    with Client(path) as client:
        assert client.generate_full(PROMPT, max_new_tokens=4).reason == "length"
        with pytest.raises(PeerdError, match="session"):
            client.step("no-such-session", torch.zeros(1, 1, 576))
        assert client.generate_full(PROMPT, max_new_tokens=2).reason == "length"


def test_peerd_status_shows_coverage_and_servers(swarm: LocalSwarm) -> None:
    socket_path = str(swarm.daemons[0].socket)
    table = subprocess.run(
        [sys.executable, "-m", "cli", "status", "--socket", socket_path],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "every block is served" in table
    assert "serving blocks 0:10" in table
    # The daemon's own server is "local"; the other two are reached over direct connections.
    assert table.count(" local") == 1
    assert table.count(" direct") == 2
    as_json = subprocess.run(
        [sys.executable, "-m", "cli", "status", "--socket", socket_path, "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    import json

    status = json.loads(as_json)
    assert sorted((s["start"], s["end"]) for s in status["swarm"]) == [(0, 10), (10, 20), (20, 30)]


def test_cancel_sent_right_behind_its_generate_stops_it(swarm: LocalSwarm) -> None:
    """The daemon may read Cancel before it starts the Generate ahead of it (a Ctrl-C at once on
    a busy machine): the generation must still stop, not run to max_new_tokens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(120)
        sock.connect(str(swarm.daemons[0].socket))
        generate = wire.Generate(prompt="Write a very long story.", max_new_tokens=200)
        sock.sendall(
            bytes(wire.encode_message(generate)) + bytes(wire.encode_message(wire.Cancel()))
        )
        decoder = wire.MessageDecoder()
        message = _until_done(sock, decoder)
        assert message.reason == "cancelled"
        assert message.token_count < 200
        # The connection goes on, and the next generation is not cancelled by the old Cancel.
        sock.sendall(bytes(wire.encode_message(wire.Generate(prompt="Once upon a time",
                                                             max_new_tokens=3))))  # fmt: skip
        assert _until_done(sock, decoder).reason == "length"


def _until_done(sock: socket.socket, decoder: wire.MessageDecoder) -> wire.GenerateDone:
    """Read a generation's replies off a raw local API connection up to its GenerateDone."""
    while True:
        for message in decoder:
            assert isinstance(message, wire.GeneratedToken | wire.GenerateDone), message
            if isinstance(message, wire.GenerateDone):
                return message
        chunk = sock.recv(1 << 16)
        assert chunk, "the daemon hung up mid-generation"
        decoder.receive_data(chunk)
