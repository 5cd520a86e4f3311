"""How long a daemon's event loop stalls, measured from outside: a separate process that asks the
daemon for its status over the local API every few milliseconds and prints how long each answer
took (`python -m peerd.bench.loop_probe SOCKET INTERVAL_S`).

The local API runs on the daemon's one trio loop, and a status answer is a few hundred bytes
built without I/O, so its latency is the time the loop took to get to it: a decode or a handler
that holds the loop shows up as a slow answer. It runs in a process of its own so that the
attacker's own work (building hostile frames in the bench process) cannot delay the probe.

Each line: `SENT_MONOTONIC LATENCY_MS` (CLOCK_MONOTONIC is one clock for every process of the
machine, so the bench can match answers to its attack windows), or `gone: WHY` when the daemon
stopped answering, after which the probe exits.
"""

from __future__ import annotations

import socket
import sys
import time

import wire

# An answer slower than this is a dead daemon, not a stall.
GIVE_UP_S = 120.0


def _request(sock: socket.socket, decoder: wire.MessageDecoder, message: wire.Message) -> None:
    sock.sendall(bytes(wire.encode_message(message)))
    while decoder.next_message() is None:
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the daemon closed the connection")
        decoder.receive_data(data)


def probe(path: str, interval_s: float) -> None:
    """Print one line per status request until the daemon stops answering."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(GIVE_UP_S)
    decoder = wire.MessageDecoder()
    try:
        sock.connect(path)
        _request(sock, decoder, wire.Hello(client="peerd bench attack loop probe"))
        while True:
            sent = time.monotonic()
            _request(sock, decoder, wire.StatusRequest())
            print(f"{sent:.4f} {(time.monotonic() - sent) * 1e3:.2f}", flush=True)
            time.sleep(interval_s)
    except (OSError, wire.ProtocolError) as e:
        print(f"gone: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    probe(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.02)
