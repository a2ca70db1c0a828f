"""The helper's file transfer modes: the far side of every put and get (see
`coldsnap.hosts.transfer` for the protocol), the stat of staged files, and the end of an
OpenSSH put's far side.

Partial files and the directories made for them are private to the owner (0600, 0700): a
CRIU image can hold secrets. A file published from bytes hashed on their way in carries a
verified stamp (`stamps.STAMP_ATTR`).

A part of the helper program (see `coldsnap.hosts.helper`): Python 3.8, standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import queue
import signal
import stat
import sys
import threading
import time
from typing import Any

from coldsnap.hosts.helper.beneath import Refused, open_beneath
from coldsnap.hosts.helper.common import (
    CH,
    EXIT_BUSY,
    EXIT_MISMATCH,
    EXIT_OFFSET,
    EXIT_REFUSED,
    EXIT_SHORT,
    EXIT_USAGE,
    F_SETPIPE_SZ,
    die,
    publish,
    sync_dir,
)
from coldsnap.hosts.helper.stamps import stamped_digest

# A put through an OpenSSH client runs its `recv` under `env PUT_MARK=TOKEN`: the mark, in
# the shell's command line and the helper's environment, is how `reap` finds them.
PUT_MARK = "COLDSNAP_PUT"


def hash_prefix(f: Any, h: Any, n: int, mv: memoryview) -> None:
    while n:
        k = f.readinto(mv[:min(CH, n)])
        if not k:
            die(EXIT_OFFSET, "file shrank while reading")
        h.update(mv[:k])
        n -= k


class Busy(Exception):
    """Another transfer holds the partial file's lock."""


def lock_part(part: str) -> Any:
    """The partial file `part`, open for appending and locked; Busy when another transfer
    holds it (`open_part` exits on that; the batch of `blob-pulls` fails only that pull)."""
    os.makedirs(os.path.dirname(part) or ".", mode=0o700, exist_ok=True)
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    f = os.fdopen(fd, "a+b", buffering=0)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise Busy("busy: another transfer is writing " + part) from None
    return f


def open_part(part: str) -> Any:
    try:
        return lock_part(part)
    except Busy as e:
        die(EXIT_BUSY, str(e))


def part_state(f: Any, mv: memoryview) -> tuple[int, Any]:
    f.seek(0)
    size = os.fstat(f.fileno()).st_size
    h = hashlib.sha256()
    hash_prefix(f, h, size, mv)
    return size, h


WRITEBACK_BYTES = 64 << 20  # written but not yet flushed, before a flush starts


