"""The helper's CRIU image set modes, and the export of a capsule's own layers.

  pack SRC OUT CHUNK SMALL  the regular files of SRC as content-addressed objects OUT/<hex>:
                            a file over SMALL bytes cut into CHUNK-byte objects, smaller files
                            packed together up to CHUNK; prints the layout as JSON
  place ROOT OBJ HEX        stdin: the object's copies, each [[name, file_offset,
                            object_offset, length], ...] from offset 0 to its end: write OBJ's
                            bytes into ROOT's files while hashing it, blocks of zeros left
                            holes; exit 4 when OBJ is not HEX
  finish PART FINAL         stdin {"files": [[name, size, mode], ...], "plan": PLAN}: size
                            (a trailing hole), check, fsync, stamp, publish PART as FINAL
  layers SRC DST NBASE      a `docker save` tar without its first NBASE layers: what
                            `docker load` needs on a host that has the base image; prints
                            "HEX SIZE" of DST

A published directory carries a verified set stamp (`stamps.SET_STAMP_ATTR`). `check_set`
(PLAN being [[hex, size, copies], ...] with copies as for place; the `holdings` mode calls it)
answers from a stamp that still matches instead of reading the files again. `finish` stamps,
since every object was hashed as it was placed, and so does a `check_set` that read
everything.

Objects and published files are fsync'd before their rename and their directory after it;
everything is private to the owner (0600 files, 0700 directories): CRIU images hold the
engine's memory.

A part of the helper program (see `coldsnap.hosts.helper`): Python 3.8, standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import stat
import sys
import tarfile
from typing import Any

from coldsnap.hosts.helper.beneath import Refused, open_beneath
from coldsnap.hosts.helper.common import (
    CH,
    EXIT_ABSENT,
    EXIT_MISMATCH,
    EXIT_REFUSED,
    EXIT_USAGE,
    die,
    publish,
    sync_dir,
)
from coldsnap.hosts.helper.stamps import read_set_stamp, set_stamp, write_set_stamp


class ObjectWriter:
    """Objects written under a temporary name while hashed, published under their digest."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.objects: list[tuple[str, int]] = []
        self.listed: set[str] = set()
        self.f: Any = None
        self.h: Any = None
        self.size = 0

    def start(self) -> None:
        tmp = os.path.join(self.out, ".object.partial")
        # Kept open across write() calls until close(): not a with-block's lifetime.
        self.f = open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")  # noqa: SIM115
        self.h = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> None:
        if self.f is None:
            self.start()
        self.f.write(data)
        self.h.update(data)
        self.size += len(data)

    def close(self) -> str:
        """Publish the object being written; returns its hex digest."""
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        self.f = None
        hexd = str(self.h.hexdigest())
        tmp = os.path.join(self.out, ".object.partial")
        final = os.path.join(self.out, hexd)
        if hexd in self.listed:  # identical bytes already packed (a zero page chunk, say)
            os.unlink(tmp)
        else:
            os.replace(tmp, final)
            self.listed.add(hexd)
            self.objects.append((hexd, self.size))
        return hexd


def copy_in(f: Any, w: ObjectWriter, n: int, path: str, mv: memoryview) -> None:
    """The next `n` bytes of `f` into the object being written."""
    while n:
        k = f.readinto(mv[:min(CH, n)])
        if not k:
            die(EXIT_USAGE, f"{path} shrank while packing")
        w.write(mv[:k])
        n -= k


def open_image(src: str, name: str) -> Any:
    """An image file of the dump directory, which the engine's container can write: opened
    without following a symlink (`open_beneath`), a regular file, or the pack fails naming
    it; what is packed is what this descriptor reads."""
    try:
        return os.fdopen(open_beneath(src, os.path.join(src, name)), "rb")
    except Refused as e:
        die(EXIT_REFUSED, f"{e}: a CRIU image directory holds only regular files")


