"""The house's architecture (STYLE.md, "Growing the house"), read from the code with `ast`.

One listing of rlpipe/ shows the rooms; arrows between modules point one way (no import circle, at
module or at room level); a helper another module needs has a public name; functions and stage
scripts stay short enough to read. Lazy imports inside functions count: they are arrows too.
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlpipe"
TOP_LEVEL_MODULES = {"cli", "config", "profiles", "errors", "progress", "distributed"}
ROOMS = {"algorithms", "cluster", "data", "engines", "environments", "models", "project", "reports", "rewards", "run", "stages",
         "tiny", "tracking", "training", "worker"}
MAX_FUNCTION_LINES = 80
MAX_SCRIPT_LINES = 80


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def tree(name: str) -> ast.Module:
    return ast.parse(modules()[name].read_text(), str(modules()[name]))


def runtime_nodes(node: ast.AST):
    """Every node below ``node`` but those under ``if TYPE_CHECKING:``: a type-only import never runs."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from (n for branch in child.orelse for n in [branch, *runtime_nodes(branch)])
            continue
        yield child
        yield from runtime_nodes(child)


def imports(name: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every rlpipe import in module ``name``, lazy ones too
    (type-only ones excepted)."""
    is_package = modules()[name].name == "__init__.py"
    found = []
    for node in runtime_nodes(tree(name)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules():
                    found.append((submodule, "", node.lineno))
                elif source in modules():
                    found.append((source, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, "", node.lineno) for alias in node.names if alias.name in modules()]
    return found


def edges() -> dict[str, set[str]]:
    """Module -> the modules it imports. A package's __init__ that imports its children is an arrow too:
    importing the package runs those imports."""
    return {name: {target for target, _, _ in imports(name) if target != name} for name in modules()}


def room_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "rlpipe"


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_circles_are_found():
    """The detector itself: a two-module circle, a three-module one, and a chain that is no circle."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"g"}, "g": set()}
    assert sorted(circles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_no_import_circle_between_modules():
    assert circles(edges()) == []


def test_rooms_import_one_way():
    """Room level: if anything in room A imports room B, nothing in B imports A (directly or around a loop)."""
    rooms: dict[str, set[str]] = {}
    for name, targets in edges().items():
        rooms.setdefault(room_of(name) if room_of(name) in ROOMS else name, set()).update(
            room_of(t) if room_of(t) in ROOMS else t for t in targets)
    for room, targets in rooms.items():
        targets.discard(room)
    assert circles(rooms) == []


def test_no_private_name_imported_from_another_module():
    """A `_name` another module needs is a public helper in the wrong place (or under the wrong name)."""
    private = [f"{modules()[name].relative_to(ROOT)}:{line} imports {what} from {source}"
               for name in modules() for source, what, line in imports(name)
               if what.startswith("_") and not what.startswith("__")]
    assert private == []


def test_the_top_level_lists_the_architecture():
    """Only the rooms and the few modules every room shares sit at the top of rlpipe/."""
    top = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert (top, rooms) == (TOP_LEVEL_MODULES, ROOMS)


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_each_room_says_what_it_owns(room):
    doc = ast.get_docstring(tree(f"rlpipe.{room}"))
    assert doc and len(doc.split()) >= 20, f"rlpipe/{room}/__init__.py needs a docstring: what it owns, what it imports"


def function_lengths(path: Path) -> list[tuple[str, int]]:
    parsed = ast.parse(path.read_text(), str(path))
    return [(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1)
            for node in ast.walk(parsed) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_is_too_long_to_read():
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "stages").glob("*.py"))
    long = [f"{where} ({n} lines)" for path in files for where, n in function_lengths(path) if n > MAX_FUNCTION_LINES]
    assert long == []


def test_stage_scripts_are_thin():
    """load -> read -> call rlpipe.stages.<stage> -> write: the logic lives in the package."""
    scripts = sorted((ROOT / "stages").glob("*.py"))
    assert scripts
    long = {p.name: n for p in scripts if (n := len(p.read_text().splitlines())) > MAX_SCRIPT_LINES}
    assert long == {}


def test_each_stage_script_has_its_logic_under_its_own_name():
    scripts = {p.stem for p in (ROOT / "stages").glob("*.py")}
    logic = {p.stem for p in (PACKAGE / "stages").glob("*.py")} - {"__init__", "runner", "headline"}
    assert scripts == logic


def documented_order() -> list[str]:
    """The rooms as docs/architecture.md lists them, top to bottom (its first table's first column)."""
    text = (ROOT / "docs/architecture.md").read_text()
    table = text.split("## Rooms, top to bottom", 1)[1].split("\n\n## ", 1)[0]
    return [row.split("`")[1].rstrip("/").removesuffix(".py") for row in table.splitlines()
            if row.startswith("| `")]


def test_rooms_import_only_rooms_below_them_as_the_docs_list_them():
    """docs/architecture.md's table is the floor plan: a room imports rooms further down it and the shared
    top-level modules; the shared modules import no room."""
    order = documented_order()
    assert set(order) == ROOMS | {"cli"}
    shared = TOP_LEVEL_MODULES - {"cli"}
    wrong = []
    for name, targets in edges().items():
        room = room_of(name)
        if room == "rlpipe" and name.split(".")[-1] in shared:  # a shared module: no room below it
            wrong += [f"{name} -> {t}" for t in targets if room_of(t) in ROOMS]
            continue
        here = order.index(room if room in ROOMS else "cli")
        wrong += [f"{name} -> {t}" for t in targets if room_of(t) in ROOMS and room_of(t) != room
                  and order.index(room_of(t)) <= here]
    assert wrong == []


def test_the_surfaces_users_import_are_where_they_were():
    """What params.yaml names and user code imports survived the regrouping: the packages' exported names,
    the reward contract under its old module too, and `module:function` reward paths."""
    import importlib

    from rlpipe.rewards import base, functions
    from rlpipe.rewards.registry import resolve_reward

    for package in ("rlpipe.algorithms", "rlpipe.rewards", "rlpipe.environments", "rlpipe.engines"):
        module = importlib.import_module(package)
        assert [n for n in module.__all__ if getattr(module, n, None) is None] == [], package
    assert (functions.Sample, functions.RewardResult, functions.batch_reward) == (
        base.Sample, base.RewardResult, base.batch_reward)
    assert resolve_reward("rlpipe.rewards.functions:exact_answer") is functions.exact_answer
    assert resolve_reward("exact_answer") is functions.exact_answer
