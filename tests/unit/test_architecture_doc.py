"""docs/ARCHITECTURE.md stays short and true: every path it names exists, and its layer table
is the order that tests/unit/test_code_shape.py enforces.

The page is a map a newcomer follows; a module that was renamed or moved would send them to
nothing, and a layer table that disagrees with the import check would teach the wrong rule.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.test_code_shape import LAYERS

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "ARCHITECTURE.md"
MAX_LINES = 250
# Top-level folders of the repository a path on the page may start with; any other relative
# path is read as a module inside `coldsnap/`.
TOP = ("coldsnap", "docs", "tests", "deploy", "devtools", "scripts")
# A backticked path: a folder (ending in `/`) or a file with an extension. Host paths
# (`/var/...`) and placeholders (`<hex>`) are not files of this repository.
PATH = re.compile(r"`([A-Za-z0-9_.][A-Za-z0-9_./-]*(?:/|\.(?:py|md|yaml|yml|toml|json|svg)))`")


def _text() -> str:
    return PAGE.read_text()


def _named_paths(text: str) -> list[str]:
    return [p for p in PATH.findall(text) if "<" not in p]


def _resolve(path: str) -> Path:
    first = path.split("/", 1)[0]
    return ROOT / path if first in TOP else ROOT / "coldsnap" / path


def _layer_rows(text: str) -> list[tuple[str, str]]:
    """(layer, modules cell) for each row of the layer table, in page order."""
    section = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 3 and cells[0] not in ("layer", "---"):
            rows.append((cells[0], cells[1]))
    return rows


def _prefix_paths(prefix: str) -> tuple[str, ...]:
    """How the page may name a module prefix of LAYERS: its package or its module file."""
    if prefix == "coldsnap":
        return ("coldsnap/__init__.py",)
    path = prefix.replace(".", "/")
    return (f"{path}/", f"{path}.py")


def test_the_page_is_short() -> None:
    lines = len(_text().splitlines())
    assert lines < MAX_LINES, f"docs/ARCHITECTURE.md has {lines} lines; details belong to " \
                              "the doc of each part"


def test_every_named_path_exists() -> None:
    named = _named_paths(_text())
    # The page names dozens of modules; too few found means the pattern stopped matching.
    assert len(named) > 40
    assert [p for p in named if not _resolve(p).exists()] == []


def test_modules_are_named_with_their_package() -> None:
    # `kinds.py` alone could be any package's; the walk of a restore must be followable.
    bare = [p for p in _named_paths(_text()) if p.endswith(".py") and "/" not in p]
    assert bare == []


def test_the_layer_table_is_the_order_the_import_check_enforces() -> None:
    rows = _layer_rows(_text())
    assert [layer for layer, _ in rows] == [name for name, _, _ in LAYERS]
    missing = [
        (name, prefix)
        for (name, _, prefixes), (_, cell) in zip(LAYERS, rows, strict=True)
        for prefix in prefixes
        if not any(f"`{p}`" in cell for p in _prefix_paths(prefix))
    ]
    assert missing == []


def test_the_picture_names_every_layer() -> None:
    text = _text()
    assert "```mermaid" in text
    diagram = text.split("```mermaid", 1)[1].split("```", 1)[0]
    assert [name for name, _, _ in LAYERS if f'["{name}<br/>' not in diagram] == []


def test_the_restore_walk_names_the_modules_a_restore_passes_through() -> None:
    walk = _text().split("## The walk of one restore", 1)[1].split("\n## ", 1)[0]
    for module in ("coldsnap/cli.py", "coldsnap/commands/operation.py",
                   "coldsnap/runner/operation_kinds.py", "coldsnap/runner/claim.py",
                   "coldsnap/runner/execute.py", "coldsnap/operations/restore.py",
                   "coldsnap/operations/restore_checks.py", "coldsnap/operations/sessions.py",
                   "coldsnap/operations/staging.py", "coldsnap/capsule/restore_container.py"):
        assert f"`{module}`" in walk, module
