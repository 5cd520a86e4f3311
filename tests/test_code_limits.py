"""Outside tests/, no module is over 500 lines and no function over 60 (issue 16): a reader should
find one step per function and one thing per module. The allowlist below names every exception and
why; an entry that is no longer over its limit fails too, so the list only shrinks."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60

# "path" for a module, "path::Qualified.name" for a function (def line to last line, docstring
# included, decorators not). Each entry says why it is still over; remove it once it is not.
# Empty: the 23 offenders of 18d12d7 (when the rooms were cut) were all split along their seams
# in issue 16. An exception needs an entry here and a reason a reviewer accepts.
ALLOWLIST: dict[str, str] = {}


def our_sources(root: Path = ROOT) -> Iterator[Path]:
    yield root / "cli.py"
    for top in ("peerd", "routing", "blocks", "wire", "examples"):
        yield from sorted((root / top).rglob("*.py"))


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualified name, length in lines) of every function in `tree`, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            yield name, (node.end_lineno or node.lineno) - node.lineno + 1
            yield from functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def offenders(sources: Iterable[tuple[str, str]]) -> dict[str, int]:
    """Everything over its limit, as allowlist key -> its length, from (path, text) pairs."""
    over = {}
    for path, text in sources:
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            over[path] = lines
        for name, length in functions(ast.parse(text)):
            if length > MAX_FUNCTION_LINES:
                over[f"{path}::{name}"] = length
    return over


def limit_failures(over: dict[str, int], allowlist: Iterable[str]) -> list[str]:
    """What is over its limit without an allowlist entry, and every entry that is not over."""
    allowed = set(allowlist)
    failures = [f"{key} is {over[key]} lines" for key in sorted(over.keys() - allowed)]
    failures += [
        f"{key} is allowlisted but within its limit: remove it"
        for key in sorted(allowed - over.keys())
    ]
    return failures


def test_modules_and_functions_stay_within_their_limits() -> None:
    sources = [(str(p.relative_to(ROOT)), p.read_text()) for p in our_sources()]
    assert len(sources) > 50, "the walk found too few modules to be our tree"
    failures = limit_failures(offenders(sources), ALLOWLIST)
    assert not failures, "\n".join(failures)


def body(indent: int, lines: int = MAX_FUNCTION_LINES) -> str:
    """`lines` statements at `indent` spaces: with its def line, one line over the limit."""
    return "".join(f"{' ' * indent}x{i} = {i}\n" for i in range(lines))


@pytest.mark.parametrize(
    ("source", "key"),
    [
        ("def f():\n" + body(4), "m.py::f"),
        ("class C:\n    async def g(self):\n" + body(8), "m.py::C.g"),
        ("def outer():\n    def inner():\n" + body(8), "m.py::outer.inner"),
        ("if True:\n    def f():\n" + body(8), "m.py::f"),
        ("x = 1\n" * (MAX_MODULE_LINES + 1), "m.py"),
    ],
)
def test_a_planted_long_function_or_module_fails(source: str, key: str) -> None:
    over = offenders([("m.py", source)])
    assert key in over
    assert limit_failures(over, []) != []
    assert limit_failures(over, over) == []


def test_at_the_limit_passes_and_a_stale_allowlist_entry_fails() -> None:
    at_limit = "def f():\n" + body(4, MAX_FUNCTION_LINES - 1) + "x = 1\n" * 400
    assert offenders([("m.py", at_limit)]) == {}
    assert limit_failures({}, ["m.py::f"]) == [
        "m.py::f is allowlisted but within its limit: remove it"
    ]
