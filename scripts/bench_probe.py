"""Fan-out cost: `hosts probe` of 1 host vs 16 hosts (fresh connections each time).

    scripts/bench probe [--hosts 16] [--rounds 5] [--inventory FILE] [--keep]

Without --inventory it starts its own cluster of --hosts simulated hosts without Docker
(scripts/dev-cluster, state in .cache/bench-cluster, network slots from 128 on, i.e. hosts on
198.18.0.130 and up, and sshd on port 2222, so it can run next to the shared dev cluster) and
stops it afterwards unless --keep. Target: ratio <= 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time
from pathlib import Path

from bench_common import REPO, emit, log

from coldsnap.hosts.inventory import Inventory, load_inventory
from coldsnap.hosts.pool import HostPool
from coldsnap.hosts.probe import probe_pool

BENCH_DIR = REPO / ".cache" / "bench-cluster"
BENCH_PORT = "2222"
# host-N of the bench cluster is network slot 128 + N (namespace csd-host-{128+N}, address
# 198.18.0.{130+N}): clear of the shared dev cluster's slots 0, 1, 2, ...
BENCH_NET_BASE = "128"


def cluster(*args: str) -> str:
    env = dict(
        os.environ,
        COLDSNAP_DEV_CLUSTER_DIR=str(BENCH_DIR),
        COLDSNAP_DEV_SSH_PORT=BENCH_PORT,
        COLDSNAP_DEV_NET_BASE=BENCH_NET_BASE,
    )
    r = subprocess.run(
        [str(REPO / "scripts" / "dev-cluster"), *args],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""


async def probe(inventory: Inventory, names: list[str], *, warm: bool = False) -> float:
    """Seconds to probe `names`: from nothing (CLI) or, warm, over open connections (the
    daemon's pool keeps them)."""
    async with HostPool(inventory) as pool:
        if warm:
            await asyncio.gather(*(h.connect() for h in pool.hosts(names)))
        t0 = time.perf_counter()
        facts = await probe_pool(pool, names)
        elapsed = time.perf_counter() - t0
    bad = [f.host for f in facts if not f.reachable or f.error]
    if bad:
        raise SystemExit(f"probe failed on {bad}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inventory", type=Path)
    ap.add_argument("--keep", action="store_true", help="leave the bench cluster running")
    args = ap.parse_args()

    own = args.inventory is None
    path = Path(cluster("up", str(args.hosts), "--no-docker")) if own else args.inventory
    try:
        inventory = load_inventory(path)
        if len(inventory.hosts) < args.hosts:
            raise SystemExit(f"{path} has {len(inventory.hosts)} hosts, need {args.hosts}")
        names = inventory.names[: args.hosts]
        asyncio.run(probe(inventory, names))  # warm-up: page cache, python3 on the hosts
        one: list[float] = []
        many: list[float] = []
        serial: list[float] = []
        warm_one: list[float] = []
        warm_many: list[float] = []
        for r in range(args.rounds):
            # For scale: the same hosts probed one after the other.
            t0 = time.perf_counter()
            for name in names:
                asyncio.run(probe(inventory, [name]))
            serial.append(time.perf_counter() - t0)
            for kind in ("one", "many") if r % 2 == 0 else ("many", "one"):
                t = asyncio.run(probe(inventory, names[:1] if kind == "one" else names))
                (one if kind == "one" else many).append(t)
                log(f"round {r + 1}/{args.rounds} {kind:<4} {t:6.3f} s")
            warm_one.append(asyncio.run(probe(inventory, names[:1], warm=True)))
            warm_many.append(asyncio.run(probe(inventory, names, warm=True)))
    finally:
        if own and not args.keep:
            cluster("down")
    t1, tn = statistics.median(one), statistics.median(many)
    emit(
        "probe",
        {
            "hosts": args.hosts,
            "rounds": args.rounds,
            "one_host_seconds": round(t1, 3),
            "many_hosts_seconds": round(tn, 3),
            "ratio": round(tn / t1, 3),
            "target_ratio_max": 2.0,
            "serial_seconds": round(statistics.median(serial), 3),
        "warm_one_host_seconds": round(statistics.median(warm_one), 3),
        "warm_many_hosts_seconds": round(statistics.median(warm_many), 3),
        "warm_ratio": round(statistics.median(warm_many) / statistics.median(warm_one), 3),
            "cpus": os.cpu_count(),
            "samples": {"one": [round(x, 3) for x in one], "many": [round(x, 3) for x in many]},
        },
    )


if __name__ == "__main__":
    main()
