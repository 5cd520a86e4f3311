"""The import graph points only down: cli -> peerd -> routing -> blocks -> wire, and inside peerd/
only the arrows each room's `__init__` docstring allows (DESIGN.md, docs/architecture.md).

The graph is read with ast from every .py of ours, imports inside functions and under
TYPE_CHECKING included (a lazy import is still an arrow). The check is a function over a
module -> imports mapping, so the tests below plant bad edges in a copy of the real graph and
watch it fail.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Top folders, highest first; each may import itself and anything to its right in this order,
# except that cli and examples (both programs at the top) do not import each other.
TOPS = ("cli", "examples", "peerd", "routing", "blocks", "wire")
TOP_ALLOWED: dict[str, frozenset[str]] = {
    "cli": frozenset({"peerd", "routing", "blocks", "wire"}),
    "examples": frozenset({"peerd", "routing", "blocks", "wire"}),
    "peerd": frozenset({"routing", "blocks", "wire"}),
    "routing": frozenset({"blocks", "wire"}),
    "blocks": frozenset({"wire"}),
    "wire": frozenset(),
}

# What each room of peerd/ may import besides itself and the leaves: rooms of peerd and top
# folders below peerd. This table mirrors the "May import ..." sentence of each room's
# `__init__` docstring; test_room_docstrings_say_what_the_table_says holds the two together.
ROOM_ALLOWED: dict[str, frozenset[str]] = {
    "node": frozenset({"wire"}),
    "server": frozenset({"node", "wire", "blocks", "routing"}),
    "session": frozenset({"node", "wire", "blocks", "routing"}),
    "daemon": frozenset({"node", "server", "session", "wire", "blocks", "routing"}),
    "sdk": frozenset({"wire", "blocks"}),
    "gateway": frozenset({"sdk", "wire", "blocks", "routing"}),
    "bench": frozenset({"devtools", "session", "sdk", "node", "wire", "blocks", "routing"}),
    "devtools": frozenset({"session", "node", "wire", "blocks", "routing"}),
}
# Modules any room may import: they import nothing of ours.
LEAVES = frozenset({"peerd", "peerd.paths"})
# The names programs have always imported; they re-export peerd.sdk and nothing else.
SHIMS = frozenset({"peerd.client", "peerd.model"})
# Rooms that must import without libp2p installed (sdk's docstring: local programs, the gateway).
NO_LIBP2P_ROOMS = frozenset({"sdk"})
LIBP2P_TOPS = frozenset({"libp2p", "multiaddr"})


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` imports, anywhere in it; `from a import b` counts as both a and a.b
    (b may be a submodule), relative imports resolved against `module`."""
    names: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names if alias.name != "*"}
    return names


def our_files(root: Path = ROOT) -> Iterable[Path]:
    yield root / "cli.py"
    for top in TOPS[1:]:
        yield from sorted((root / top).rglob("*.py"))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> every module it imports (ours and third-party), for all of our .py files."""
    graph = {}
    for path in our_files(root):
        module = module_name(path, root)
        graph[module] = imports_of(path.read_text(), module, path.name == "__init__.py")
    return graph


def top_of(module: str) -> str:
    return module.split(".")[0]


def room_of(module: str) -> str | None:
    """The room of a module under peerd/ (peerd.node.p2p -> node); None for leaves and shims."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and module not in LEAVES | SHIMS else None


def edge_violation(source: str, target: str, modules: set[str]) -> str | None:
    """Why the arrow source -> target is not allowed, or None if it is (or is not ours)."""
    src_top, dst_top = top_of(source), top_of(target)
    edge = f"{source} imports {target}"
    if dst_top not in TOPS:
        if room_of(source) in NO_LIBP2P_ROOMS and dst_top in LIBP2P_TOPS:
            return f"{edge}: {room_of(source)}/ must import without libp2p"
        return None
    if src_top != dst_top and dst_top not in TOP_ALLOWED[src_top]:
        return f"{edge}: {src_top}/ may import only {sorted(TOP_ALLOWED[src_top])}"
    if src_top != "peerd":
        return None
    if source in LEAVES:
        return f"{edge}: leaves import nothing of ours"
    if source in SHIMS:
        if top_of(target) == "peerd" and room_of(target) == "sdk":
            return None
        return f"{edge}: shims re-export peerd.sdk only"
    src_room = room_of(source)
    if src_room not in ROOM_ALLOWED:
        return f"{edge}: peerd/{src_room} is not a room the layering table knows"
    if dst_top != "peerd":
        dst_room = dst_top
    elif target in LEAVES or (target not in modules and target.rpartition(".")[0] in LEAVES):
        return None  # peerd, peerd.paths, or a name imported from them (`from peerd import paths`)
    else:
        dst_room = room_of(target) or target
    if dst_room == src_room or dst_room in ROOM_ALLOWED[src_room]:
        return None
    return f"{edge}: peerd/{src_room} may import only {sorted(ROOM_ALLOWED[src_room])}"


