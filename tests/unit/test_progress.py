from __future__ import annotations

import io

import pytest

from coldsnap.progress import ProgressBoard, TransferProgress


def test_plain_output_is_sparse() -> None:
    out = io.StringIO()
    p = TransferProgress("put host-0", out, tty=False)
    total = 1000 * 1024 * 1024
    for i in range(0, 1001):
        p(i * 1024 * 1024, total)
    lines = out.getvalue().splitlines()
    assert 2 <= len(lines) <= 4
    assert "\r" not in out.getvalue()
    assert lines[-1].startswith("put host-0 100.0%")


def test_tty_output_redraws_one_line_and_ends_it() -> None:
    out = io.StringIO()
    p = TransferProgress("get host-1", out, tty=True)
    p(0, 100)
    p(100, 100)
    assert p._live is None  # the finished transfer ended rich's bar itself
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert text.startswith("get host-1 ") and "100%" in text and "100/100 bytes" in text


def test_tty_bar_leaves_resumed_bytes_out_of_the_rate() -> None:
    out = io.StringIO()
    with TransferProgress("put host-0", out, tty=True) as p:
        p(500, 1000)
        assert p._live is not None
        (task,) = p._live.tasks
        assert task.completed == 500 and task.speed is None


def test_tty_bar_of_a_failed_transfer_ends_with_the_context() -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError), TransferProgress("put host-0", out, tty=True) as p:
        p(40, 100)
        raise RuntimeError("connection lost")
    assert p._live is None
    assert out.getvalue().endswith("\n") and "40%" in out.getvalue()


def test_resumed_transfer_starts_where_it_left_off() -> None:
    out = io.StringIO()
    p = TransferProgress("put", out, tty=False)
    p(500, 1000)
    p(1000, 1000)
    assert out.getvalue().splitlines()[0].startswith("put  50.0%")


def test_empty_file() -> None:
    out = io.StringIO()
    TransferProgress("put", out, tty=False)(0, 0)
    assert "100.0%" in out.getvalue()


def test_board_keeps_one_bar_per_host_and_a_total() -> None:
    out = io.StringIO()
    with ProgressBoard(out, tty=True) as board:
        a = board("host-0 oci-capsule unit/unit-0")
        b = board("host-1 oci-capsule unit/unit-1")
        c = board("host-0 model-weight-payload worker/worker-0")
        a(0, 100)
        b(0, 300)
        c(0, 100)
        a(100, 100)
        b(150, 300)
        c(50, 100)
        assert board._live is not None
        tasks = {t.description.split()[0]: t for t in board._live.tasks}
    assert set(tasks) == {"total", "host-0", "host-1"}
    assert (tasks["host-0"].completed, tasks["host-0"].total) == (150, 200)
    assert (tasks["host-1"].completed, tasks["host-1"].total) == (150, 300)
    assert (tasks["total"].completed, tasks["total"].total) == (300, 500)
    assert "host-0" in out.getvalue() and "host-1" in out.getvalue()


def test_board_without_a_terminal_writes_plain_lines() -> None:
    out = io.StringIO()
    with ProgressBoard(out, tty=False) as board:
        cb = board("host-0 oci-capsule unit/unit-0")
        for done in range(0, 101, 10):
            cb(done, 100)
    lines = out.getvalue().splitlines()
    assert 2 <= len(lines) <= 4 and all(line.startswith("host-0 oci-capsule") for line in lines)
    assert "\r" not in out.getvalue()
