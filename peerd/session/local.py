"""What the client side needs of this daemon's own block server, as protocols: a route hop that we
serve ourselves is run in process (a host cannot dial itself), without session/ importing
server/."""

from __future__ import annotations

from typing import Protocol

import torch

import wire


class LocalSteps(Protocol):
    """An inference session open on our own server."""

    async def step(self, hidden: torch.Tensor, start_position: int | None) -> torch.Tensor: ...

    def close(self) -> None: ...


class LocalServer(Protocol):
    """Our own block server, as a route hop (peerd.server.block_server.BlockServer is one)."""

    peer_id: str

    def open_local(self, request: wire.OpenSession) -> LocalSteps: ...

    async def run_training(
        self, request: wire.Forward | wire.Backward
    ) -> wire.ForwardResult | wire.BackwardResult: ...
