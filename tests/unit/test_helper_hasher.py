"""The helper's Hasher: a pull's bytes are hashed in a thread of its own beside the receiving
and writing, in order, every byte of them, and the digest still decides (a mismatch is still
one, its partial file removed)."""

from __future__ import annotations

import hashlib
import io
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from coldsnap.hosts.helper import files
from coldsnap.hosts.helper import registry as reg_mode
from coldsnap.hosts.helper.common import CH, EXIT_MISMATCH
from coldsnap.hosts.helper.stamps import STAMP_ATTR


def test_pieces_of_any_size_through_few_buffers_hash_in_order() -> None:
    data = os.urandom(7 * 4096 + 123)
    hasher = files.Hasher(hashlib.sha256(), slots=2, size=4096)
    at = 0
    for n in (1, 4096, 17, 4096, 4000, 2, 4096, 4096, 4096, 4096, len(data)):
        piece = data[at:at + n]
        if not piece:
            break
        buf = hasher.buffer()  # one of two buffers: waits for the thread to free one
        buf[:len(piece)] = piece
        hasher.hand(buf, len(piece))
        at += len(piece)
    assert at == len(data)
    assert hasher.digest().hexdigest() == hashlib.sha256(data).hexdigest()
    assert not hasher.thread.is_alive()


def test_close_ends_the_thread_without_a_digest() -> None:
    hasher = files.Hasher(hashlib.sha256())
    buf = hasher.buffer()
    hasher.hand(buf, 0)
    hasher.close()
    hasher.close()  # twice is harmless
    assert not hasher.thread.is_alive()


class _Recording:
    """sha256 that notes which thread hashed each piece."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.threads: set[int] = set()
        self.pieces = 0

    def update(self, b: Any) -> None:
        self.threads.add(threading.get_ident())
        self.pieces += 1
        self.h.update(b)

    def hexdigest(self) -> str:
        return self.h.hexdigest()


class _Body:
    """A registry's 200 answer of `data`, as http.client's response reads it."""

    status = 200

    def __init__(self, data: bytes) -> None:
        self.f = io.BytesIO(data)
        self.length = len(data)

    def readinto(self, b: Any) -> int:
        n = self.f.readinto(b)
        self.length -= n
        return n


def _pull(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, body: bytes, digest: str,
          size: int) -> _Recording:
    recording = _Recording()
    monkeypatch.setattr(files.hashlib, "sha256", lambda: recording)
    final = str(tmp_path / "obj")
    part = final + reg_mode.PULL_PART_SUFFIX
    f = files.open_part(part)
    reg_mode.pull_into(None, f, part, final, digest, size, _Body(body))
    return recording


def test_a_pull_hashes_beside_the_thread_that_receives_and_publishes_verified(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    data = os.urandom(3 * CH + 5)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    recording = _pull(monkeypatch, tmp_path, data, digest, len(data))
    assert recording.pieces == 4  # every byte went through the hash, piece by piece
    assert threading.get_ident() not in recording.threads
    assert (tmp_path / "obj").read_bytes() == data
    assert os.getxattr(tmp_path / "obj", STAMP_ATTR).startswith(digest[7:].encode())


def test_bytes_that_do_not_hash_to_the_digest_are_still_refused(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    data = os.urandom(2 * CH + 9)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    lying = data[:CH] + bytes([data[CH] ^ 1]) + data[CH + 1:]
    with pytest.raises(reg_mode.RegFailed) as failed:
        _pull(monkeypatch, tmp_path, lying, digest, len(data))
    assert failed.value.code == EXIT_MISMATCH
    assert not (tmp_path / "obj").exists()
    assert not (tmp_path / ("obj" + reg_mode.PULL_PART_SUFFIX)).exists()
