"""Fan-out cost: `hosts probe` of 1 host vs 16 hosts (fresh connections each time), and of
16 hosts against 16 OpenSSH clients run side by side with the same probe command.

    scripts/bench probe [--hosts 16] [--rounds 5] [--inventory FILE] [--keep]

Without --inventory it starts its own cluster of --hosts simulated hosts without Docker
(scripts/dev-cluster, state in .cache/bench-cluster, network slots from 128 on, i.e. hosts on
198.18.0.130 and up, and sshd on port 2222, so it can run next to the shared dev cluster) and
stops it afterwards unless --keep. Targets: many/one ratio <= 2; coldsnapd/OpenSSH <= 1.0
(wall time; the CPU time each spends on this machine is reported beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shlex
import statistics
import subprocess
import time
from pathlib import Path

from bench_common import REPO, emit, log, sized

from coldsnap.hosts.inventory import Inventory, load_inventory
from coldsnap.hosts.pool import HostPool
from coldsnap.hosts.probe import probe_command, probe_pool
from coldsnap.hosts.settings import SSHSettings
from coldsnap.hosts.transfer.openssh_client import openssh_argv

BENCH_DIR = REPO / ".cache" / "bench-cluster"
BENCH_PORT = "2222"
# host-N of the bench cluster is network slot 128 + N (namespace csd-host-{128+N}, address
# 198.18.0.{130+N}): clear of the shared dev cluster's slots 0, 1, 2, ...; another base
# (COLDSNAP_BENCH_NET_BASE, as bench restore and fanout) lets two runs go at once.
BENCH_NET_BASE = os.environ.get("COLDSNAP_BENCH_NET_BASE", "128")


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


def probe_cpu(inventory: Inventory, names: list[str]) -> tuple[float, float]:
    """(wall, CPU seconds of this process) of one `probe` from nothing."""
    cpu = time.process_time()
    wall = asyncio.run(probe(inventory, names))
    return wall, time.process_time() - cpu


# The key exchange asyncssh settles on with these sshds (OpenSSH 9.2 offers no ML-KEM, and
# asyncssh has no sntrup761 without liboqs): OpenSSH's own default, sntrup761x25519, costs
# about 0.2 s more per connection here, so OpenSSH is measured both ways.
SAME_KEX = "curve25519-sha256"


def openssh(inventory: Inventory, names: list[str],
            kex: str | None = None) -> tuple[float, float]:
    """(wall, CPU seconds of the ssh clients) of one OpenSSH client per host, all at once,
    each running the same probe command as `hosts probe` over a fresh connection."""
    argvs = []
    for name in names:
        entry = inventory.get(name)
        base = openssh_argv(entry, SSHSettings())
        if base is None:
            raise SystemExit("bench probe: no OpenSSH client (scripts/setup installs it)")
        if kex is not None:
            base = [base[0], "-o", f"KexAlgorithms={kex}", *base[1:]]
        argvs.append([*base, shlex.join(probe_command(entry))])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    procs = [subprocess.Popen(a, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for a in argvs]
    outs = [p.communicate(timeout=120) for p in procs]
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    bad = [n for n, p, (out, _) in zip(names, procs, outs, strict=True)
           if p.returncode != 0 or b"@@arch " not in out]
    if bad:
        raise SystemExit(f"OpenSSH probe failed on {bad}: {outs[0][1][-500:]!r}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=sized(16, 2))
    ap.add_argument("--rounds", type=int, default=sized(5, 1))
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
        ours: list[tuple[float, float]] = []
        theirs: list[tuple[float, float]] = []
        theirs_default: list[tuple[float, float]] = []
        for r in range(args.rounds):
            # Side by side, in rotating order: coldsnapd vs one OpenSSH client per host.
            kinds = ["ours", "openssh", "openssh-default"]
            for kind in kinds[r % 3:] + kinds[:r % 3]:
                if kind == "ours":
                    ours.append(probe_cpu(inventory, names))
                elif kind == "openssh":
                    theirs.append(openssh(inventory, names, SAME_KEX))
                else:
                    theirs_default.append(openssh(inventory, names))
            log(f"round {r + 1}/{args.rounds} coldsnapd {ours[-1][0]:6.3f} s, "
                f"OpenSSH x{len(names)} {theirs[-1][0]:6.3f} s ({SAME_KEX}), "
                f"{theirs_default[-1][0]:6.3f} s (its default key exchange)")
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
    ours_wall = statistics.median(w for w, _ in ours)
    theirs_wall = statistics.median(w for w, _ in theirs)
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
            "coldsnapd_seconds": round(ours_wall, 3),
            "openssh_parallel_seconds": round(theirs_wall, 3),
            "openssh_kex": SAME_KEX,
            "openssh_default_kex_parallel_seconds": round(
                statistics.median(w for w, _ in theirs_default), 3),
            "vs_openssh_ratio": round(ours_wall / theirs_wall, 3),
            "target_vs_openssh_max": 1.0,
            "coldsnapd_cpu_seconds": round(statistics.median(c for _, c in ours), 3),
            "openssh_clients_cpu_seconds": round(statistics.median(c for _, c in theirs), 3),
            "warm_one_host_seconds": round(statistics.median(warm_one), 3),
            "warm_many_hosts_seconds": round(statistics.median(warm_many), 3),
            "warm_ratio": round(statistics.median(warm_many) / statistics.median(warm_one), 3),
            "cpus": os.cpu_count(),
            "samples": {"one": [round(x, 3) for x in one], "many": [round(x, 3) for x in many]},
        },
    )


if __name__ == "__main__":
    main()
