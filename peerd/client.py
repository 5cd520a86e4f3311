"""`peerd.client`, the name programs import; the client library lives in peerd.sdk.client, and
this module exports exactly its `__all__`."""

from peerd.sdk.client import *  # noqa: F403
from peerd.sdk.client import __all__ as __all__
