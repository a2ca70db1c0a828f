"""seed: copy a staged runtime cache (policy.cache.staged) into a unit's cache directory before
its engine starts, and say what was copied.

The source is a directory the request names on the host; the destination the host side of the
container's cache volume. Nothing in the source is followed out of it: directories are walked
without following symlinks, every file is opened with O_NOFOLLOW, and a symlink is copied as
a symlink (its target is the engine's to resolve inside its container, as it was for whoever
staged it). Other kinds of file (sockets, devices, FIFOs) are left out.

The answer is JSON {"files", "bytes", "digest"}: the regular files copied, their bytes, and
`sha256:` of the listing "PATH\\0MODE\\0SIZE\\0SHA256\\n" of each regular file and
"PATH\\0link\\0TARGET\\n" of each symlink, sorted by path (so the same tree gives the same
digest wherever it is staged).

A part of the helper program (see `coldsnap.hosts.helper`): Python 3.8, standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys

from coldsnap.hosts.helper.common import CH, EXIT_REFUSED, die


def _copy_file(src: str, dst: str, mv: memoryview) -> tuple[int, str, int]:
    """(size, hex sha256, mode) of the regular file `src`, copied to `dst`."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            die(EXIT_REFUSED, "not a regular file: " + src)
        mode = stat.S_IMODE(st.st_mode)
        h = hashlib.sha256()
        size = 0
        if os.path.lexists(dst) and not os.path.isfile(dst):
            die(EXIT_REFUSED, "the cache already holds something else at " + dst)
        with open(dst, "wb") as out:
            while True:
                n = os.readv(fd, [mv])
                if n == 0:
                    break
                h.update(mv[:n])
                out.write(mv[:n])
                size += n
        os.chmod(dst, mode)
        return size, h.hexdigest(), mode
    finally:
        os.close(fd)


def seed(src: str, dst: str) -> None:
    if not os.path.isdir(src) or os.path.islink(src):
        die(EXIT_REFUSED, "not a directory: " + src)
    if not os.access(src, os.R_OK | os.X_OK):
        die(EXIT_REFUSED, "not readable: " + src)
    os.makedirs(dst, exist_ok=True)
    mv = memoryview(bytearray(CH))
    listing = []
    files = total = 0

    def refused(exc: OSError) -> None:
        die(EXIT_REFUSED, f"cannot read {exc.filename}: {exc.strerror}")

    try:
        for root, dirs, names in os.walk(src, onerror=refused, followlinks=False):
            rel_root = os.path.relpath(root, src)
            out_root = dst if rel_root == "." else os.path.join(dst, rel_root)
            for d in sorted(dirs):
                path = os.path.join(root, d)
                if os.path.islink(path):
                    names.append(d)  # copied as the symlink it is, below
                    continue
                os.makedirs(os.path.join(out_root, d), exist_ok=True)
                os.chmod(os.path.join(out_root, d), stat.S_IMODE(os.lstat(path).st_mode))
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
            for name in sorted(names):
                path = os.path.join(root, name)
                rel = name if rel_root == "." else os.path.join(rel_root, name)
                target = os.path.join(out_root, name)
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    link = os.readlink(path)
                    if os.path.lexists(target):
                        os.unlink(target)
                    os.symlink(link, target)
                    listing.append(rel + "\0link\0" + link + "\n")
                elif stat.S_ISREG(st.st_mode):
                    size, hexdigest, mode = _copy_file(path, target, mv)
                    listing.append(f"{rel}\0{mode:o}\0{size}\0{hexdigest}\n")
                    files += 1
                    total += size
    except OSError as exc:
        refused(exc)
    digest = hashlib.sha256("".join(sorted(listing)).encode("utf-8", "surrogateescape"))
    sys.stdout.write(json.dumps({"files": files, "bytes": total,
                                 "digest": "sha256:" + digest.hexdigest()}))
