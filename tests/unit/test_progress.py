from __future__ import annotations

import io

from coldsnap.progress import TransferProgress


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
    p = TransferProgress("get host-1", out, tty=True, width=10)
    p(0, 100)
    p(100, 100)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert "[##########]" in text and "100.0%" in text


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
