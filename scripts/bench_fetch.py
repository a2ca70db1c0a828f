"""Fetch throughput: coldsnapd's get vs scp, from several hosts side by side, as a capture's
fetch phase pulls its units' objects; rounds alternate between the three.

    scripts/bench fetch [--inventory FILE] [--host NAME]... [--size-mib 1024] [--rounds 3]

Without --inventory it runs against the dev cluster (hosts host-0 and host-1 unless --host
says otherwise); when that is not running it starts one without Docker and stops it again.

  asyncssh_seconds   get over the pooled asyncssh connection, the far side hashing (the
                     path every get took before the OpenSSH one)
  openssh_seconds    get as a capture makes it: through the OpenSSH client, with the digest
                     known (`expected`), so that the host only reads
  scp_seconds        scp of the same files to the same place

Each includes its connection setup. coldsnapd hashes what arrives and fsyncs it before the
rename; scp does neither. The file is made once on each host and hashed there, as a
capture's collect does.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench_common import REPO, cluster_inventory, emit, log, sized

from coldsnap.hosts.inventory import HostEntry, load_inventory
from coldsnap.hosts.ssh import SSHHost
from coldsnap.hosts.transfer.driver import fetch_file
from coldsnap.hosts.transfer.protocol import remote_file_digest

DEST = REPO / ".cache" / "bench" / "fetch"


async def make_sources(entries: list[HostEntry], size: int) -> dict[str, tuple[str, str]]:
    """Per host: (path of a file of `size` random bytes in its data_dir, its digest)."""
    out = {}
    for e in entries:
        path = f"{e.data_dir}/bench-fetch-{size}.bin"
        host = SSHHost(e)
        try:
            await host.run(["sh", "-c", f'[ "$(stat -c %s "$1" 2>/dev/null)" = {size} ] || '
                            f'head -c {size} /dev/urandom > "$1"', "sh", path], timeout=900)
            found = await remote_file_digest(host, path, timeout=900)
        finally:
            await host.close()
        assert found is not None
        out[e.name] = (path, found[1])
    return out


async def coldsnapd_get(e: HostEntry, remote: str, digest: str, how: str) -> None:
    host = SSHHost(e)
    local = DEST / f"{e.name}.bin"
    try:
        if how == "asyncssh":
            got = await fetch_file(host, remote, local, transport="asyncssh")
        else:
            got = await fetch_file(host, remote, local, transport="openssh", expected=digest)
    finally:
        await host.close()
    if got.sha256 != digest:
        raise SystemExit(f"bench fetch: {e.name}:{remote} arrived as {got.sha256}")


def scp_get(e: HostEntry, remote: str) -> None:
    argv = ["scp", "-q", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={e.known_hosts}", "-P", str(e.port)]
    if e.identity_file:
        argv += ["-i", str(e.identity_file)]
    subprocess.run([*argv, f"{e.user}@{e.address}:{remote}", str(DEST / f"{e.name}.bin")],
                   check=True)


async def side_by_side(calls: list[Callable[[], Awaitable[None]]]) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*(c() for c in calls))
    elapsed = time.perf_counter() - t0
    for f in DEST.glob("*"):
        f.unlink()
    return elapsed


async def measure(entries: list[HostEntry], size: int, rounds: int) -> dict[str, object]:
    sources = await make_sources(entries, size)
    DEST.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[float]] = {"asyncssh": [], "openssh": [], "scp": []}

    def calls(how: str) -> list[Callable[[], Awaitable[None]]]:
        if how == "scp":
            return [lambda e=e: asyncio.to_thread(scp_get, e, sources[e.name][0])
                    for e in entries]
        return [lambda e=e: coldsnapd_get(e, *sources[e.name], how) for e in entries]

    for i in range(rounds):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for how in order:
            runs[how].append(round(await side_by_side(calls(how)), 3))
            log(f"round {i + 1}: {how} {runs[how][-1]} s")
    med = {how: statistics.median(v) for how, v in runs.items()}
    return {
        "hosts": [e.name for e in entries],
        "mib_per_host": size >> 20,
        "rounds": rounds,
        "asyncssh_seconds": med["asyncssh"],
        "openssh_seconds": med["openssh"],
        "scp_seconds": med["scp"],
        "ratios": {"asyncssh_vs_scp": round(med["asyncssh"] / med["scp"], 3),
                   "openssh_vs_scp": round(med["openssh"] / med["scp"], 3)},
        "runs": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inventory", type=Path)
    ap.add_argument("--host", action="append", dest="hosts")
    ap.add_argument("--size-mib", type=int, default=sized(1024, 4))
    ap.add_argument("--rounds", type=int, default=sized(3, 1))
    args = ap.parse_args()
    names = args.hosts or ["host-0", "host-1"]
    with cluster_inventory(args.inventory, names, docker=False) as path:
        inventory = load_inventory(path)
        entries = [inventory.get(n) for n in names]
        figures = asyncio.run(measure(entries, args.size_mib << 20, args.rounds))
    emit("fetch", figures)


if __name__ == "__main__":
    main()
