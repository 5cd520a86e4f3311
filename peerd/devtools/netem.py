"""Packet delay in user space, for kernels without `tc netem` (sch_netem): iptables hands every
packet a host sends to an NFQUEUE, and this process gives the kernel its ACCEPT verdict only
after the delay (plus jitter; packets keep their order). The packets themselves stay in the
kernel; we read only their ids (copy mode META). Bandwidth is limited by a `tbf` qdisc beside
it (peerd.devtools.netns.Topology.shape). Speaks nfnetlink_queue directly over a netlink socket, so
it
needs nothing beyond the standard library.

Run inside a namespace: `ip netns exec NS python -m peerd.devtools.netem --queue 0 --delay-ms 25`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import os
import random
import select
import socket
import struct
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
PR_SET_TIMERSLACK = 29
# SCHED_FIFO priority of the delayer (1-99): above every normal process, below the kernel's own.
REALTIME_PRIORITY = 10
_NLMSG = struct.Struct("=IHHII")
_NFGEN = struct.Struct("=BBH")


def _attr(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind) + payload + b"\0" * (-size % 4)


def _message(kind: int, queue: int, attrs: bytes, seq: int = 0) -> bytes:
    body = _NFGEN.pack(socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    msg_type = (NFNL_SUBSYS_QUEUE << 8) | kind
    return _NLMSG.pack(_NLMSG.size + len(body), msg_type, NLM_F_REQUEST, seq, 0) + body


def _packet_ids(data: bytes) -> list[int]:
    """Ids of the queued packets in one netlink read (several messages may arrive at once)."""
    ids = []
    offset = 0
    while offset + _NLMSG.size <= len(data):
        length, msg_type, _flags, _seq, _pid = _NLMSG.unpack_from(data, offset)
        if length < _NLMSG.size:
            break
        if msg_type == NLMSG_ERROR:
            (errno,) = struct.unpack_from("=i", data, offset + _NLMSG.size)
            if errno:
                raise OSError(-errno, "nfnetlink_queue refused a request")
        elif msg_type == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            pos = offset + _NLMSG.size + _NFGEN.size
            end = offset + length
            while pos + 4 <= end:
                size, kind = struct.unpack_from("=HH", data, pos)
                if size < 4:
                    break
                if kind & 0x3FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, pos + 4)[0])
                pos += size + (-size % 4)
        offset += length + (-length % 4)
    return ids


def _fine_timer_slack() -> None:
    """Ask the kernel to wake this process within 1 us of its timeouts (PR_SET_TIMERSLACK; the
    default slack is 50 us): the delay is the link's, so it should not wander with our wake-ups.
    Best effort: if the kernel refuses, the default slack costs only tens of microseconds. Called
    once the netlink socket is open, so this is Linux and its libc has prctl."""
    ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)


def _realtime_priority() -> None:
    """Run at a real-time priority (SCHED_FIFO, low), so the daemons computing on the same cores
    do not make us late: a network's delay does not wait for its hosts' CPUs. In one `bench wan`
    run each on the 2-core development machine, the verdicts came 0.18-0.33 ms late on average (p99
    2.1-3.6 ms) at the normal priority and 0.08-0.12 ms (p99 0.7-1.5 ms) at this one. The process
    blocks in select between packets, so it takes the cores only for its few microseconds per
    packet (and the kernel's real-time throttling caps it anyway). Best effort: without the
    privilege (not root) the normal priority stays."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))


def run(queue: int, delay_s: float, jitter_s: float = 0.0) -> None:
    """Delay every packet of `queue` by delay_s (+- normal jitter), in order, forever."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((0, 0))
    bind = struct.pack("=BBH", NFQNL_CFG_CMD_BIND, 0, 0)
    sock.send(_message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_CMD, bind), seq=1))
    params = struct.pack("!IB", 0, NFQNL_COPY_META)
    sock.send(_message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_PARAMS, params), seq=2))
    _fine_timer_slack()
    _realtime_priority()
    print("delaying", flush=True)
    pending: collections.deque[tuple[float, int]] = collections.deque()
    last_release = 0.0
    rng = random.Random()
    while True:
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, packet_id = pending.popleft()
            verdict = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id))
            sock.send(_message(NFQNL_MSG_VERDICT, queue, verdict))
        # select's timeout is a timeval (microseconds): a socket timeout or poll() waits whole
        # milliseconds, rounded up, which released packets ~0.5 ms late on average.
        wait = pending[0][0] - now if pending else None
        if not select.select([sock], [], [], wait)[0]:
            continue
        data = sock.recv(1 << 16)
        arrived = time.monotonic()
        for packet_id in _packet_ids(data):
            delay = delay_s + (rng.gauss(0.0, jitter_s) if jitter_s else 0.0)
            # In order, as on one link: a packet never overtakes the one before it.
            last_release = max(last_release, arrived + max(0.0, delay))
            pending.append((last_release, packet_id))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    args = parser.parse_args()
    run(args.queue, args.delay_ms / 1000, args.jitter_ms / 1000)


if __name__ == "__main__":
    main()
