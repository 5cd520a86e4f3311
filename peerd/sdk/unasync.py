"""Generates sync_client.py (SyncClient) from async_client.py (AsyncClient), so the two clients
are one source and cannot drift (the way httpcore keeps its sync and async twins).

    python -m peerd.sdk.unasync            # rewrite sync_client.py
    python -m peerd.sdk.unasync --check    # exit 1 if it is out of date (tests run this)

The rewrite is textual: the words below, whole words only, and the source's docstring replaced
by one that says where the file comes from. transport.py holds the one real difference (anyio
streams and cancel scopes against a blocking socket).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "async_client.py"
TARGET = HERE / "sync_client.py"

# Longest first where one is a prefix of another; `\b` keeps `aclose` from matching `aclosing`.
ASYNC_TO_SYNC = [
    (r"async def ", "def "),
    (r"async for ", "for "),
    (r"async with ", "with "),
    (r"await ", ""),
    (r"__aenter__", "__enter__"),
    (r"__aexit__", "__exit__"),
    (r"aclose", "close"),
    (r"AsyncIterator", "Iterator"),
    (r"AsyncTokenStream", "TokenStream"),
    (r"AsyncTransport", "Transport"),
    (r"AsyncClient", "SyncClient"),
]
_PATTERNS = [(re.compile(rf"\b{word}"), sync) for word, sync in ASYNC_TO_SYNC]

HEADER = '''"""SyncClient: AsyncClient's calls as blocking methods (peerd.sdk.client.Client
connects it on construction). GENERATED from async_client.py by `python -m peerd.sdk.unasync`:
edit that file and regenerate, never this one."""
'''


def unasync_line(line: str) -> str:
    for pattern, sync in _PATTERNS:
        line = pattern.sub(sync, line)
    return line


def unasync(source: str) -> str:
    """The sync module for the async module `source` (whose first statement is its docstring)."""
    if not source.startswith('"""'):
        raise ValueError("the async source must start with its module docstring")
    body = source[source.index('"""', 3) + 3 :].lstrip("\n")
    return HEADER + "\n" + "".join(unasync_line(line) for line in body.splitlines(keepends=True))


def main(argv: list[str]) -> int:
    generated = unasync(SOURCE.read_text())
    if "--check" in argv:
        if TARGET.read_text() != generated:
            print(f"{TARGET} is out of date: run `python -m peerd.sdk.unasync`", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(generated)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
