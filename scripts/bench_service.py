"""Benchmark of `coldsnapd serve` on the dev cluster (4 hosts, the test capsule):

- concurrency: a TP2 capture on host-0/host-1 and one on host-2/host-3, each alone, then both
  submitted at once through the service: disjoint jobs should cost about one job's time;
- submission overhead: the same `restore --prepare-only` (staging already warm) through the
  service and with `--local`, median of `--repeat` runs each.

    scripts/bench service [--shard-bytes N] [--repeat N]

Prints one JSON line and appends it to bench-results/service.jsonl.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from bench_common import REPO, emit, log, sized

from devtools.served import Served  # bench_common put the repository on the path

# The dev cluster's state, as scripts/dev-cluster has it (COLDSNAP_DEV_CLUSTER_DIR).
DEV = Path(os.environ.get("COLDSNAP_DEV_CLUSTER_DIR") or REPO / ".dev-cluster")


def _capture_request(work: Path, tag: str, moved: bool) -> Path:
    doc = yaml.safe_load((DEV / "requests" / "tp2-two-hosts.yaml").read_text())
    if moved:
        doc["launch"] = yaml.safe_load(
            (DEV / "requests" / "tp2-two-hosts-restore-moved.yaml").read_text())["launch"]
    doc["id"] = f"bench-{tag}"
    doc["output"] = str(work / f"bench-{tag}.json")
    path = work / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _cli(served: Served, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "coldsnap", *args, "--socket", str(served.socket),
         "--inventory", str(served.inventory), "--store", str(served.store)],
        cwd=REPO, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(REPO)))


def _timed(served: Served, *runs: tuple[str, ...]) -> float:
    started = time.monotonic()
    procs = [_cli(served, *args) for args in runs]
    for p, args in zip(procs, runs, strict=True):
        _, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"bench: coldsnapd {' '.join(args)} exited {p.returncode}:\n"
                             f"{err[-3000:]}")
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The smoke size is what scripts/test has dev-requests write (8 MiB): the benchmark
    # rewrites the cluster's requests, which the test suite shares.
    parser.add_argument("--shard-bytes", type=int, default=sized(256 << 20, 8 << 20),
                        help="weight bytes per worker (default 256 MiB)")
    parser.add_argument("--repeat", type=int, default=sized(3, 1))
    args = parser.parse_args()
    if not (DEV / "inventory.yaml").is_file() or not (DEV / "test-capsule.ref").is_file():
        raise SystemExit("bench: start the dev cluster (scripts/dev-cluster up 4) and build "
                         "the test capsule (scripts/build-test-capsule) first")
    subprocess.run([sys.executable, str(REPO / "scripts" / "dev-requests"), "--shard-bytes",
                    str(args.shard_bytes)], check=True, stdout=subprocess.DEVNULL)
    tag = secrets.token_hex(3)
    with tempfile.TemporaryDirectory(prefix="coldsnap-bench-service-") as tmp:
        work = Path(tmp)
        served = Served(work, DEV / "inventory.yaml", work / "store")
        try:
            served.start()
            log("bench service: captures alone")
            alone_a = _timed(served, ("capture", "--request",
                                      str(_capture_request(work, f"{tag}-a1", False))))
            alone_b = _timed(served, ("capture", "--request",
                                      str(_capture_request(work, f"{tag}-b1", True))))
            log("bench service: both at once")
            together = _timed(
                served,
                ("capture", "--request", str(_capture_request(work, f"{tag}-a2", False))),
                ("capture", "--request", str(_capture_request(work, f"{tag}-b2", True))))
            log("bench service: prepare-only restores, service and --local")
            prepare = ("restore", "--artifact", f"bench-{tag}-a1", "--prepare-only")
            _timed(served, prepare)  # stages once; the runs below find every object there
            via_service = [_timed(served, prepare) for _ in range(args.repeat)]
            local = [_timed(served, (*prepare, "--local")) for _ in range(args.repeat)]
        finally:
            served.stop()
            served.close()
    doc: dict[str, Any] = {
        "shard_bytes": args.shard_bytes,
        "capture_alone_host01_s": round(alone_a, 2),
        "capture_alone_host23_s": round(alone_b, 2),
        "captures_disjoint_together_s": round(together, 2),
        "concurrency_ratio": round(together / max(alone_a, alone_b), 2),
        "prepare_only_via_service_median_s": round(statistics.median(via_service), 2),
        "prepare_only_local_median_s": round(statistics.median(local), 2),
        "repeat": args.repeat,
    }
    emit("service", doc)


if __name__ == "__main__":
    main()
