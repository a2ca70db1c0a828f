"""`scripts/dev-cluster down --purge`: after `down`, every file the cluster wrote goes too.

All of it lies under the cluster's state directory (keys, each host's data_dir and Docker
image store, the registry's storage, the test capsule's build cache, requests, models,
artifacts); what `up` wrote elsewhere (the namespace owner records under /run) `down`
removes already. The vLLM capsule's rootfs cache, keyed by its recipe and kept outside the
clone (devtools/vllm_capsule.py), stays: it is what makes the next cluster's build fast.

A dockerd killed hard can leave its overlay and shm mounts under its data-root: they are
unmounted first, deepest first, so that the removal never walks into a mounted filesystem
(rmtree refuses to cross into one rather than empty it).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from devtools import net

# A directory `up` made has these; anything else is not removed on its say-so.
MARKERS = ("net-base", "client")


class PurgeError(RuntimeError):
    """The state directory cannot be purged; nothing was removed."""


def _unescape(field: str) -> str:
    # /proc/self/mountinfo writes space, tab, newline and backslash as octal escapes.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_under(root: Path, mountinfo: str | None = None) -> list[Path]:
    """The mount points at or below `root`, deepest first."""
    text = Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo
    points = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) > 4:
            point = Path(_unescape(fields[4]))
            if point == root or root in point.parents:
                points.append(point)
    return sorted(set(points), key=lambda p: len(p.parts), reverse=True)


def check_markers(state: Path) -> None:
    """PurgeError unless `state` is absent or a directory that `up` made."""
    if not state.exists():
        return
    missing = [m for m in MARKERS if not (state / m).exists()]
    if missing or not state.is_dir():
        raise PurgeError(f"{state} does not look like a dev cluster's state directory (no "
                         f"{', '.join(missing) or 'directory'}): not removing it")


def check_purgeable(state: Path) -> None:
    check_markers(state)
    if not state.exists():
        return
    held = net.owned_namespaces(state)
    if held:
        raise PurgeError(f"the cluster in {state} still holds namespaces ({', '.join(held)}): "
                         "`down` did not finish; nothing removed")


def purge(state: Path) -> int:
    """Remove the state directory; returns the bytes it held."""
    check_purgeable(state)
    if not state.is_dir():
        return 0
    for point in mounts_under(state):
        if subprocess.run(["umount", str(point)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", str(point)], capture_output=True, check=True)
    du = subprocess.run(["du", "-sxb", str(state)], capture_output=True, text=True, check=False)
    size = int(du.stdout.split()[0]) if du.returncode == 0 and du.stdout else 0
    shutil.rmtree(state)
    return size


__all__ = ["MARKERS", "PurgeError", "check_markers", "check_purgeable", "mounts_under", "purge"]
