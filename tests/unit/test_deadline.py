"""The operation deadline: its default grows with the bytes moved, expiry cancels the
operation so that its own rollback runs and ends it as `deadline`, a rollback already
running is never cut short, and a bad `--deadline` is refused naming it."""

from __future__ import annotations

import asyncio

import pytest

from coldsnap.cli import main
from coldsnap.operations.context import OperationFailed
from coldsnap.runner.deadline import (
    BYTES_PER_S,
    DeadlineExceeded,
    default_deadline,
    within_deadline,
)
from tests.unit.conftest import EXAMPLES


def test_default_deadline_grows_with_the_bytes_to_move() -> None:
    assert default_deadline("restore") == 600
    assert default_deadline("restore", 100 * BYTES_PER_S) == 700
    assert default_deadline("capture") == 1800
    assert default_deadline("sleep") == 600


async def test_expiry_cancels_the_operation_which_rolls_back_then_reports_deadline() -> None:
    undone: list[str] = []

    async def operation() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            undone.append("rolled back")
            raise
        return "finished"

    with pytest.raises(DeadlineExceeded) as err:
        await within_deadline(operation(), 0.05)
    assert undone == ["rolled back"]
    assert err.value.code == "deadline" and err.value.exit_status == 1
    assert "ran past its deadline of 0 s (--deadline)" in err.value.message


async def test_an_operation_within_its_deadline_is_untouched() -> None:
    async def operation() -> str:
        await asyncio.sleep(0)
        return "finished"

    assert await within_deadline(operation(), 3600) == "finished"
    with pytest.raises(OperationFailed) as err:
        await within_deadline(_fails(), 3600)
    assert err.value.code == "staging"  # its own error, not a deadline


async def _fails() -> None:
    raise OperationFailed("staging", "host-0: disk full")


async def test_a_rollback_already_running_is_not_cut_short() -> None:
    rolling_back = asyncio.Event()
    finished = asyncio.Event()

    async def failing_operation() -> None:
        rolling_back.set()  # failed, now rolling back: takes longer than the deadline
        await asyncio.sleep(0.2)
        finished.set()
        raise OperationFailed("criu-restore-failed", "unit-0: criu restore exited 1")

    with pytest.raises(OperationFailed) as err:
        await within_deadline(failing_operation(), 0.01, rolling_back=rolling_back.is_set)
    assert finished.is_set()
    assert err.value.code == "criu-restore-failed"


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf", "nan"])
def test_a_bad_deadline_is_refused_naming_it(value: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["capture", "--request", str(EXAMPLES / "tp2-two-hosts.yaml"),
              "--deadline", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--deadline" in err and "positive number of seconds" in err
