"""Fixtures shared by every test directory."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session", autouse=True)
def no_service_unless_asked(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The CLI submits to a coldsnapd service when one answers on its socket: the tests' CLI
    processes look for it where none runs, unless a test starts one and points them at it
    (a service left on the machine's default socket must not run the tests' operations)."""
    import os

    os.environ["COLDSNAP_SOCKET"] = str(tmp_path_factory.mktemp("no-service") / "none.sock")
