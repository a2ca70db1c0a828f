"""SIGINT and SIGTERM during an operation (coldsnap.runner.signals), with real signals sent
to a child process that runs a stand-in operation: it sleeps, and when cancelled it runs a
shielded "rollback" of a chosen length before ending."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from coldsnap.runner.signals import OperationSignals

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import asyncio, sys
from coldsnap.runner.signals import OperationSignals
from coldsnap.operations.context import OperationFailed

rollback_s, run_s = float(sys.argv[1]), float(sys.argv[2])

async def operation():
    try:
        print("running", flush=True)
        await asyncio.sleep(run_s)
        return "finished"
    except asyncio.CancelledError:
        print("rolling back", flush=True)
        await asyncio.shield(asyncio.sleep(rollback_s))
        print("rolled back", flush=True)
        raise

with OperationSignals("op-1") as signals:
    if len(sys.argv) > 3:  # a signal that arrives before the event loop runs
        import os, signal
        os.kill(os.getpid(), signal.SIGTERM)
    try:
        print(asyncio.run(signals.cancellable(operation())), flush=True)
    except OperationFailed as exc:
        print(f"{exc.code}: {exc.message}", flush=True)
        sys.exit(exc.exit_status)
"""


class Child:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def expect(self, line: str, timeout: float = 20) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.proc.stdout.readline()
            if not got:
                break
            if got.strip() == line:
                return
        raise AssertionError(f"the child never printed {line!r}")

    def send(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)

    def cancel(self, sig: signal.Signals) -> None:
        """The first signal, once the operation runs; returns once its rollback started."""
        self.expect("running")
        self.send(sig)
        self.expect("rolling back")

    def finish(self, timeout: float = 20) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err


@contextmanager
def child(rollback_s: float, run_s: float = 60, *extra: str) -> Iterator[Child]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(rollback_s), str(run_s), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        yield Child(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_first_signal_cancels_and_the_rollback_runs(sig: signal.Signals, status: int) -> None:
    with child(rollback_s=0.5) as c:
        c.expect("running")
        c.send(sig)
        code, out, err = c.finish()
    assert code == status, err
    assert out.splitlines() == ["rolling back", "rolled back",
                                f"cancelled: cancelled by {sig.name}"]
    assert f"{sig.name}: cancelling operation op-1" in err
    assert "Traceback" not in err


def test_a_second_sigint_does_not_interrupt_the_rollback() -> None:
    with child(rollback_s=2) as c:
        c.cancel(signal.SIGINT)
        c.send(signal.SIGINT)
        code, out, err = c.finish()
    assert code == 130
    assert "rolled back" in out.splitlines()
    assert "SIGINT again: the rollback of op-1 goes on" in err
    assert "UNCONFIRMED" not in err


def test_a_third_signal_exits_at_once_and_says_cleanup_is_unconfirmed() -> None:
    with child(rollback_s=60) as c:
        c.cancel(signal.SIGTERM)
        c.send(signal.SIGINT)
        time.sleep(0.2)
        started = time.monotonic()
        c.send(signal.SIGINT)
        code, out, err = c.finish()
        took = time.monotonic() - started
    assert code == 143  # the status of the signal that cancelled the operation
    assert took < 10, f"the forced exit took {took:.1f}s"
    assert "rolled back" not in out
    assert "cleanup is UNCONFIRMED" in err
    assert "coldsnapd gc --operation op-1" in err


def test_a_signal_before_the_loop_runs_cancels_at_once() -> None:
    with child(0.1, 60, "early") as c:
        code, out, err = c.finish()
    assert code == 143, err
    # The operation never started: its task was cancelled before its first step.
    assert out.splitlines() == ["cancelled: cancelled by SIGTERM"]


def test_without_a_signal_the_result_stands_and_handlers_are_restored() -> None:
    with child(rollback_s=0.1, run_s=0.2) as c:
        code, out, _ = c.finish()
    assert code == 0
    assert out.splitlines() == ["running", "finished"]
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with OperationSignals("op-2") as signals:
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
    assert signals.first is None and signals.exit_status is None
    assert {s: signal.getsignal(s) for s in before} == before


def test_counting_and_the_forced_exit_status() -> None:
    """The handler's decisions without the process machinery: the first signal cancels,
    the second only warns, the third forces exit with the first one's status."""
    exits: list[int] = []
    messages: list[str] = []

    class Sink:
        def write(self, text: str) -> int:
            messages.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    signals = OperationSignals("op-3", stderr=Sink(), force_exit=exits.append)  # type: ignore[arg-type]
    cancelled: list[bool] = []
    signals._cancel = lambda: cancelled.append(True)
    signals._signal(signal.SIGINT)
    signals._signal(signal.SIGTERM)
    assert cancelled == [True] and exits == []
    signals._signal(signal.SIGTERM)
    assert exits == [130]
    assert signals.exit_status == 130 and signals.count == 3
    assert len(messages) == 3 and "UNCONFIRMED" in messages[-1]
