"""Real CRIU on plain network namespaces, for the socket tests: the capsule's own Debian rootfs
(criu 4.2.1, python3, libnftables) chrooted, network namespaces joined by a bridge of their own,
processes started in them, dumped and restored there.

The namespaces reach nothing but each other: their bridge lives in a namespace of its own
(the "hub"), so their 198.18.0.0/24 addresses never meet the root namespace's route or another
cluster's. Names carry COLDSNAP_DEV_NET_BASE so that parallel sessions never collide. Every
process started here is recorded and killed on close, with whatever else is left in the
namespaces (they are this world's alone), and the mounts undone."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

STEP_TIMEOUT = 120.0


def net_base() -> int:
    return int(os.environ.get("COLDSNAP_DEV_NET_BASE", "0"))


def _run(argv: Sequence[str], timeout: float = STEP_TIMEOUT,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          check=check)


@contextlib.contextmanager
def capsule_rootfs(base_tar: Path) -> Iterator[Path]:
    """The rootfs unpacked, a mount point of its own (CRIU resolves every file it dumps
    through a mount), with /proc mounted; all undone on exit."""
    top = Path(tempfile.mkdtemp(prefix="coldsnap-criu-root-"))
    root = top / "root"
    mounted: list[Path] = []
    try:
        root.mkdir()
        with tarfile.open(base_tar) as tar:
            tar.extractall(root, filter="fully_trusted")  # our own build's rootfs
        _run(["mount", "--bind", str(root), str(root)])
        mounted.append(root)
        _run(["mount", "-t", "proc", "proc", str(root / "proc")])
        mounted.append(root / "proc")
        (root / "tmp" / "empty").write_bytes(b"")
        yield root
    finally:
        for path in reversed(mounted):
            _run(["umount", "-l", str(path)], check=False)
        shutil.rmtree(top, ignore_errors=True)


@dataclass
class World:
    """Network namespaces on one private bridge, and the processes started in them."""

    root: Path
    prefix: str
    hub: str
    addresses: dict[str, str] = field(default_factory=dict)  # namespace -> its address
    pids: list[int] = field(default_factory=list)  # every process to kill at the end
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)  # ours, by PID

    def ns(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def enter(self, ns: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{ns}", "chroot", str(self.root)]

    def spawn(self, ns: str, argv: Sequence[str], log: str) -> int:
        """Start argv in `ns`, its own session leader, stdin and stdout on files inside the
        rootfs (CRIU dumps descriptors it can find there), no other descriptor inherited."""
        with (open(self.root / "tmp" / "empty", "rb") as stdin,
              open(self.root / log.lstrip("/"), "ab") as out):
            proc = subprocess.Popen([*self.enter(ns), *argv], stdin=stdin, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    close_fds=True)
        self.pids.append(proc.pid)
        self.procs[proc.pid] = proc
        return proc.pid

    def gone(self, pids: Sequence[int], timeout: float = 30.0) -> None:
        """Until none of `pids` exists (a restore needs every PID free), each reaped: by its
        Popen if this world started it, else as a child adopted from a restore."""
        deadline = time.monotonic() + timeout
        for pid in pids:
            proc = self.procs.pop(pid, None)
            if proc is not None:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                continue
            while True:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"process {pid} still exists")
                time.sleep(0.05)

    def run(self, ns: str, argv: Sequence[str], timeout: float = STEP_TIMEOUT,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run([*self.enter(ns), *argv], timeout=timeout, check=check)

    def criu(self, ns: str, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return self.run(ns, ["criu", *args], check=False)

    def log(self, path: str) -> str:
        return (self.root / path.lstrip("/")).read_text(errors="replace")

    def ns_pids(self, ns: str) -> list[int]:
        res = _run(["ip", "netns", "pids", ns], check=False)
        return [int(p) for p in res.stdout.split()]


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def world(root: Path, names: Sequence[str], tag: str) -> Iterator[World]:
    """Namespaces `names`, each with one address on a shared private bridge."""
    base = net_base()
    prefix = f"csd-{tag}{base}-"
    w = World(root, prefix, f"{prefix}hub")
    made: list[str] = []
    try:
        for ns in [w.hub, *(w.ns(n) for n in names)]:
            _run(["ip", "netns", "del", ns], check=False)  # left by a killed earlier run
            _run(["ip", "netns", "add", ns])
            made.append(ns)
        hub = ["ip", "-n", w.hub]
        _run([*hub, "link", "add", "br0", "type", "bridge"])
        _run([*hub, "link", "set", "br0", "up"])
        for i, name in enumerate(names):
            ns, port, address = w.ns(name), f"p{i}", f"198.18.0.{i + 2}"
            _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name",
                  port, "netns", w.hub])
            _run([*hub, "link", "set", port, "master", "br0"])
            _run([*hub, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            w.addresses[ns] = address
        yield w
    finally:
        left = list(w.pids)
        for ns in made:
            left += w.ns_pids(ns)
        _kill(left)
        with contextlib.suppress(TimeoutError, subprocess.TimeoutExpired):
            w.gone(sorted(set(left)), timeout=10)
        for ns in made:
            _run(["ip", "netns", "del", ns], check=False)
