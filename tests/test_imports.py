"""The package's modules import each other without a cycle (STYLE: stages never import each other).

The graph is read from the source, not from `sys.modules`: an edge A -> B is an `import` or
`from ... import` at module level of A (inside `if`/`try` blocks too, `if TYPE_CHECKING:` included)
naming a packtool module B. Imports inside functions are not edges: they run when called, after
every module has loaded, so they are how a late dependency is allowed.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

import packtool

ROOT = Path(packtool.__file__).resolve().parent


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            # if / try / with / for blocks at module level run at import time
            pending.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
    return found


def every_import(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Module-level imports and those inside functions: what a module uses at all, whenever it loads it."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def import_graph(
    root: Path = ROOT, imports: Callable[[ast.Module], list[ast.Import | ast.ImportFrom]] = module_level_imports
) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from packtool import hub` imports the module packtool.hub; `from packtool import X` the package
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            graph[name].update(t for t in targets if t in paths and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, colouring nodes on the current path)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_packtool_modules_import_each_other_without_a_cycle():
    graph = import_graph()
    assert {"packtool.sources", "packtool.reading", "packtool.adapters", "packtool.records"} <= graph.keys()
    assert graph["packtool.sources"] >= {"packtool.reading", "packtool.adapters"}  # the graph sees real edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


# Read-side commands: they read a finished output and print. Neither wing may import one (STYLE: a wing per side).
READ_SIDE = (
    "packtool.cli",
    "packtool.commands.stats",
    "packtool.commands.verify",
    "packtool.commands.show",
    "packtool.commands.find",
    "packtool.commands.report",
    "packtool.commands.lineage",
    "packtool.commands.audit",
)


# What the loader may read from outside its package: the format contract and the helpers under it.
LOADER_READS = (
    "packtool.arrow",
    "packtool.checks",
    "packtool.errors",
    "packtool.format",
    "packtool.hub",
    "packtool.labels",
    "packtool.packing_items",
    "packtool.seal",
    "packtool.shards",
)


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def reaching_out(wing: str, allowed: Callable[[str], bool]) -> list[str]:
    """Every edge from a module of `wing` to a packtool module outside it that `allowed` refuses."""
    graph = import_graph(imports=every_import)
    assert "packtool.commands.verify" in graph["packtool.cli"]  # the graph sees imports inside functions
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if within(module, wing)
        for target in targets
        if not within(target, wing) and not allowed(target)
    )


def test_the_builder_imports_no_read_side_command_and_not_the_loader():
    """What the builder shares with the commands (summaries, format, shards, ...) sits in a shared module."""
    forbidden = (*READ_SIDE, "packtool.loader")
    assert not reaching_out("packtool.builder", lambda target: not any(within(target, f) for f in forbidden))


def test_the_loader_imports_only_the_format_contract_from_outside():
    """No builder, no command, no top-level loader-side module (the probe lives in packtool.loader)."""
    assert not reaching_out("packtool.loader", lambda target: target in LOADER_READS)


def test_torch_and_transformers_are_imported_only_inside_the_loader():
    """Loader-side code (the probe, the Trainer integration) lives in packtool.loader, behind its import guard."""
    outside = []
    for path in sorted(ROOT.rglob("*.py")):
        if within(module_name(path, ROOT), "packtool.loader"):
            continue
        for node in every_import(ast.parse(path.read_text(), str(path))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            outside += [f"{path.name}: {name}" for name in names if name.split(".")[0] in ("torch", "transformers")]
    assert not outside, outside


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "packtool"


@pytest.mark.parametrize(
    ("files", "cycle"),
    [
        (
            {
                "packtool/__init__.py": "",
                "packtool/a.py": "from packtool.b import f\n",
                "packtool/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from packtool.a import g\n",
            },
            ["packtool.a", "packtool.b", "packtool.a"],
        ),
        (
            {
                "packtool/__init__.py": "",
                "packtool/a.py": "from packtool import b\n",
                "packtool/sub/__init__.py": "",
                "packtool/b.py": "from .sub import c\n",
                "packtool/sub/c.py": "from ..a import x\n",
            },
            ["packtool.a", "packtool.b", "packtool.sub.c", "packtool.a"],
        ),
        (
            {
                "packtool/__init__.py": "",
                "packtool/a.py": "from packtool.b import f\n",
                "packtool/b.py": "def late():\n    from packtool.a import g\n",
            },
            None,
        ),
    ],
    ids=["type-checking-import", "relative-and-module-imports", "import-inside-a-function"],
)
def test_the_cycle_check_finds_module_level_cycles_only(tmp_path, files, cycle):
    assert find_cycle(import_graph(write_package(tmp_path, files))) == cycle


def test_one_function_hashes_a_file_a_block_at_a_time():
    """STYLE, no copies of a helper: packtool.reading.file_sha256 repeated packtool.format.sha256_file. format's
    stays: the loader may import packtool.format and nothing of the reading side (LOADER_READS)."""
    hashers = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef):
                continue
            calls = {ast.unparse(call.func) for call in ast.walk(node) if isinstance(call, ast.Call)}
            looped = any(isinstance(inner, ast.While) for inner in ast.walk(node))
            whole = {"open", "hashlib.sha256"} <= calls  # a prefix of a decompressed text (ranges) is no copy
            if looped and whole and any(name.endswith(".read") for name in calls):
                hashers.append(f"{module_name(path, ROOT)}.{node.name}")
    assert hashers == ["packtool.format.sha256_file"]
