"""What every fault-matrix test asserts after its fault: nothing of the operation left running
on any host, nothing half-written in any host's data_dir or in the store, and a store whose
every object still hashes to its name."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.integration.ops_fixtures import Ops
from tests.integration.test_cancellation import Started, labelled

# Half-written files: a transfer's resumable part, a commit's tar before its rename.
PARTIAL_SUFFIXES = (".coldsnap-part", ".partial")


def half_written(ops: Ops, extra_dirs: tuple[Path, ...] = ()) -> list[str]:
    """Partial files under every host's data_dir (and `extra_dirs`), and capsule files a
    capture left behind."""
    found: list[str] = []
    roots = [Path(h["data_dir"]) for h in ops.hosts.values()] + list(extra_dirs)
    for root in roots:
        if not root.is_dir():
            continue
        for dirpath, _, files in os.walk(root):
            found += [f"{dirpath}/{f}" for f in files if f.endswith(PARTIAL_SUFFIXES)]
        # A capsule tar or replay plan still on its capture host (empty directories are no
        # data; the store holds what a capture keeps).
        found += [str(p) for p in (root / "capsules").rglob("*") if p.is_file()]
    return sorted(found)


def store_problems(store: Path) -> list[str]:
    """Objects that do not hash to their name, indexed artifacts naming a missing object,
    and anything left in the store's tmp."""
    problems: list[str] = []
    objects = store / "objects" / "sha256"
    if objects.is_dir():
        for p in objects.iterdir():
            h = hashlib.sha256()
            with p.open("rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            if h.hexdigest() != p.name:
                problems.append(f"{p} hashes to {h.hexdigest()}")
    artifacts = store / "artifacts"
    if artifacts.is_dir():
        for a in artifacts.glob("*.json"):
            for obj in json.loads(a.read_text())["objects"]:
                if not (objects / obj["sha256"][7:]).is_file():
                    problems.append(f"{a.name} names missing {obj['sha256']}")
    tmp = store / "tmp"
    if tmp.is_dir():
        problems += [f"left in tmp: {p.name}" for p in tmp.iterdir()]
    return problems


def assert_nothing_left(ops: Ops, operation_id: str, *, store: Path | None = None,
                        extra_dirs: tuple[Path, ...] = ()) -> None:
    assert labelled(ops, operation_id) == {}, "containers of the failed operation remain"
    assert half_written(ops, extra_dirs) == []
    assert store_problems(store or ops.store) == []


def failed(run: Any, code_suffix: str, *needles: str) -> str:
    """The failure's receipt message, after checking it: exit 1, a failed receipt whose code
    ends with `code_suffix`, and every needle in the message."""
    assert run.status == 1, run.stderr[-3000:]
    assert run.receipt is not None and run.receipt["state"] == "failed"
    error = run.receipt["error"]
    assert error["code"].endswith(code_suffix), error
    for needle in needles:
        assert needle in error["message"], error["message"]
    assert error["message"] in run.stderr
    message: str = error["message"]
    return message


def finish(started: Started, timeout: float = 400) -> Any:
    """A background operation's outcome, shaped as Ops.coldsnapd's Run."""
    from tests.integration.ops_fixtures import Run

    status, err, receipt = started.finish(timeout)
    return Run(status, "", err, receipt)


@contextmanager
def paused(started: Started) -> Iterator[None]:
    """The operation's process group held still (SIGSTOP) inside the block: the fault lands
    at a known step, whatever the machine's load."""
    started.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        started.signal(signal.SIGCONT)


def operation_id(started: Started) -> str:
    first = json.loads(started.events.read_text().splitlines()[0])
    return str(first["operation_id"])


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f} s")
        time.sleep(0.2)


def mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                    str(where)], check=True)


def resize_tmpfs(where: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True)


def unmount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def in_host_mounts(ops: Ops, host: str, *argv: str) -> str:
    """Run argv in the mount namespace of the host's sshd (`ip netns exec` gave it its own):
    a mount made there is what the host's sessions see, and the root namespace does not."""
    pid = (ops.inventory.parent / host / "ssh" / "sshd.pid").read_text().strip()
    out = subprocess.run(["nsenter", "-t", pid, "-m", *argv], check=True,
                         capture_output=True, text=True)
    return out.stdout


def host_free_bytes(ops: Ops, host: str, where: Path) -> int:
    return int(in_host_mounts(ops, host, "df", "-B1", "--output=avail", str(where))
               .split()[-1])
