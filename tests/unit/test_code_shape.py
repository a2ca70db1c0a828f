"""The shape of the code, measured: small modules, imports in one direction, no cycles, and
operations that never load the SSH library.

The import graph is read from the source with `ast` (every import statement, including those
inside functions and under `TYPE_CHECKING`: a deferred import is still a dependency), so a
module that is never imported by the tests is checked too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "coldsnap"
MAX_MODULE_LINES = 500

# From the bottom up: a module may import its own layer and the layers of a lower rank, never
# those above, nor a layer beside it of the same rank: the CLI and the service are two clients
# of the runner that never import each other (docs/ARCHITECTURE.md). A prefix names a package
# or a module; the longest wins.
LAYERS: list[tuple[str, int, tuple[str, ...]]] = [
    ("leaf helpers", 0, ("coldsnap", "coldsnap.digests", "coldsnap.durable", "coldsnap.exits",
                         "coldsnap.logs")),
    ("formats", 1, ("coldsnap.formats",)),
    ("topology, admission", 2, ("coldsnap.topology", "coldsnap.identity",
                                "coldsnap.admission", "coldsnap.network_admission",
                                "coldsnap.session_moves")),
    ("hosts", 3, ("coldsnap.hosts",)),
    ("engines", 4, ("coldsnap.engines",)),
    ("capsule", 5, ("coldsnap.capsule",)),
    ("store", 6, ("coldsnap.store",)),
    ("operations", 7, ("coldsnap.operations",)),
    ("runner", 8, ("coldsnap.runner", "coldsnap.progress")),
    ("upkeep", 9, ("coldsnap.upkeep",)),
    ("service", 10, ("coldsnap.service",)),
    ("CLI", 10, ("coldsnap.commands",)),
    ("entry point", 11, ("coldsnap.cli", "coldsnap.__main__")),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(name: str, path: Path, known: set[str]) -> Iterator[tuple[int, str]]:
    """(line, module) for every coldsnap module that `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "coldsnap":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != "coldsnap":
                continue
            for alias in node.names:
                # `from pkg import module` depends on that module, not only on the package.
                sub = f"{base}.{alias.name}"
                yield node.lineno, sub if sub in known else base


def _graph() -> dict[str, list[tuple[int, str]]]:
    modules = _modules()
    known = set(modules)
    return {name: sorted(set(_imported(name, path, known))) for name, path in modules.items()}


def _layer(module: str) -> int:
    best, best_len = -1, -1
    for index, (_, _, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def _forbidden(name: str, target: str) -> bool:
    """Whether `name` must not import `target`: a layer above it, or one beside it."""
    mine, theirs = LAYERS[_layer(name)], LAYERS[_layer(target)]
    return theirs[1] > mine[1] or (theirs[1] == mine[1] and theirs[0] != mine[0])


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself
    (Tarjan's algorithm, iterative so that a deep graph cannot overflow the stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, []))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, []):
                    found.append(sorted(component))
    return found


def test_no_module_is_over_500_lines() -> None:
    too_long = {
        str(path.relative_to(ROOT)): n
        for directory in (PACKAGE, ROOT / "devtools", ROOT / "deploy")
        for path in sorted(directory.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert too_long == {}


# Issue 37: the longest function says the order of a restore or a capture in one screen, as a
# sequence of named phases; nothing in the package is longer than this.
MAX_FUNCTION_LINES = 80


def test_no_function_is_over_80_lines() -> None:
    too_long = {
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}": n
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    }
    assert too_long == {}


def test_every_module_has_a_layer() -> None:
    assert [m for m in _modules() if _layer(m) < 0] == []


def test_imports_go_one_way() -> None:
    modules = _modules()
    upward = [
        f"{modules[name].relative_to(ROOT)}:{line} imports {target} "
        f"({LAYERS[_layer(name)][0]} must not use {LAYERS[_layer(target)][0]})"
        for name, imports in _graph().items()
        for line, target in imports
        if _forbidden(name, target)
    ]
    assert upward == []


def test_no_import_cycle() -> None:
    graph = {name: [target for _, target in imports] for name, imports in _graph().items()}
    assert _cycles(graph) == []


def test_the_checks_see_what_they_should() -> None:
    # The checks above would pass vacuously if the graph came out empty or the cycle finder
    # were blind; they must find what is known to be there.
    graph = {name: {t for _, t in imports} for name, imports in _graph().items()}
    assert graph["coldsnap.__main__"] == {"coldsnap.cli"}
    # `from coldsnap.formats import request` depends on the module, not just the package.
    assert "coldsnap.formats.request.launch" in graph["coldsnap.formats.request.parse"]
    assert "coldsnap.formats.request" in graph["coldsnap.topology"]
    assert _layer("coldsnap.formats.request.rules") < _layer("coldsnap.operations.restore")
    # The service and the CLI sit side by side: neither may import the other, both the runner.
    assert _forbidden("coldsnap.service.job", "coldsnap.commands.outputs")
    assert _forbidden("coldsnap.commands.jobs", "coldsnap.service.job_store")
    assert not _forbidden("coldsnap.service.job", "coldsnap.runner.execute")
    assert not _forbidden("coldsnap.commands.operation", "coldsnap.runner.claim")
    assert not _forbidden("coldsnap.cli", "coldsnap.service.command")
    assert _forbidden("coldsnap.runner.claim", "coldsnap.commands.operation")
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _cycles({"a": ["a"], "b": []}) == [["a"]]
    assert _cycles({"a": ["b"], "b": []}) == []


def test_the_runner_prints_nothing() -> None:
    # Its lines go to the Report of the front end that runs it (the CLI's terminal, a service
    # job's stream); only the signal handler speaks to the process's own stderr.
    writes = []
    for path in sorted((PACKAGE / "runner").glob("*.py")):
        if path.name == "signals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr") and \
                    getattr(node.value, "id", "") == "sys":
                writes.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "print":
                writes.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(list((PACKAGE / "runner").glob("*.py"))) > 5
    assert writes == []


def test_commands_name_their_exit_statuses() -> None:
    # Every status a command returns comes from coldsnap.exits, so one meaning has one number.
    literal = []
    for path in [PACKAGE / "cli.py", *sorted((PACKAGE / "commands").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            values = []
            if isinstance(node, ast.Return) and node.value is not None:
                values.append(node.value)
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "report_failure":
                values.extend(node.args[1:])
                values.extend(k.value for k in node.keywords)
            literal += [f"{path.relative_to(ROOT)}:{v.lineno}" for v in values
                        if isinstance(v, ast.Constant) and type(v.value) is int]
    assert literal == []


@pytest.mark.parametrize("package", ["coldsnap.operations", "coldsnap.capsule"])
def test_operations_and_capsule_never_load_asyncssh(package: str) -> None:
    # Operations speak to the Host protocol only; SSH is the hosts layer's business. Every
    # submodule is imported, in a fresh interpreter, so nothing loaded earlier hides one.
    program = (
        "import importlib, pkgutil, sys\n"
        f"import {package} as root\n"
        "names = [m.name for m in pkgutil.walk_packages(root.__path__, root.__name__ + '.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(len(names), 'asyncssh' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True,
                            text=True, check=True)
    count, loaded = result.stdout.split()
    assert int(count) > 3
    assert loaded == "False"
