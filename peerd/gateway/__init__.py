"""`peerd gateway`: HTTP and WebSocket APIs and a web chat page in front of the local daemon.

chat.petals.dev's /api/v1 and /api/v2 (petals.py), an OpenAI-compatible /v1 (openai_api.py) and
the page at / (static/), each a thin translation onto peerd.client.AsyncClient (link.py).
docs/gateway.md describes every endpoint.
"""

from peerd.gateway.app import create_app, serve

__all__ = ["create_app", "serve"]