def layering_violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Every arrow of `graph` that points up or sideways where no docstring allows it."""
    modules = set(graph)
    found = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            if (why := edge_violation(source, target, modules)) is not None:
                found.append(why)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_tree_points_only_down(graph: dict[str, set[str]]) -> None:
    assert len(graph) > 50, "the walk found too few modules to be our tree"
    assert layering_violations(graph) == []


def test_every_room_on_disk_is_in_the_table() -> None:
    rooms = {p.parent.name for p in (ROOT / "peerd").glob("*/__init__.py")}
    assert rooms == set(ROOM_ALLOWED)


def allowed_in_docstring(doc: str) -> set[str]:
    """The rooms and top folders named between "May import" and "never" in a room's docstring,
    with parenthesised asides (which may name other rooms in passing) left out."""
    match = re.search(r"may\s+import(.*?)(?:never|$)", doc, re.IGNORECASE | re.DOTALL)
    assert match, f"no 'May import ...' sentence in:\n{doc}"
    sentence = re.sub(r"\([^)]*\)", "", match.group(1))
    names = set(ROOM_ALLOWED) | set(TOPS) - {"peerd"}  # "peerd.paths" names a leaf, not a room
    return {word for word in re.findall(r"[a-z]+", sentence) if word in names}


@pytest.mark.parametrize("room", sorted(ROOM_ALLOWED))
def test_room_docstrings_say_what_the_table_says(room: str) -> None:
    init = ROOT / "peerd" / room / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    assert allowed_in_docstring(doc) == ROOM_ALLOWED[room], (
        f"peerd/{room}/__init__.py and ROOM_ALLOWED disagree: change both together"
    )


def libp2p_reached_from_sdk(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """The modules reached from peerd.sdk (and the shims) through our own imports that import
    libp2p, each as "module imports name"; empty when the sdk imports without libp2p."""
    found, seen = [], set()
    todo = [m for m in graph if room_of(m) == "sdk" or m in SHIMS]
    while todo:
        module = todo.pop()
        if module in seen or module not in graph:
            continue
        seen.add(module)
        found += [
            f"{module} imports {t}" for t in sorted(graph[module]) if top_of(t) in LIBP2P_TOPS
        ]
        todo += graph[module]
    return sorted(found)


def test_sdk_reaches_no_libp2p_even_indirectly(graph: dict[str, set[str]]) -> None:
    """peerd.sdk, peerd.client and peerd.model import without libp2p: nothing they reach through
    our own modules imports it either (a lazy import inside a function counts)."""
    assert libp2p_reached_from_sdk(graph) == []
    # Planted: the sdk imports a blocks module (allowed) that imports libp2p (also allowed, for
    # blocks): only the walk through the graph sees the sdk would then need libp2p.
    planted = {
        **graph,
        "peerd.sdk.fake": {"blocks.fake"},
        "blocks.fake": {"wire", "libp2p.peer.id"},
    }
    assert layering_violations(planted) == []
    assert libp2p_reached_from_sdk(planted) == ["blocks.fake imports libp2p.peer.id"]


def test_the_reader_sees_lazy_relative_and_type_checking_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from peerd.server.block_server import BlockServer\n"
        "def f():\n    import routing.planner\n    from . import swarm\n"
        "from ..node import streams\n"
    )
    found = imports_of(source, "peerd.session.inference")
    assert {"peerd.server.block_server", "routing.planner", "peerd.session.swarm"} <= found
    assert "peerd.node.streams" in found
    assert imports_of("from . import x", "peerd.node", is_package=True) >= {"peerd.node.x"}


BAD_EDGES = [
    ("peerd.session.fake", "peerd.server.block_server", "peerd/session may import only"),
    ("routing.fake", "peerd.node.p2p", "routing/ may import only"),
    ("blocks.fake", "routing.records", "blocks/ may import only"),
    ("wire.fake", "blocks", "wire/ may import only"),
    ("peerd.node.fake", "routing.records", "peerd/node may import only"),
    ("peerd.server.fake", "peerd.daemon.main", "peerd/server may import only"),
    ("peerd.sdk.fake", "peerd.node.streams", "peerd/sdk may import only"),
    ("peerd.sdk.fake", "libp2p.host.basic_host", "must import without libp2p"),
    ("peerd.gateway.fake", "peerd.session.swarm", "peerd/gateway may import only"),
    ("peerd.client", "peerd.session.generation", "shims re-export peerd.sdk only"),
    ("peerd.paths", "peerd.node.identity", "leaves import nothing of ours"),
    ("peerd.newroom.x", "wire", "not a room the layering table knows"),
]


@pytest.mark.parametrize(("source", "target", "why"), BAD_EDGES)
def test_a_planted_bad_edge_fails(
    graph: dict[str, set[str]], source: str, target: str, why: str
) -> None:
    planted = {**graph, source: graph.get(source, set()) | {target}}
    found = layering_violations(planted)
    assert len(found) == 1, found
    assert found[0].startswith(source) and why in found[0]


GOOD_EDGES = [
    ("peerd.session.fake", "peerd.node.streams"),
    ("peerd.sdk.fake", "peerd.paths"),
    ("peerd.node.fake", "peerd"),
    ("peerd.daemon.fake", "peerd.server.block_server"),
    ("routing.fake", "blocks.families"),
    ("cli", "peerd.daemon.main"),
    ("peerd.sdk.fake", "torch"),
]


@pytest.mark.parametrize(("source", "target"), GOOD_EDGES)
def test_an_allowed_edge_passes(graph: dict[str, set[str]], source: str, target: str) -> None:
    assert layering_violations({**graph, source: {target}}) == []


@pytest.mark.parametrize("top", TOPS[1:])
def test_each_top_folder_is_ours_when_imported(top: str) -> None:
    """Every top folder is a regular package, so a namesake in site-packages cannot shadow it
    (py-libp2p installs an `examples` package: `python -m examples.ptune` then failed)."""
    assert (ROOT / top / "__init__.py").exists()
    spec = importlib.util.find_spec(top)
    assert spec is not None and spec.origin == str(ROOT / top / "__init__.py")
