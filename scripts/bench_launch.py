#!/usr/bin/env python3
"""What starting the engine confined costs: `capsule-init launch` in a fresh capsule container
(PIDs above the floor by short-lived threads, then an empty bounding set, no-new-privs and the
engine's seccomp filter), against the same PID advance done by forking, as a launcher without
threads would.

    scripts/bench launch [--inventory FILE] [--host host-0] [--repeat 3]

Runs on the host's dockerd with the test capsule (scripts/build-test-capsule). Each figure is
the wall time of one `docker exec`, median of --repeat fresh containers.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import yaml
from bench_common import cluster_inventory, emit, log, sized

from coldsnap.capsule.seccomp import engine_filter_b64
from coldsnap.capsule.spec import CRIU_CAPABILITIES, CRIU_SECURITY_OPT, ENGINE_PID_FLOOR

_FORK_BURN = f"""import os
while True:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    if pid > {ENGINE_PID_FLOOR}:
        break
"""


def _docker(sock: str, *args: str) -> str:
    return subprocess.run(["docker", "-H", f"unix://{sock}", *args], check=True,
                          capture_output=True, text=True).stdout.strip()


def _timed_exec(sock: str, image: str, argv: list[str]) -> float:
    flags = [f"--cap-add={c}" for c in CRIU_CAPABILITIES]
    flags += [f"--security-opt={o}" for o in CRIU_SECURITY_OPT]
    cid = _docker(sock, "run", "-d", "--network", "none", *flags, image,
                  "/usr/local/bin/capsule-init")
    try:
        t0 = time.monotonic()
        _docker(sock, "exec", cid, *argv)
        return time.monotonic() - t0
    finally:
        _docker(sock, "rm", "-f", cid)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inventory", type=Path)
    ap.add_argument("--host", default="host-0")
    ap.add_argument("--repeat", type=int, default=sized(3, 1))
    args = ap.parse_args()
    with cluster_inventory(args.inventory, [args.host], docker=True) as inv:
        # `up` records the test capsule's reference beside the inventory.
        image = (inv.parent / "test-capsule.ref").read_text().strip()
        hosts = {h["name"]: h for h in yaml.safe_load(inv.read_text())["hosts"]}
        sock = hosts[args.host]["docker_socket"]
        _docker(sock, "pull", image)
        launch = ["sh", "-c", "mkdir -p /v && : > /v/in && exec \"$@\"", "sh",
                  "/usr/local/bin/capsule-init", "launch", "--pid-floor", str(ENGINE_PID_FLOOR),
                  "--stdin", "/v/in", "--log", "/v/log", "--seccomp-filter",
                  engine_filter_b64(), "--", "true"]
        confined = [_timed_exec(sock, image, launch) for _ in range(args.repeat)]
        forked = [_timed_exec(sock, image, ["python3", "-c", _FORK_BURN])
                  for _ in range(args.repeat)]
    doc = {"host": args.host, "pid_floor": ENGINE_PID_FLOOR, "repeat": args.repeat,
           "confined_launch_s": round(statistics.median(confined), 3),
           "fork_pid_advance_s": round(statistics.median(forked), 3)}
    log(f"confined launch {doc['confined_launch_s']} s; the same PID advance by forking "
        f"{doc['fork_pid_advance_s']} s")
    emit("launch", doc)


if __name__ == "__main__":
    main()