def pack(src: str, out: str, chunk: int, small: int) -> None:
    os.makedirs(out, mode=0o700, exist_ok=True)
    os.chmod(out, 0o700)
    sizes = {}
    for n in os.listdir(src):  # a dump holds thousands of files: one open at a time
        with open_image(src, n) as f:
            sizes[n] = os.fstat(f.fileno()).st_size
    # Small files first, so that they all share pack objects; then the large ones.
    names = sorted(sizes, key=lambda n: (sizes[n] > small, n))
    files: list[Any] = []
    w = ObjectWriter(out)
    buf = bytearray(CH)
    mv = memoryview(buf)
    # Small files go into one pack object at a time; their extents name it once it is closed.
    pending: list[Any] = []

    def close_pack() -> None:
        if w.f is None:
            return
        hexd = w.close()
        for extent in pending:
            extent["object"] = "sha256:" + hexd
        del pending[:]

    for name in names:
        path = os.path.join(src, name)
        with open_image(src, name) as f:
            st = os.fstat(f.fileno())
            if st.st_size != sizes[name]:
                die(EXIT_MISMATCH, f"{path} changed while packing")
            entry: dict[str, Any] = {"name": name, "size": st.st_size,
                                     "mode": stat.S_IMODE(st.st_mode), "extents": []}
            files.append(entry)
            if st.st_size == 0:
                continue
            if st.st_size <= small:
                if w.f is not None and w.size + st.st_size > chunk:
                    close_pack()
                extent = {"object": "", "offset": w.size if w.f is not None else 0,
                          "length": st.st_size}
                copy_in(f, w, st.st_size, path, mv)
                entry["extents"].append(extent)
                pending.append(extent)
                continue
            close_pack()
            left = st.st_size
            while left:
                piece = min(chunk, left)
                copy_in(f, w, piece, path, mv)
                entry["extents"].append({"object": "sha256:" + w.close(), "offset": 0,
                                         "length": piece})
                left -= piece
    close_pack()
    sync_dir(out)
    json.dump({"files": files, "objects": [{"sha256": "sha256:" + h, "bytes": n}
                                           for h, n in w.objects]}, sys.stdout)


def write_range(fds: dict[str, int], copy: list[Any], pos: int, data: Any) -> None:
    """Write object bytes [pos, pos + len(data)) where one copy of the object goes."""
    end = pos + len(data)
    for name, file_off, obj_off, length in copy:
        lo, hi = max(pos, obj_off), min(end, obj_off + length)
        if lo < hi:
            os.pwrite(fds[name], data[lo - pos:hi - pos], file_off + lo - obj_off)


class BadPieces(Exception):
    """The copies of an object that do not tile it from offset 0, or that name a file
    outside the set's directory."""


class Placer:
    """Writes one object's bytes, in order, where each of its copies goes in ROOT's files:
    `copies` as for `place`. A block of zeros is left a hole: ROOT is a set directory made
    for this assembly, so a hole reads back as zeros (`finish` gives each file its size),
    and the pages of zeros CRIU dumped take neither the disk's writes nor its room."""

    def __init__(self, root: str, copies: Any) -> None:
        self.copies = copies
        self.fds: dict[str, int] = {}
        self.size = 0
        self.pos = 0
        try:
            for copy in copies:
                at = 0
                for name, _file_off, obj_off, length in copy:
                    if obj_off != at or os.sep in name or name.startswith("."):
                        raise BadPieces(f"bad piece {name!r} at {obj_off}")
                    at += length
                    if name not in self.fds:
                        self.fds[name] = os.open(os.path.join(root, name),
                                                 os.O_WRONLY | os.O_CREAT, 0o600)
                self.size = at
        except (TypeError, ValueError) as e:
            self.close()
            raise BadPieces(f"pieces are [name, file_offset, object_offset, length]: {e}"
                            ) from None
        except BaseException:
            self.close()
            raise

    def write(self, block: Any, k: int, zeros: bytes) -> None:
        """The next `k` bytes of the object, the start of `block` (a full bytearray of
        len(zeros) bytes compares without a copy)."""
        data = memoryview(block)[:k]
        if (block != zeros) if k == len(zeros) else (bytes(data) != zeros[:k]):
            for copy in self.copies:
                write_range(self.fds, copy, self.pos, data)
        self.pos += k

    def flush(self, least: int) -> None:
        """fdatasync the files that a piece of at least `least` bytes went to."""
        for name in {p[0] for copy in self.copies for p in copy if p[3] >= least}:
            os.fdatasync(self.fds[name])

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def place(root: str, obj: str, hexd: str) -> None:
    try:
        placer = Placer(root, json.load(sys.stdin))
    except BadPieces as e:
        die(EXIT_USAGE, str(e))
    h = hashlib.sha256()
    buf = bytearray(CH)
    zeros = bytes(CH)
    mv = memoryview(buf)
    try:
        with open(obj, "rb") as f:
            while True:
                k = f.readinto(mv)
                if not k:
                    break
                if placer.pos + k > placer.size:
                    die(EXIT_MISMATCH, f"{obj} is longer than its pieces")
                h.update(mv[:k])
                placer.write(buf, k, zeros)
        if placer.pos != placer.size:
            die(EXIT_MISMATCH, f"{obj} is shorter than its pieces")
    finally:
        placer.close()
    if h.hexdigest() != hexd:
        die(EXIT_MISMATCH, f"{obj} hashes to sha256:{h.hexdigest()}, not sha256:{hexd}")


