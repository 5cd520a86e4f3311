"""peerd.node.yamux_credit on two real py-libp2p nodes (Noise and yamux over TCP): a stream that
receives small messages one at a time sends no WINDOW_UPDATE until half its window is read, and
transfers far larger than the window still flow (credit comes back as it is read)."""

from __future__ import annotations

from typing import Any

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE, YamuxStream

from peerd.node.p2p import open_node
from peerd.node.yamux_credit import release_on_half_window

PROTOCOL = "/peerd-test/echo-sizes/1.0.0"


async def test_small_messages_send_no_window_update_and_large_transfers_still_flow(
    monkeypatch: Any,
) -> None:
    assert YamuxStream._auto_tune_and_send_window_update is release_on_half_window
    updates: list[int] = []
    send_update = YamuxStream.send_window_update

    async def counted(self: YamuxStream, increment: int, skip_lock: bool = False) -> None:
        updates.append(increment)
        await send_update(self, increment, skip_lock)

    monkeypatch.setattr(YamuxStream, "send_window_update", counted)
    received: list[int] = []

    async def handler(stream: Any) -> None:  # answers every message with its size
        while True:
            data = await stream.read(1 << 20)
            if not data:
                return
            received.append(len(data))
            await stream.write(len(data).to_bytes(8, "big"))

    async with (
        open_node(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as a,
        open_node(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as b,
    ):
        b.host.set_stream_handler(PROTOCOL, handler)
        a.remember(b.peer_id, b.maddrs())
        stream = await a.open_stream(b.peer_id, PROTOCOL)
        with trio.fail_after(30):
            # 20 decode-sized messages, each answered before the next: 50 KB in all, far
            # below half the 256 KiB window, so neither end credits anything back.
            for _ in range(20):
                await stream.write(b"x" * 2500)
                assert int.from_bytes(await stream.read(8), "big") == 2500
            assert updates == [] and received == [2500] * 20
            # 2 MB, eight windows' worth: the writer blocks until credit comes back, which it
            # does once half a window is read.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.write, b"y" * 2_000_000)
                total = 0
                while total < 2_000_000:
                    total += int.from_bytes(await stream.read(8), "big")
        assert sum(received) == 20 * 2500 + 2_000_000
        assert updates and min(updates) >= DEFAULT_WINDOW_SIZE // 2
        await stream.close()
