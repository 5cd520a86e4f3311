"""An inference session on our own BlockServer, for this daemon's own clients: the same checks,
cache and conversation rules as a remote session, without a stream (a host cannot dial itself).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import wire
from blocks import SpanSession
from wire.conversation import ServerInference

if TYPE_CHECKING:
    from peerd.server.block_server import BlockServer


class LocalSession:
    """See BlockServer.open_local."""

    def __init__(
        self, server: BlockServer, request: wire.OpenSession, session: SpanSession
    ) -> None:
        self.server = server
        self.request = request
        self.session = session
        self.conv = ServerInference()
        self.conv.receive(request)
        self.conv.opened(request.max_length)
        self._steps = 0

    async def step(self, hidden: torch.Tensor, start_position: int | None) -> torch.Tensor:
        message = wire.Step(
            session_id=self.request.session_id,
            step_id=self._steps,
            hidden_states=hidden,
            start_position=start_position,
        )
        self._steps += 1
        output = await self.server.run_step(self.conv, self.session, message)
        assert output is not None  # only a pushed step is ever dropped
        return output

    def close(self) -> None:
        self.conv.close()
        self.session.close()
        self.server.admission.cache_freed()
