"""Fixtures shared by every test directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session", autouse=True)
def no_service_unless_asked(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The CLI submits to a coldsnapd service when one answers on its socket: the tests' CLI
    processes look for it where none runs, unless a test starts one and points them at it
    (a service left on the machine's default socket must not run the tests' operations)."""
    os.environ["COLDSNAP_SOCKET"] = str(tmp_path_factory.mktemp("no-service") / "none.sock")


# The fuzzers' profile (tests/unit/test_fuzz_cli.py): as many cases as CI runs, unless
# COLDSNAP_FUZZ_CASES asks for fewer on a quick local run. No deadline: the machine is shared.
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("COLDSNAP_FUZZ_CASES", "10000")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)
