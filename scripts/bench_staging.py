"""Staging throughput: coldsnapd's transfer vs scp, same file, same host, rounds alternating.

    scripts/bench staging [--inventory FILE] [--host NAME] [--size-mib 1024] [--rounds 5]
    scripts/bench staging --link [...]   every staging path beside the raw floors of the same
                                         bytes (scripts/staging_link.py; --link --help)

Without --inventory it runs against the dev cluster; when that is not running it starts one
without Docker (enough hosts for --host) and stops it again at the end.

Both sides include their connection setup (a fresh SSH connection per round), so the ratio
is what a user sees. coldsnapd verifies the sha256 on the far side; scp verifies nothing.
`scp_seconds` uses scp's default cipher; `scp_aes128gcm_seconds` forces the cipher coldsnapd
prefers, for a like-for-like view of the transport itself.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import REPO, cluster_inventory, emit, log, sized

from coldsnap.hosts.inventory import HostEntry, load_inventory
from coldsnap.hosts.ssh import SSHHost
from coldsnap.hosts.transfer.driver import Transport, put_file


def make_source(size: int) -> Path:
    cache = REPO / ".cache" / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"staging-{size}.bin"
    if not path.exists() or path.stat().st_size != size:
        log(f"writing {size} random bytes to {path}")
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            left = size
            while left:
                n = min(left, 16 * 1024 * 1024)
                f.write(os.urandom(n))
                left -= n
        tmp.replace(path)
    return path


async def coldsnapd_put(
    entry: HostEntry, src: Path, dest: str, transport: Transport
) -> tuple[float, str]:
    t0 = time.perf_counter()
    host = SSHHost(entry)
    try:
        result = await put_file(host, src, dest, transport=transport)
    finally:
        await host.close()
    return time.perf_counter() - t0, result.sha256


def scp_put(entry: HostEntry, src: Path, dest: str, cipher: str | None) -> float:
    argv = [
        "scp",
        "-q",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={entry.known_hosts}",
        "-P",
        str(entry.port),
    ]
    if entry.identity_file:
        argv += ["-i", str(entry.identity_file)]
    if cipher:
        argv += ["-c", cipher]
    argv += [str(src), f"{entry.user}@{entry.address}:{dest}"]
    t0 = time.perf_counter()
    subprocess.run(argv, check=True)
    return time.perf_counter() - t0


def rm(entry: HostEntry, path: str) -> None:
    # The hosts of the dev cluster are local directories; a real host would need ssh.
    Path(path).unlink(missing_ok=True)
    del entry


def run_rounds(args: argparse.Namespace, entry: HostEntry) -> dict[str, list[float]]:
    size = args.size_mib * 1024 * 1024
    src = make_source(size)
    want = "sha256:" + hashlib.sha256(src.read_bytes()).hexdigest()
    dest_c = f"{entry.data_dir}/bench-staging-coldsnapd.bin"
    dest_s = f"{entry.data_dir}/bench-staging-scp.bin"
    # The dev cluster's hosts keep their data_dir on this machine.
    local_dev = entry.simulated

    times: dict[str, list[float]] = {"coldsnapd": [], "scp": [], "scp_aes": []}
    for r in range(args.rounds):
        order = ["coldsnapd", "scp", "scp_aes"]
        if r % 2:
            order.reverse()
        for kind in order:
            if kind == "scp_aes" and args.no_scp_aes:
                continue
            if local_dev:
                rm(entry, dest_c)
                rm(entry, dest_s)
            subprocess.run(["sync"], check=False)
            if kind == "coldsnapd":
                t, digest = asyncio.run(coldsnapd_put(entry, src, dest_c, args.transport))
                if digest != want:
                    raise SystemExit(f"digest mismatch: {digest} != {want}")
            else:
                t = scp_put(
                    entry, src, dest_s, "aes128-gcm@openssh.com" if kind == "scp_aes" else None
                )
            times[kind].append(t)
            log(
                f"round {r + 1}/{args.rounds} {kind:<10} {t:6.2f} s ({size / t / 2**20:6.0f} MiB/s)"
            )
    if local_dev:
        rm(entry, dest_c)
        rm(entry, dest_s)

    return times


def main() -> None:
    if "--link" in sys.argv[1:]:
        from staging_link import main as link

        link([a for a in sys.argv[1:] if a != "--link"])
        return
    ap = argparse.ArgumentParser(
        prog="scripts/bench staging",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--inventory",
        type=Path,
        help="hosts to use as they are (default: the dev cluster, started when not running)",
    )
    ap.add_argument("--host", default="host-0")
    ap.add_argument("--size-mib", type=int, default=sized(1024, 4))
    ap.add_argument("--rounds", type=int, default=sized(5, 1))
    ap.add_argument("--no-scp-aes", action="store_true", help="skip the scp -c aes128-gcm runs")
    ap.add_argument(
        "--transport",
        choices=["auto", "openssh", "asyncssh"],
        default="auto",
        help="coldsnapd's data path for put (default: what coldsnapd uses)",
    )
    args = ap.parse_args()

    with cluster_inventory(args.inventory, [args.host], docker=False) as inventory:
        times = run_rounds(args, load_inventory(inventory).get(args.host))
    size = args.size_mib * 1024 * 1024
    c = statistics.median(times["coldsnapd"])
    s = statistics.median(times["scp"])
    doc = {
        "host": args.host,
        "transport": args.transport,
        "bytes": size,
        "rounds": args.rounds,
        "coldsnapd_seconds": round(c, 3),
        "scp_seconds": round(s, 3),
        "ratio": round(c / s, 3),
        "target_ratio_max": 1.0,
    }
    if times["scp_aes"]:
        doc["scp_aes128gcm_seconds"] = round(statistics.median(times["scp_aes"]), 3)
    doc["samples"] = {k: [round(x, 3) for x in v] for k, v in times.items() if v}
    emit("staging", doc)


if __name__ == "__main__":
    main()
