"""wire/ stays sans-IO: it imports no I/O or networking module (only the short list below), calls
no file or pickle I/O, and never mentions pickle (docs/wire.md, DESIGN.md). That it imports nothing
of ours above it is one of the arrows tests/test_layering.py checks over the whole tree."""

from __future__ import annotations

import ast
from pathlib import Path

WIRE = Path(__file__).resolve().parent.parent / "wire"

ALLOWED = {
    "__future__",
    "collections",
    "dataclasses",
    "enum",
    "functools",
    "hmac",  # compare_digest: a push token compared in constant time (no I/O)
    "math",
    "struct",
    "sys",
    "traceback",  # clear_frames: a decode error must not keep what was decoded alive
    "types",
    "typing",
    "lz4",
    "msgpack",
    "numpy",
    "torch",
    "wire",
}
FORBIDDEN_CALLS = {"open", "load", "loads", "save"}  # file I/O, torch.load/pickle.loads, torch.save


def imported_modules(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_wire_imports_only_what_it_may() -> None:
    for path in sorted(WIRE.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        extra = imported_modules(tree) - ALLOWED
        assert not extra, f"{path.name} imports {sorted(extra)}: wire/ is sans-IO and bottom layer"


def test_wire_does_no_io_and_no_pickle() -> None:
    for path in sorted(WIRE.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", None))
                assert name not in FORBIDDEN_CALLS, f"{path.name}:{node.lineno} calls {name}()"
        assert "pickle" not in path.read_text(), f"{path.name} mentions pickle"