class Writeback:
    """Flushes what has been written so far from a thread of its own while the transfer goes
    on, so that the fsync which publishes the file finds little left to write (a GiB left
    dirty to the end costs that fsync most of a second). The controller's get uses it too."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.flushed = 0
        self.thread: threading.Thread | None = None

    def written(self, done: int) -> None:
        """`done` bytes are written so far."""
        busy = self.thread is not None and self.thread.is_alive()
        if not busy and done - self.flushed >= WRITEBACK_BYTES:
            self.flushed = done
            self.thread = threading.Thread(target=self.flush, daemon=True)
            self.thread.start()

    def flush(self) -> None:
        with contextlib.suppress(OSError):  # the final fsync reports what matters
            os.fdatasync(self.fd)

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


class Hasher:
    """Hashes the pieces of a stream in order in a thread of its own, while the caller
    receives and writes the next ones: one stream's bytes then cost the longer of the two
    (receive and write, or hash) instead of their sum (hashlib lets go of the GIL while it
    hashes a piece). The pieces are `slots` buffers of `size` bytes that go round: the caller
    takes a free one (`buffer`, blocking while all are queued), fills and writes it, and hands
    it on (`hand`); `digest` waits for the last one. A thread that never got its pieces
    (`close` on a failure) ends without hashing the rest."""

    def __init__(self, h: Any, slots: int = 4, size: int = CH) -> None:
        self.h = h
        self.free: Any = queue.Queue()
        self.full: Any = queue.Queue()
        for _ in range(slots):
            self.free.put(memoryview(bytearray(size)))
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while True:
            item = self.full.get()
            if item is None:
                return
            mv, k = item
            self.h.update(mv[:k])
            self.free.put(mv)

    def buffer(self) -> memoryview:
        return self.free.get()  # type: ignore[no-any-return]

    def hand(self, mv: memoryview, k: int) -> None:
        self.full.put((mv, k))

    def digest(self) -> Any:
        """The hash of every piece handed on, once the thread has hashed them all."""
        self.close()
        return self.h

    def close(self) -> None:
        if self.thread.is_alive():
            self.full.put(None)
            self.thread.join()


def receive(f: Any, size: int, h: Any, offset: int, length: int, inp: Any,
            mv: memoryview) -> Any:
    if offset == 0:
        h = hashlib.sha256()
        f.truncate(0)
    elif offset != size:
        die(EXIT_OFFSET, f"offset {offset} does not match partial size {size}")
    with contextlib.suppress(OSError, ValueError):
        # A deeper pipe lets sshd keep delivering while we hash and write.
        fcntl.fcntl(inp.fileno(), F_SETPIPE_SZ, CH)
    left = length
    writeback = Writeback(f.fileno())
    try:
        while left:
            # readinto1: take what has arrived instead of waiting for a full buffer, so
            # receiving, hashing and writing interleave in small steps.
            k = inp.readinto1(mv[:min(CH, left)])
            if not k:
                writeback.join()
                f.close()
                die(EXIT_SHORT, f"short: stream ended after {length - left} of {length} "
                                "bytes; partial kept")
            h.update(mv[:k])
            w = 0
            while w < k:
                w += f.write(mv[w:k])
            left -= k
            writeback.written(length - left)
    finally:
        writeback.join()
    return h


def file_state(path: str, mv: memoryview, absent: str) -> bytes:
    """"part SIZE HEX" of a regular file, from its verified stamp when that still matches;
    `absent` when there is none."""
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115 (closed below)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return (absent + "\n").encode()
    with f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return (absent + "\n").encode()
        known = stamped_digest(f.fileno())
        if known is not None:
            return f"part {os.fstat(f.fileno()).st_size} {known}\n".encode()
        size, h = part_state(f, mv)
        return f"part {size} {h.hexdigest()}\n".encode()


def marked(mark: bytes) -> list[int]:
    """PIDs of the processes here (this one excepted) whose command line or environment
    holds `mark`; those of other users cannot be read and do not count."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        for part in ("cmdline", "environ"):
            try:
                with open("/proc/" + name + "/" + part, "rb") as f:
                    if mark in f.read():
                        found.append(int(name))
                        break
            except OSError:
                pass
    return found


def reap(token: str, seconds: float) -> None:
    """Until the marked processes of a failed or cancelled put are gone, and have stayed gone
    for a few looks (sshd may still be starting one for a client that already died): the
    caller then cleans up after them, not before them."""
    mark = (PUT_MARK + "=" + token).encode()
    start = time.monotonic()
    quiet = 0
    while quiet < 3:
        pids = marked(mark)
        quiet = 0 if pids else quiet + 1
        waited = time.monotonic() - start
        if pids and waited > seconds:
            die(EXIT_BUSY, "still running after " + str(seconds) + "s: " + str(pids))
        if pids and waited > seconds / 2:
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)




def put(args: list[str], out: Any, mv: memoryview) -> None:
    """put PART FINAL: partial state, then "OFFSET LENGTH", bytes, "HEX": write, verify,
    publish."""
    part, final = args[0], args[1]
    f = open_part(part)
    size, h = part_state(f, mv)
    out.write(f"part {size} {h.hexdigest()}\n".encode())
    out.flush()
    inp = sys.stdin.buffer
    hdr = inp.readline().split()
    if len(hdr) != 2:
        die(EXIT_SHORT, "short: no header")
    offset, length = int(hdr[0]), int(hdr[1])
    h = receive(f, size, h, offset, length, inp, mv)
    want = inp.readline().strip().decode()
    got = h.hexdigest()
    if want != got:
        os.unlink(part)
        die(EXIT_MISMATCH, f"digest mismatch: received sha256:{got}, sender has sha256:{want}")
    publish(f, part, final, got)
    out.write(f"ok {offset + length} {got}\n".encode())
    out.flush()


