"""`peerd gateway`: HTTP and WebSocket APIs and a web chat page in front of the local daemon.

chat.petals.dev's /api/v1 and /api/v2 (petals.py), an OpenAI-compatible /v1 (openai_api.py) and
the page at / (static/), each a thin translation onto peerd.sdk.client.AsyncClient (link.py).
docs/gateway.md describes every endpoint.

May import sdk, wire, blocks (the tokenizer) and routing (to read the swarm status the daemon
reports); never node, server, session or daemon: it talks to a daemon only through its socket.
"""

from peerd.gateway.app import create_app, serve

__all__ = ["create_app", "serve"]
