"""One log format for the daemon and py-libp2p, with py-libp2p's chatter only where it helps."""

from __future__ import annotations

import logging
import os
import sys


def configure_logging(level: str) -> None:
    """One format for us and py-libp2p; libp2p's chatter only at warning and above."""
    import libp2p  # noqa: F401  (importing it resets its loggers: configure afterwards)

    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    # py-libp2p logs expected conditions (a peer that went away, a protocol a client does not
    # speak) at ERROR with multi-line dumps; show them only when debugging.
    quiet = logging.WARNING if level.lower() == "debug" else logging.CRITICAL
    noisy = ("libp2p", "multiaddr", "async_service", "anyio")
    for name in noisy:
        logger = logging.getLogger(name)
        logger.setLevel(quiet)
        # py-libp2p turns propagation off at import (its lines then reach stderr unformatted,
        # through Python's last-resort handler); through our root handler they get our format.
        if not logger.handlers:
            logger.propagate = True
    # Some py-libp2p modules set their own logger's level (auto_connector: INFO), which beats
    # the level above; the handler drops their lines below `quiet` as well.
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda r: r.levelno >= quiet or r.name.split(".")[0] not in noisy)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
