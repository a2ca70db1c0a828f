"""The test suite's own shape: every integration module carries the `integration` marker
(`pytest -m "not integration"` must leave out every test that needs the dev cluster), and no
two test modules share a name across tests/unit and tests/integration (a failure's module
name alone says which one ran)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _marks_integration(module: Path) -> bool:
    """A module-level `pytestmark` naming pytest.mark.integration (alone or in a list)."""
    tree = ast.parse(module.read_text(), str(module))
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            value = node.value
            assert value is not None
            marks = value.elts if isinstance(value, ast.List | ast.Tuple) else [value]
            if any(ast.unparse(m) == "pytest.mark.integration" for m in marks):
                return True
    return False


def test_every_integration_module_is_marked_integration() -> None:
    modules = sorted((TESTS / "integration").glob("test_*.py"))
    assert modules
    assert [m.name for m in modules if not _marks_integration(m)] == []


def test_the_marker_check_sees_a_module_without_it(tmp_path: Path) -> None:
    bare = tmp_path / "test_bare.py"
    bare.write_text("import pytest\n\ndef test_x() -> None:\n    pass\n")
    listed = tmp_path / "test_listed.py"
    listed.write_text("import pytest\n\npytestmark = [pytest.mark.slow, pytest.mark.integration]\n")
    assert not _marks_integration(bare)
    assert _marks_integration(listed)


def test_test_module_names_are_unique_across_unit_and_integration() -> None:
    unit = {p.name for p in (TESTS / "unit").glob("test_*.py")}
    integration = {p.name for p in (TESTS / "integration").glob("test_*.py")}
    assert sorted(unit & integration) == []
