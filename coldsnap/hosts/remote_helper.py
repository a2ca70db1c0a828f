"""The far side of a transfer: a small program the controller sends to the host with every
call (`python3 -c <this file's source> MODE ARGS`); nothing is installed there.

Kept compatible with Python 3.8 (the oldest python3 on a supported host OS) and free of
imports beyond the standard library: only this file's text crosses to the host. The near side
imports it for the exit codes, so both ends share one definition.

Modes:
  put PART FINAL      partial state, then "OFFSET LENGTH", bytes, "HEX": write, verify, publish
  stat PATH           "part SIZE HEX" of a file (0 and the empty digest when absent), from
                      its verified stamp when that still matches
  stats PATH...       the same for each path, one line each, "absent" for no regular file
  recv PART OFF LEN   bytes from OFF (OpenSSH bulk path): write, publish as PART.<digest>
  commit SRC DST      rename a verified candidate into place
  get PATH OFFSET     "size SIZE", bytes from OFFSET, then "HEX" of the whole file
  reap TOKEN SECONDS  wait until no process of a put through OpenSSH marked with TOKEN (see
                      PUT_MARK) runs here, killing what still runs after half the time

Published files are fsync'd, then renamed, then their directory is fsync'd; partial files and
the directories made for them are private to the owner (0600, 0700): a CRIU image can hold
secrets.

A file published from bytes hashed on their way in carries a verified stamp: an extended
attribute with its digest, size and mtime. `stat` answers from a stamp that still matches the
file instead of reading GiBs again. A stamp lives on the inode, so a replaced file has none,
and any write to the file moves its mtime, so a stamp of older bytes no longer matches. The
controller's store keeps its objects' stamps the same way (this module is their one
definition, as the helper can import nothing of the package).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import signal
import stat
import sys
import threading
import time
from typing import Any, NoReturn

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_SHORT = 3  # the stream ended early; the partial file is kept for a resume
EXIT_MISMATCH = 4  # the bytes received do not hash to what the sender has
EXIT_OFFSET = 5  # a resume offset or a file size that no longer holds
EXIT_BUSY = 75  # another transfer is writing the same partial file

CH = 1 << 20
# A put through an OpenSSH client runs its `recv` under `env PUT_MARK=TOKEN`: the mark, in
# the shell's command line and the helper's environment, is how `reap` finds them.
PUT_MARK = "COLDSNAP_PUT"
STAMP_ATTR = "user.coldsnap.sha256"
F_SETPIPE_SZ = 1031  # Linux fcntl; not exposed by older Pythons' fcntl module


def die(code: int, msg: str) -> NoReturn:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()
    os._exit(code)


def hash_prefix(f: Any, h: Any, n: int, mv: memoryview) -> None:
    while n:
        k = f.readinto(mv[:min(CH, n)])
        if not k:
            die(EXIT_OFFSET, "file shrank while reading")
        h.update(mv[:k])
        n -= k


def sync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def stamp_text(st: os.stat_result, hexdigest: str) -> bytes:
    return f"{hexdigest} {st.st_size} {st.st_mtime_ns}".encode()


def stamped_digest(fd: int) -> str | None:
    """The hex digest that the file's verified stamp records, when the stamp still matches
    the file's size and mtime; None without one (or where the filesystem keeps no xattrs)."""
    try:
        value = os.getxattr(fd, STAMP_ATTR)
    except OSError:
        return None
    parts = value.split()
    if len(parts) != 3 or len(parts[0]) != 64:
        return None
    hexdigest = parts[0].decode("ascii", "replace")
    if any(c not in "0123456789abcdef" for c in hexdigest):
        return None
    if stamp_text(os.fstat(fd), hexdigest) != value:
        return None
    return hexdigest


def stamp(fd: int, hexdigest: str) -> None:
    """Record that the file's bytes, as they are now, hash to `hexdigest`. Best effort: a
    filesystem without user xattrs only means the next check hashes the file again."""
    with contextlib.suppress(OSError):
        os.setxattr(fd, STAMP_ATTR, stamp_text(os.fstat(fd), hexdigest))


def publish(f: Any, src: str, dst: str, hexdigest: str | None = None) -> None:
    f.flush()
    os.fsync(f.fileno())
    if hexdigest is not None:
        stamp(f.fileno(), hexdigest)
    f.close()
    os.replace(src, dst)
    sync_dir(dst)


def open_part(part: str) -> Any:
    os.makedirs(os.path.dirname(part) or ".", mode=0o700, exist_ok=True)
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    f = os.fdopen(fd, "a+b", buffering=0)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        die(EXIT_BUSY, "busy: another transfer is writing " + part)
    return f


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


def main(argv: list[str]) -> int:
    out = sys.stdout.buffer
    mv = memoryview(bytearray(CH))
    mode = argv[0] if argv else ""
    if mode == "put":
        part, final = argv[1], argv[2]
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
    elif mode == "stat":
        out.write(file_state(argv[1], mv, absent=f"part 0 {hashlib.sha256().hexdigest()}"))
    elif mode == "stats":
        for path in argv[1:]:
            out.write(file_state(path, mv, absent="absent"))
    elif mode == "recv":
        # The bytes come straight from an OpenSSH client; the sender learns our digest from
        # stdout and commits only the candidate named after the digest it computed itself.
        part, offset, length = argv[1], int(argv[2]), int(argv[3])
        f = open_part(part)
        size, h = part_state(f, mv)
        h = receive(f, size, h, offset, length, sys.stdin.buffer, mv)
        got = h.hexdigest()
        publish(f, part, part + "." + got, got)
        out.write(f"got {offset + length} {got}\n".encode())
    elif mode == "reap":
        reap(argv[1], float(argv[2]))
    elif mode == "commit":
        try:
            os.replace(argv[1], argv[2])
        except FileNotFoundError:
            die(EXIT_MISMATCH, "no verified candidate " + argv[1])
        sync_dir(argv[2])
    elif mode == "get":
        path, offset = argv[1], int(argv[2])
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115 (held to the end of the send)
        except OSError as e:
            die(EXIT_USAGE, f"cannot open {path}: {e.strerror}")
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
    else:
        die(EXIT_USAGE, "unknown mode " + mode)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