def finish(part: str, final: str) -> None:
    doc = json.load(sys.stdin)
    for name, size, mode in doc["files"]:
        path = os.path.join(part, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # it ends in a hole that `place` left
            if os.fstat(fd).st_size != size:
                die(EXIT_MISMATCH, f"{path} is {os.fstat(fd).st_size} bytes, not {size}")
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
    write_set_stamp(part, doc["plan"])
    sync_dir(part)
    try:
        os.rename(part, final)
    except OSError as exc:
        # Another restore published the same set first (rename(2) onto a non-empty
        # directory: ENOTEMPTY, or EEXIST): its copy serves when it holds the same bytes.
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not os.path.isdir(final):
            raise
        code, why = check_set(final, doc["plan"])
        if code != 0:
            die(EXIT_MISMATCH, f"{final} was published meanwhile with other bytes: {why}")
        return
    sync_dir(os.path.dirname(final))


def check_set(root: str, plan: list[Any]) -> tuple[int, str]:
    """(0, "") when DIR holds exactly the bytes of `plan`, (1, why) when DIR is absent,
    (4, naming the object) when they differ. Returns rather than exits: the controller's
    survey (the `holdings` mode) checks several sets and other files in one process."""
    if not os.path.isdir(root):
        return EXIT_ABSENT, f"{root} is absent"
    with contextlib.suppress(OSError):
        if read_set_stamp(root) == set_stamp(root, plan):
            return 0, ""
    buf = bytearray(CH)
    mv = memoryview(buf)
    for hexd, size, copies in plan:
        for copy in copies:
            h = hashlib.sha256()
            total = 0
            for name, file_off, _obj_off, length in copy:
                try:
                    with os.fdopen(open_beneath(root, name), "rb") as f:
                        f.seek(file_off)
                        left = length
                        while left:
                            k = f.readinto(mv[:min(CH, left)])
                            if not k:
                                break
                            h.update(mv[:k])
                            left -= k
                            total += k
                except (OSError, Refused) as exc:
                    return EXIT_MISMATCH, f"{name}: {exc}"
            if total != size or h.hexdigest() != hexd:
                return EXIT_MISMATCH, f"the bytes of object sha256:{hexd} differ in {root}"
    write_set_stamp(root, plan)
    return 0, ""


def layers(src: str, dst: str, nbase: int) -> None:
    with tarfile.open(src, "r:") as tin:
        manifest = json.load(tin.extractfile("manifest.json"))  # type: ignore[arg-type]
        if len(manifest) != 1:
            die(EXIT_USAGE, f"{src} holds {len(manifest)} images, not one")
        all_layers = manifest[0]["Layers"]
        if nbase > len(all_layers):
            die(EXIT_USAGE, f"the image has {len(all_layers)} layers, fewer than its "
                            f"base's {nbase}")
        keep = {os.path.dirname(p) for p in all_layers[nbase:]}
        tmp = dst + ".partial"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:") as tout:
            for m in tin.getmembers():
                top = m.name.split("/", 1)[0]
                if ("/" in m.name or m.isdir()) and top not in keep:
                    continue
                if m.issym() or m.islnk():
                    # A layer identical to another one is saved as a link to it, which may
                    # be a base layer left out here: carry the bytes instead.
                    data = tin.extractfile(m)
                    if data is None:
                        die(EXIT_USAGE, f"{src}: dangling link {m.name}")
                    body = data.read()
                    info = tarfile.TarInfo(m.name)
                    info.size, info.mode, info.mtime = len(body), 0o644, m.mtime
                    tout.addfile(info, io.BytesIO(body))
                    continue
                tout.addfile(m, tin.extractfile(m) if m.isfile() else None)
            tout.close()
            publish(raw, tmp, dst)
    h = hashlib.sha256()
    with open(dst, "rb") as f:
        for block in iter(lambda: f.read(CH), b""):
            h.update(block)
    sys.stdout.write(f"{h.hexdigest()} {os.path.getsize(dst)}\n")