def recv(args: list[str], out: Any, mv: memoryview) -> None:
    """recv PART OFF LEN: bytes from OFF (OpenSSH bulk path): write, publish as
    PART.<digest>."""
    # The bytes come straight from an OpenSSH client; the sender learns our digest from
    # stdout and commits only the candidate named after the digest it computed itself.
    part, offset, length = args[0], int(args[1]), int(args[2])
    f = open_part(part)
    size, h = part_state(f, mv)
    h = receive(f, size, h, offset, length, sys.stdin.buffer, mv)
    got = h.hexdigest()
    publish(f, part, part + "." + got, got)
    out.write(f"got {offset + length} {got}\n".encode())


def commit(args: list[str]) -> None:
    """commit SRC DST: rename a verified candidate into place."""
    try:
        os.replace(args[0], args[1])
    except FileNotFoundError:
        die(EXIT_MISMATCH, "no verified candidate " + args[0])
    sync_dir(os.path.dirname(args[1]) or ".")


def open_read(path: str, root: str | None) -> Any:
    """`path` open for reading: beneath `root` with no symlink followed when given (exit 6
    naming the path when that fails), else as named."""
    try:
        if root is None:
            return open(path, "rb", buffering=0)
        return os.fdopen(open_beneath(root, path), "rb", buffering=0)
    except Refused as e:
        die(EXIT_REFUSED, str(e))
    except OSError as e:
        die(EXIT_USAGE, f"cannot open {path}: {e.strerror}")


def send(args: list[str], out: Any) -> None:
    """send ROOT PATH OFFSET: "size SIZE", then the bytes from OFFSET, by `head` from the
    descriptor opened here (never more than SIZE, should the file grow meanwhile)."""
    f = open_read(args[1], args[0])
    offset = int(args[2])
    size = os.fstat(f.fileno()).st_size
    if offset > size:
        die(EXIT_OFFSET, f"offset {offset} beyond size {size}")
    out.write(f"size {size}\n".encode())
    out.flush()
    os.lseek(f.fileno(), offset, os.SEEK_SET)
    os.dup2(f.fileno(), 0)
    os.execvp("head", ["head", "-c", str(size - offset)])  # noqa: S606 (an argv, no shell)


def payload(args: list[str], out: Any, mv: memoryview) -> None:
    """payload PATH MAX ROOT...: where PATH resolves, under which root, its size and sha256,
    hashed from a descriptor opened beneath that root."""
    path, cap, roots = args[0], int(args[1]), [os.path.realpath(r) for r in args[2:]]
    real = os.path.realpath(path)
    if not os.path.lexists(real):
        die(EXIT_USAGE, f"{path} does not exist")
    root = next((r for r in roots if real.startswith(r.rstrip("/") + "/")), None)
    if root is None:
        die(EXIT_REFUSED, f"{path} resolves to {real}, outside every mount of the unit")
    f = open_read(real, root)
    with f:
        size = os.fstat(f.fileno()).st_size
        if size > cap:
            die(EXIT_REFUSED, f"{path} is {size} bytes, over the {cap} byte cap")
        h = hashlib.sha256()
        hash_prefix(f, h, size, mv)
    out.write(json.dumps({"real": real, "root": root, "size": size,
                          "sha256": "sha256:" + h.hexdigest()}).encode())


def get(args: list[str], out: Any, mv: memoryview) -> None:
    """get PATH OFFSET [ROOT]: "size SIZE", bytes from OFFSET, then "HEX" of the whole file."""
    path, offset = args[0], int(args[1])
    f = open_read(path, args[2] if len(args) > 2 else None)
    size = os.fstat(f.fileno()).st_size
    if offset > size:
        die(EXIT_OFFSET, f"offset {offset} beyond size {size}")
    out.write(f"size {size}\n".encode())
    out.flush()
    h = hashlib.sha256()
    hash_prefix(f, h, offset, mv)
    left = size - offset
    while left:
        k = f.readinto(mv[:min(CH, left)])
        if not k:
            die(EXIT_OFFSET, "file shrank while reading")
        h.update(mv[:k])
        out.write(mv[:k])
        left -= k
    out.write((h.hexdigest() + "\n").encode())
    out.flush()
