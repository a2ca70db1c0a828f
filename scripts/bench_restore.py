"""Benchmark: `coldsnapd` capture and restore at the operation level, against what they replace.

    scripts/bench restore [--gib 1.0] [--keep] [--keep-caches]

Starts its own 2-host dev cluster (state in .cache/bench-restore, network slots 96.. so hosts
on 198.18.0.98 and .99, next to any other cluster; COLDSNAP_BENCH_NET_BASE moves them),
writes the TP2 request of scripts/demo with --gib GiB of weights per worker (one unit per
host) and measures, all in one run:

  cold_start_seconds          the engine started from nothing: container start -> healthy
                              (the capture's start and wait-ready phases); unless
                              --keep-caches, the page cache is dropped before the capture:
                              the warm-up's fresh memory cost 6-16 s against about 6 s when
                              earlier work had filled the cache
  capture_seconds             the whole `coldsnapd capture`
  capture_after_ready_seconds the capture less its start and wait-ready phases (the engine's
                              own cold start, which a capture cannot avoid): what capturing
                              costs beyond launching the engine
  restore_cold_host_seconds   `coldsnapd restore` with nothing staged on the hosts (their
                              data_dir objects and the capsule images removed first) and,
                              unless --keep-caches, the page cache dropped (as before the
                              scp out): the simulated GPU memory is this machine's RAM, and
                              a page cache that earlier work filled made each cold restore's
                              weights reload reclaim it page by page (1.4-3.4 s against
                              1.0-1.2 s for 2 x 1 GiB, measured), which no real GPU pays
  bytes_staged_cold           what that restore put into the hosts' data_dir objects (a
                              capsule pulled from a registry is not counted)
  restore_warm_host_replacing_seconds  the same restore again, every object already
                              staged, while the units of the restore before still serve:
                              it stops and replaces them (what scripts/demo's warm restore
                              does)
  restore_warm_host_seconds   once more with every object staged and no unit running there
                              (their containers removed first, as after --prepare-only):
                              the issue's warm host (warm_host_nothing_running: true; lines
                              without that field measured the replacing restore here)
  scp_seconds_same_bytes      scp of the staged files from this machine to the same hosts,
                              one scp per host side by side, as staging runs
  scp_to_control_seconds      scp of the same files from the hosts back to this machine
  fsync_after_scp_seconds     fsync of those scp'd copies right after each scp (and
  fsync_after_scp_to_control_seconds  of the copies brought back): scp returns with its
                              bytes in the page cache, while coldsnapd publishes nothing
                              before it is on disk; scp + fsync is the durable floor
  raw_criu_dump_seconds       `docker exec C criu dump` of the restored engine, typed by hand
                              in its own container once it sleeps (level 2) and its GPUs are
                              checkpointed, as a capture leaves it; both units side by side
  raw_criu_restore_seconds    `docker exec C criu restore` of those images, same containers
  raw_wake_to_answer_seconds  then by hand to the first answer: GPUs restored and unlocked
                              (one exec per unit), POST /wake_up and /collective_rpc
                              reload_weights on both hosts, the validation prompt
  validation_round_trip_seconds  one validation prompt answered by the restored engine

and the issue's target ratios from those, with, beside them, ratios that have no target: the
cold- and warm-host restores against floors that count the weights' reload on wake (raw
restore + raw wake; item 3 of the issue puts that reload into every wake, and the issue's own
restore floors leave it out), the restores and captures against the durable (fsync'd) floors,
and the capture past the engine's cold start. One JSON line on stdout, appended to
bench-results/restore.jsonl. The cluster is stopped afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from bench_common import REPO, emit, log, sized

BENCH_DIR = REPO / ".cache" / "bench-restore"
# Another slot range (COLDSNAP_BENCH_NET_BASE) lets two checkouts benchmark at once.
NET_BASE = os.environ.get("COLDSNAP_BENCH_NET_BASE", "96")
EXPECTED = "coldsnap-cuda-snapshot-ok"
PROMPT = f"Reply with exactly: {EXPECTED}"
RAW_DIR = "/var/lib/coldsnap/raw-bench"
TIMEOUT = 1800.0  # any one command; a GiB-scale step takes seconds


def cluster_env() -> dict[str, str]:
    return dict(os.environ, COLDSNAP_DEV_CLUSTER_DIR=str(BENCH_DIR),
                COLDSNAP_DEV_NET_BASE=NET_BASE,
                PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")


def run(argv: Sequence[str], *, env: dict[str, str] | None = None) -> str:
    r = subprocess.run(list(argv), env=env or cluster_env(), capture_output=True, text=True,
                       timeout=TIMEOUT, check=False)
    if r.returncode != 0:
        raise SystemExit(f"bench restore: {' '.join(argv[:4])} ... exited {r.returncode}:\n"
                         f"{r.stderr[-3000:]}")
    return r.stdout


def seed_base_rootfs() -> None:
    """The capsule's base rootfs, when the default dev cluster has one already: the same
    inputs, so no second mmdebstrap."""
    mine = BENCH_DIR / "cache" / "test-capsule"
    mine.mkdir(parents=True, exist_ok=True)
    for tar in (REPO / ".dev-cluster" / "cache" / "test-capsule").glob("base-*.tar"):
        if not (mine / tar.name).exists():
            os.link(tar, mine / tar.name)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(calls: Sequence[Callable[[], Any]]) -> float:
    """Wall time of `calls` run at once (one per host)."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        t0 = time.perf_counter()
        for f in [pool.submit(c) for c in calls]:
            f.result()
        return time.perf_counter() - t0


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, as the hosts' side of a publish does. The simulated
    hosts' data_dirs and the store are on this machine's disk, so this flushes the same
    blocks the far side would."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class Bench:
    def __init__(self, inventory: Path, work: Path) -> None:
        self.inventory = inventory
        self.work = work
        self.store = work / "store"
        self.hosts = {h["name"]: h for h in yaml.safe_load(inventory.read_text())["hosts"]}

    def coldsnapd(self, *args: str) -> dict[str, Any]:
        receipt = self.work / f"receipt-{secrets.token_hex(4)}.json"
        run([sys.executable, "-m", "coldsnap", *args, "--inventory", str(self.inventory),
             "--store", str(self.store), "--receipt-json", str(receipt)],
            env=dict(os.environ, PYTHONPATH=str(REPO)))
        doc: dict[str, Any] = json.loads(receipt.read_text())
        return doc

    def docker(self, host: str, *args: str) -> str:
        return run(["docker", "-H", f"unix://{self.hosts[host]['docker_socket']}", *args])

    def objects(self, host: str) -> Path:
        return Path(self.hosts[host]["data_dir"]) / "objects" / "sha256"

    def staged(self, host: str) -> list[Path]:
        d = self.objects(host)
        return sorted(p for p in d.iterdir() if p.is_file()) if d.is_dir() else []

    def unit_containers(self, host: str) -> list[str]:
        return self.docker(host, "ps", "-aq", "--filter", "label=org.coldsnap.unit").split()

    def remove_units(self, host: str) -> None:
        ids = self.unit_containers(host)
        if ids:
            self.docker(host, "rm", "-f", *ids)

    def make_cold(self, image_ids: Sequence[str]) -> None:
        """Nothing of the artifact left on the hosts: units, staged objects, capsule images."""
        for host in self.hosts:
            self.remove_units(host)
            # Everything the host holds for coldsnapd: staged objects and whatever was
            # assembled from them (the bench cluster's own data_dir, nothing else).
            for entry in Path(self.hosts[host]["data_dir"]).glob("*"):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
            for image in image_ids:
                subprocess.run(["docker", "-H", f"unix://{self.hosts[host]['docker_socket']}",
                                "rmi", "-f", image], capture_output=True, timeout=TIMEOUT,
                               check=False)

    def _openssh(self, host: str) -> list[str]:
        """The OpenSSH client options that reach `host`: its key, strict known hosts."""
        h = self.hosts[host]
        return ["-i", h["identity_file"], "-o", f"UserKnownHostsFile={h['known_hosts']}",
                "-o", "StrictHostKeyChecking=yes"]

    def scp(self, host: str, sources: Sequence[str], dest: str) -> None:
        run(["scp", "-q", "-B", "-P", str(self.hosts[host].get("port", 22)),
             *self._openssh(host), *sources, dest])

    def ssh(self, host: str, command: str) -> None:
        """`command` run on `host` over a fresh OpenSSH connection (in its namespace)."""
        run(["ssh", "-p", str(self.hosts[host].get("port", 22)), "-o", "BatchMode=yes",
             *self._openssh(host), self.remote(host, "").rstrip(":"), command])

    def remote(self, host: str, path: str) -> str:
        return f"{self.hosts[host].get('user', 'root')}@{self.hosts[host]['address']}:{path}"

    def wait_healthy(self, host: str, timeout: float = 300.0) -> None:
        """Until the engine on `host` answers GET /health with 200."""
        url = f"http://{self.hosts[host]['address']}:8000/health"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url, timeout=10) as resp:
                    if resp.status == 200:
                        return
            except OSError:  # urllib's HTTPError (503) is one
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"bench restore: {host}'s engine not healthy in {timeout} s")
            time.sleep(0.02)

    def ask(self, host: str, path: str, body: dict[str, Any] | None = None) -> Any:
        req = urllib.request.Request(f"http://{self.hosts[host]['address']}:8000{path}",
                                     method="POST", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None


def span_max(receipt: dict[str, Any], name: str) -> float:
    return max((s["duration_seconds"] for s in receipt["timing"]["spans"] if s["name"] == name),
               default=0.0)


def phases(receipt: dict[str, Any]) -> dict[str, float]:
    """Each phase's longest span (one per unit), in the order they ran."""
    out: dict[str, float] = {}
    for s in receipt["timing"]["spans"]:
        if s["name"].count(".") == 1 and s.get("parent") is not None:
            out[s["name"]] = round(max(out.get(s["name"], 0.0), s["duration_seconds"]), 3)
    return out


def capture_request(b: Bench, gib: float) -> tuple[Path, str]:
    run([str(REPO / "scripts" / "dev-requests"), "--shard-bytes", str(int(gib * (1 << 30)))])
    # The model files exist long before a capture on a real host: their GiBs still being
    # written back must not stall the capture's first steps (a 10 s stall seen in facts).
    os.sync()
    doc = yaml.safe_load((BENCH_DIR / "requests" / "tp2-two-hosts.yaml").read_text())
    doc["id"] = f"bench-restore-{time.strftime('%Y%m%dT%H%M%S')}"
    doc["output"] = str(b.work / "artifact.json")
    path = b.work / "capture.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, str(doc["id"])


def manifests(b: Bench, artifact: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["owner"].split("/", 1)[1]: json.loads(
        (b.store / "objects" / "sha256" / o["sha256"][7:]).read_text())
        for o in artifact["objects"] if o["role"] == "capsule-manifest"}


def raw_criu(b: Bench, units: dict[str, dict[str, Any]], placement: dict[str, str],
             head: str) -> tuple[float, float, float]:
    """By hand, in each restored unit's own container: the engine asleep (level 2) and its
    GPUs checkpointed as a capture leaves it, then `criu dump` (the tree is killed), then
    `criu restore` of those images, then what brings the restored engine back to an answer
    (`raw_wake`); each step on both units side by side. (dump, restore, wake) seconds."""
    containers = {u: b.docker(h, "ps", "-q", "--filter", f"label=org.coldsnap.unit={u}").split()[0]
                  for u, h in placement.items()}
    for host in sorted(set(placement.values())):
        b.ask(host, "/sleep?level=2")
    for u, host in placement.items():
        for pid in units[u]["worker_pids"].values():
            for action in ("lock", "checkpoint"):
                b.docker(host, "exec", containers[u], "cuda-checkpoint", "--action", action,
                         "--pid", str(pid))
        b.docker(host, "exec", containers[u], "sh", "-c", f"rm -rf {RAW_DIR}; mkdir -p {RAW_DIR}")

    def criu(u: str, *args: str) -> Callable[[], Any]:
        return lambda: b.docker(placement[u], "exec", containers[u], "criu", *args)

    dump = side_by_side([criu(u, "dump", "-t", str(units[u]["engine_pid"]), "-D", RAW_DIR,
                              "-o", "dump.log") for u in placement])
    restore = side_by_side([criu(u, "restore", "-D", RAW_DIR, "-d", "-o", "restore.log")
                            for u in placement])
    return dump, restore, raw_wake(b, units, placement, containers, head)


def raw_wake(b: Bench, units: dict[str, dict[str, Any]], placement: dict[str, str],
             containers: dict[str, str], head: str) -> float:
    """After a raw `criu restore`, by hand, to the first answer: every worker's GPU restored
    and unlocked (one exec per unit), every engine woken (their group rebuilt) and its
    weights reloaded from the host's disk, then the validation prompt. What a restore with
    released weights cannot skip, whoever runs it."""
    def gpus(u: str) -> Callable[[], Any]:
        script = " && ".join(f"cuda-checkpoint --action {a} --pid {pid}"
                             for pid in units[u]["worker_pids"].values()
                             for a in ("restore", "unlock"))
        return lambda: b.docker(placement[u], "exec", containers[u], "sh", "-c", script)

    hosts = sorted(set(placement.values()))
    t0 = time.perf_counter()
    side_by_side([gpus(u) for u in placement])
    side_by_side([lambda h=h: b.ask(h, "/wake_up") for h in hosts])
    # Wake answers at once and rebuilds the group behind it (/health 503 until it is up): a
    # reload or a prompt sent before then is refused, as a coldsnapd restore's wait knows.
    side_by_side([lambda h=h: b.wait_healthy(h) for h in hosts])
    side_by_side([lambda h=h: b.ask(h, "/collective_rpc", {"method": "reload_weights"})
                  for h in hosts])
    answer = b.ask(head, "/v1/completions", {"prompt": PROMPT, "max_tokens": 32,
                                             "temperature": 0})
    seconds = time.perf_counter() - t0
    if EXPECTED not in json.dumps(answer):
        raise SystemExit(f"bench restore: the engine restored by hand answered {answer!r}")
    return seconds


def mem_free() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemFree:"):
                return int(line.split()[1]) * 1024
    return 0


def drop_caches() -> bool:
    """Flush, then drop the clean page cache, so that what follows starts cold: without it,
    the engines' fresh memory on a cold host comes out of a page cache that earlier work
    filled (reclaimed page by page), while on the warm host the replaced engines have just
    freed as much. False where this process may not (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def measure(b: Bench, gib: float, *, cold_caches: bool) -> dict[str, Any]:
    request, capture_id = capture_request(b, gib)
    log(f"capture {capture_id} ({gib} GiB of weights per worker)")
    cap = b.coldsnapd("capture", "--request", str(request))
    artifact = json.loads((b.work / "artifact.json").read_text())
    units = manifests(b, artifact)
    placement = {u["id"]: u["host"] for u in artifact["launch"]["units"]}
    cold_start = span_max(cap, "capture.start") + span_max(cap, "capture.wait-ready")

    log("restore on cold hosts")
    b.make_cold([m["image_id"] for m in units.values() if m.get("image_id")])
    dropped = cold_caches and drop_caches()
    free_before_cold = mem_free()
    cold = b.coldsnapd("restore", "--artifact", capture_id)
    staged = {h: b.staged(h) for h in b.hosts}
    bytes_staged = sum(p.stat().st_size for files in staged.values() for p in files)

    log("scp of the same bytes, both directions")
    scratch = {h: f"{b.hosts[h]['data_dir']}/scp-bench" for h in b.hosts}
    for d in scratch.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    back = {h: Path(tempfile.mkdtemp(dir=b.work)) for h in b.hosts}

    def to_host(h: str) -> Callable[[], None]:
        return lambda: b.scp(h, [str(b.store / "objects" / "sha256" / p.name)
                                 for p in staged[h]], b.remote(h, scratch[h] + "/"))

    def from_host(h: str) -> Callable[[], None]:
        return lambda: b.scp(h, [b.remote(h, str(p)) for p in staged[h]], str(back[h]) + "/")

    def durable(where: Path) -> Callable[[], None]:
        return lambda: fsync_tree(where)

    if dropped:
        drop_caches()  # the same start as the cold restore's: the store's files not cached
    scp_out = side_by_side([to_host(h) for h in b.hosts if staged[h]])
    # Staging publishes nothing before it is on disk; scp returns with its bytes in the page
    # cache. Flushing right after gives the durable floor.
    fsync_out = side_by_side([durable(Path(scratch[h])) for h in b.hosts if staged[h]])
    scp_back = side_by_side([from_host(h) for h in b.hosts if staged[h]])
    fsync_back = side_by_side([durable(back[h]) for h in b.hosts if staged[h]])
    for h, d in scratch.items():
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(back[h], ignore_errors=True)

    log("restore on warm hosts, replacing the units that serve there")
    replacing = b.coldsnapd("restore", "--artifact", capture_id)
    log("restore on warm hosts, no unit running there (as after --prepare-only)")
    for host in b.hosts:
        b.remove_units(host)
    warm = b.coldsnapd("restore", "--artifact", capture_id)
    head = placement[artifact["launch"]["units"][0]["id"]]
    rtts = [timed(lambda: b.ask(head, "/v1/completions",
                                {"prompt": PROMPT, "max_tokens": 32, "temperature": 0}))
            for _ in range(3)]
    log("raw criu dump and restore by hand")
    raw_dump, raw_restore, raw_wake_s = raw_criu(b, units, placement, head)
    b.make_cold([])

    payload_bytes = sum(o["bytes"] for o in artifact["objects"]
                        if o["role"] == "model-weight-payload")
    criu_bytes = sum(m["criu_images_bytes"] if "criu_images_bytes" in m else
                     sum(f["size"] for f in m["criu_images"]["files"]) for m in units.values())
    rtt = statistics.median(rtts)
    after_ready = cap["duration_seconds"] - cold_start
    return {
        "cold_start_seconds": round(cold_start, 3),
        "capture_seconds": round(cap["duration_seconds"], 3),
        "capture_after_ready_seconds": round(after_ready, 3),
        "restore_cold_host_seconds": round(cold["duration_seconds"], 3),
        "restore_warm_host_seconds": round(warm["duration_seconds"], 3),
        "warm_host_nothing_running": True,
        "restore_warm_host_replacing_seconds": round(replacing["duration_seconds"], 3),
        "bytes_staged_cold": bytes_staged,
        "scp_seconds_same_bytes": round(scp_out, 3),
        "scp_to_control_seconds": round(scp_back, 3),
        "fsync_after_scp_seconds": round(fsync_out, 3),
        "fsync_after_scp_to_control_seconds": round(fsync_back, 3),
        "raw_criu_restore_seconds": round(raw_restore, 3),
        "raw_criu_dump_seconds": round(raw_dump, 3),
        "raw_wake_to_answer_seconds": round(raw_wake_s, 3),
        "validation_round_trip_seconds": round(rtt, 3),
        "criu_images_bytes": criu_bytes,
        "payload_bytes": payload_bytes,
        "weights_released": all(m.get("weights_released") for m in units.values()),
        "caches_dropped_before_cold_restore_and_scp": dropped,
        "mem_free_before_cold_restore_bytes": free_before_cold,
        "ratios": {
            # targets: <= 1.3, <= 1.0 (1.5 x raw restore + validation), <= 1.5, <= 1.1, >= 3;
            # capture_after_ready_... has none: it shows the capture's cost beyond the engine's
            # cold start
            "restore_cold_host_vs_scp_plus_raw_restore": round(
                cold["duration_seconds"] / (scp_out + raw_restore), 3),
            "restore_warm_host_vs_1_5_raw_restore_plus_validation": round(
                warm["duration_seconds"] / (1.5 * raw_restore + rtt), 3),
            # No target in the issue: the same restore against its whole floor by hand, the
            # weights' reload on wake (item 3) included.
            "restore_warm_host_vs_raw_restore_plus_raw_wake": round(
                warm["duration_seconds"] / (raw_restore + raw_wake_s), 3),
            # No target: the cold-host restore against the same floor with the weights'
            # reload on wake counted, as in the warm-host ratio above.
            "restore_cold_host_vs_scp_plus_raw_restore_plus_raw_wake": round(
                cold["duration_seconds"] / (scp_out + raw_restore + raw_wake_s), 3),
            # No target: against copies as durable as coldsnapd's (fsync'd before published).
            "restore_cold_host_vs_scp_fsync_plus_raw_restore": round(
                cold["duration_seconds"] / (scp_out + fsync_out + raw_restore), 3),
            "capture_after_ready_vs_raw_dump_plus_scp_fsync_to_control": round(
                after_ready / (raw_dump + scp_back + fsync_back), 3),
            "capture_vs_raw_dump_plus_scp_to_control": round(
                cap["duration_seconds"] / (raw_dump + scp_back), 3),
            "capture_after_ready_vs_raw_dump_plus_scp_to_control": round(
                after_ready / (raw_dump + scp_back), 3),
            "bytes_staged_vs_criu_images_plus_payloads": round(
                bytes_staged / (criu_bytes + payload_bytes), 3),
            "cold_start_vs_restore_warm_host": round(cold_start / warm["duration_seconds"], 3),
        },
        "targets": {"restore_cold_host_vs_scp_plus_raw_restore": 1.3,
                    "restore_warm_host_vs_1_5_raw_restore_plus_validation": 1.0,
                    "capture_vs_raw_dump_plus_scp_to_control": 1.5,
                    "bytes_staged_vs_criu_images_plus_payloads": 1.1,
                    "cold_start_vs_restore_warm_host_min": 3.0},
        "phases": {"capture": phases(cap), "restore_cold": phases(cold),
                   "restore_warm": phases(warm),
                   "restore_warm_replacing": phases(replacing)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=sized(1.0, 4 / 1024),
                    help="GiB of weights per worker")
    ap.add_argument("--keep", action="store_true", help="leave the bench cluster running")
    ap.add_argument("--keep-caches", action="store_true",
                    help="do not drop the page cache before the capture, the cold-host "
                         "restore and the scp out (dropped by default when run as root)")
    args = ap.parse_args()
    seed_base_rootfs()
    inventory = Path(run([str(REPO / "scripts" / "dev-cluster"), "up", "2"]).strip()
                     .splitlines()[-1])
    work = Path(tempfile.mkdtemp(prefix="bench-restore-", dir=BENCH_DIR))
    if not args.keep_caches:
        # The engines' warm-up allocates as the reload does: the cold start too starts with
        # the memory that earlier work left in the page cache given back.
        drop_caches()
    try:
        figures = measure(Bench(inventory, work), args.gib, cold_caches=not args.keep_caches)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.keep:
            run([str(REPO / "scripts" / "dev-cluster"), "down"])
    emit("restore", {"gib_per_worker": args.gib, "hosts": 2, "workers": 2, **figures})


if __name__ == "__main__":
    main()
