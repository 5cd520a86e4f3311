"""Model names in a swarm of several models: the one shape a name has, checked wherever a name
arrives from a peer's record, a local program or a web page, before anything is looked up by it.

A name is what `blocks.model_name` makes of a checkpoint: lowercase letters, digits, '.', '_'
and '-', so it can never be a path ("/", "~", "..") or carry markup into a page.
"""

from __future__ import annotations

import re

MAX_MODEL_NAME_LEN = 128
_NAME = re.compile(rf"[a-z0-9][a-z0-9._-]{{0,{MAX_MODEL_NAME_LEN - 1}}}")


class BadModelName(ValueError):
    """A string that is not a model name; the message says what one looks like."""


def is_model_name(name: object) -> bool:
    return isinstance(name, str) and _NAME.fullmatch(name) is not None and ".." not in name


def check_model_name(name: object) -> str:
    """`name` if it is a model name, else BadModelName saying what a name looks like."""
    if not is_model_name(name):
        shown = repr(name)[:80]
        raise BadModelName(
            f"{shown} is not a model name: a name is 1 to {MAX_MODEL_NAME_LEN} lowercase "
            "letters, digits, '.', '_' or '-' (as `peerd status` lists the swarm's models)"
        )
    assert isinstance(name, str)
    return name
