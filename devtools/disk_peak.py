"""The disk a run of scripts/test uses: sampled in the background while it runs, summed up at
its end.

    python -m devtools.disk_peak sample STATE OUT [--every S]   until SIGTERM
    python -m devtools.disk_peak report OUT STATE              one line for the run's end

`sample` records, every S seconds (default 10), the bytes under the cluster's state
directory STATE (`du -sxb`: one filesystem, so a container's mounted rootfs is not counted
again) and the free bytes of the filesystem that holds it, keeping the first sample, the
largest state and the smallest free space in OUT (JSON, replaced whole each time). The free
space also sees what the suite writes elsewhere (its stores and receipts under /tmp, the
capsule caches outside the clone) and what other processes on the machine write meanwhile.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any


def state_bytes(state: Path) -> int:
    if not state.exists():
        return 0
    r = subprocess.run(["du", "-sxb", str(state)], capture_output=True, text=True,
                       timeout=600, check=False)
    first = r.stdout.split()[:1]  # du still prints a total when a file vanished under it
    return int(first[0]) if first and first[0].isdigit() else 0


def free_bytes(state: Path) -> int:
    path = state
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def fold(record: dict[str, Any] | None, state: int, free: int) -> dict[str, Any]:
    """The record with one more sample."""
    if record is None:
        return {"start_state_bytes": state, "start_free_bytes": free, "peak_state_bytes": state,
                "min_free_bytes": free, "last_state_bytes": state, "last_free_bytes": free,
                "samples": 1}
    return {**record, "peak_state_bytes": max(record["peak_state_bytes"], state),
            "min_free_bytes": min(record["min_free_bytes"], free), "last_state_bytes": state,
            "last_free_bytes": free, "samples": record["samples"] + 1}


def write(out: Path, record: dict[str, Any]) -> None:
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(record, sort_keys=True) + "\n")
    tmp.replace(out)


def sample(state: Path, out: Path, every: float) -> int:
    stop = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    record: dict[str, Any] | None = None
    while True:
        record = fold(record, state_bytes(state), free_bytes(state))
        write(out, record)
        deadline = time.monotonic() + every
        while not stop and time.monotonic() < deadline:
            time.sleep(0.2)
        if stop:
            return 0


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def report(record: dict[str, Any], state: int, free: int) -> str:
    """The run's disk in one line: its peak, and what it left (`state`, `free`: now)."""
    used = record["start_free_bytes"] - record["min_free_bytes"]
    left = record["start_free_bytes"] - free
    return (f"disk: the dev cluster's state peaked at {gb(record['peak_state_bytes'])}; the "
            f"filesystem's free space fell by up to {gb(used)} "
            f"({gb(record['start_free_bytes'])} free at the start, {gb(record['min_free_bytes'])} "
            f"at the lowest); left behind: {gb(state)} of cluster state, "
            f"{gb(left)} less free than at the start")


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "sample":
        every = float(argv[4]) if len(argv) == 5 and argv[3] == "--every" else 10.0
        return sample(Path(argv[1]), Path(argv[2]), every)
    if len(argv) == 3 and argv[0] == "report":
        out, state = Path(argv[1]), Path(argv[2])
        try:
            record = json.loads(out.read_text())
        except (OSError, ValueError) as exc:
            print(f"disk: no samples ({exc})", file=sys.stderr)
            return 1
        print(report(record, state_bytes(state), free_bytes(state)))
        return 0
    print((__doc__ or "").split("\n\n")[1], file=sys.stderr)
    return 2


__all__ = ["fold", "free_bytes", "main", "report", "sample", "state_bytes"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

