"""Benchmark: one model restored as N independent replicas, objects from the control node's
store against each host pulling its own from the registry (issue 25, item 5).

    scripts/bench fanout [--gib 0.25] [--link-mbit 200] [--replicas 1,2,4,8] [--keep]

Starts its own dev cluster of max(replicas) hosts plus its registry host (state in
.cache/bench-fanout, network slots 112.. so hosts on 198.18.0.114.. and the registry on
198.18.0.142, next to the shared cluster and bench restore's; COLDSNAP_BENCH_NET_BASE moves
them), every host link and the control node's link shaped to --link-mbit, the registry's link
unshaped (it stands for a registry service that scales out). Captures ONE TP1 engine (one
unit, one worker, --gib GiB of weights: 0.25 GiB by default, so that the whole run, three
ways at N = 1, 2, 4, 8, fits in about ten minutes on this machine; a real TP1 model is
tens of GiB, and the ratios, not the seconds, are what carries over), publishes it to the
cluster's registry, and then for each N restores it as N replicas: N `coldsnapd restore`
processes at once, one per host (host-0 .. host-N-1), each with its own request (the unit
moved to its host, its own operation id), three ways, each from cold hosts (every unit
container removed and the hosts' data_dir emptied: no staged object, no assembled image
set; the capsule's container image is pulled onto every host once, before anything is
measured, so that neither way counts it):

  store     `restore --stage-from store`: the control node sends every object over its
            one shaped link
  registry  `restore --stage-from registry`: each host pulls its own blobs
  floor     raw `curl` of the same blobs (every object the registry holds as the artifact
            names it: not the capsule manifests, nor the documents a publication redacts;
            one curl after another per host) from the registry, inside each host's network
            namespace, all hosts at once

Why 200 Mbit/s: at N = 8 the registry way moves 8 x 200 Mbit/s = 200 MB/s through this
2-core machine (registry, 8 pulls, 8 fsyncs); faster links would measure the CPUs, not the
links. The control node's link is one per machine (csd-br0, shared with any other cluster
here): its shaping and byte counters see the other clusters' control traffic too.

Reported, per N under "runs" (keys "1", "2", ...), and per way:
  wall_seconds           store/registry: from starting the N restores until the last one
                         ends; floor: from starting the N curls until the last one ends
  restore_seconds        each restore's own duration (its receipt), host order
  staging_seconds        each restore's staging phase (its receipt's `restore.stage` span:
                         the host's pull, or the control node's sends), host order
  control_bytes          bytes between the control node and this cluster's hosts and
                         registry during that way, both directions (counting rules in the
                         control node's INPUT/OUTPUT for this cluster's addresses: csd-br0
                         is the machine's, and another cluster's tests cross it too)
  control_bytes_csd_br0  the same span on csd-br0's own counters (`dev-cluster link-bytes`,
                         rx + tx, after - before): every cluster's control traffic
  registry_egress_bytes  bytes the registry host sent (its link's tx) during that way
  staged_bytes           what the N hosts were to receive: N x the artifact's objects but
                         the capsule manifests (a TP1 unit's host owns all the others)
  objects_dir_bytes      what the hosts' data_dir objects hold afterwards (the CRIU image
                         objects are turned into image sets, so this is less)
  floor: per_host_seconds  each host's curls (its blobs one after another)
  load_avg               the 1-minute load average before and after that way
Per N, "goals":
  control_bytes_vs_staged_registry   registry way: control_bytes / staged_bytes (goal < 0.01)
  pull_vs_floor_per_host             registry way: each host's staging_seconds / the wall
                                     time of that host's curl (goal <= 1.2 each)
and over the run, "goals": registry_wall_n{max}_vs_n1 (the registry way's wall_seconds at
the largest N over N = 1; goal <= 1.3) and, with no goal, store_wall_n{max}_vs_n1 (what the
registry avoids), registry_restore_max_n{max}_vs_n1 (the longest receipt duration: the same
without the N CLI processes' start, which on 2 cores is seconds) and
registry_staging_max_n{max}_vs_n1 (the network part alone). Also: the sizes, the link
rate, the artifact's published reference, the load average at start and end. One JSON line
on stdout, appended to bench-results/fanout.jsonl; a table on stderr. The cluster is stopped
afterwards unless --keep (the control link's shaping is removed either way).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from bench_common import REPO, emit, log, sized

from coldsnap.operations.artifact_registry import IMPORTED_ROLES
from devtools import shaping
from devtools.layout import Layout

BENCH_DIR = REPO / ".cache" / "bench-fanout"
NET_BASE = os.environ.get("COLDSNAP_BENCH_NET_BASE", "112")
TIMEOUT = 1800.0
REPOSITORY = "coldsnap/bench-fanout"


def cluster_env() -> dict[str, str]:
    return dict(os.environ, COLDSNAP_DEV_CLUSTER_DIR=str(BENCH_DIR),
                COLDSNAP_DEV_NET_BASE=NET_BASE, PYTHONPATH=str(REPO),
                PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")


def run(argv: Sequence[str]) -> str:
    r = subprocess.run(list(argv), env=cluster_env(), capture_output=True, text=True,
                       timeout=TIMEOUT, check=False)
    if r.returncode != 0:
        raise SystemExit(f"bench fanout: {' '.join(argv[:5])} ... exited {r.returncode}:\n"
                         f"{r.stderr[-3000:]}")
    return r.stdout


def dev_requests() -> Any:
    """scripts/dev-requests as a module: its request builders (no .py suffix)."""
    loader = importlib.machinery.SourceFileLoader("dev_requests", str(REPO / "scripts" /
                                                                      "dev-requests"))
    spec = importlib.util.spec_from_loader("dev_requests", loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def seed_base_rootfs() -> None:
    mine = BENCH_DIR / "cache" / "test-capsule"
    mine.mkdir(parents=True, exist_ok=True)
    for src in (REPO / ".dev-cluster", Path("/work/main/.dev-cluster")):
        for tar in (src / "cache" / "test-capsule").glob("base-*.tar"):
            if not (mine / tar.name).exists():
                os.link(tar, mine / tar.name)


def side_by_side(calls: Sequence[Callable[[], Any]]) -> tuple[float, list[Any]]:
    """Wall time of `calls` run at once, and their results in order."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        t0 = time.perf_counter()
        futures = [pool.submit(c) for c in calls]
        results = [f.result() for f in futures]
        return time.perf_counter() - t0, results


ACCOUNTING = "csd-bench-fanout"


def accounting(addresses: Sequence[str], add: bool) -> None:
    """Counting rules (no target) in the control node's INPUT and OUTPUT for this cluster's
    addresses: csd-br0's counters are the machine's, so another cluster's control traffic
    (the shared one's tests) lands there too; these count only this cluster's."""
    for addr in addresses:
        for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
            subprocess.run(["iptables", "-A" if add else "-D", chain, flag, addr, "-m",
                            "comment", "--comment", ACCOUNTING], capture_output=True,
                           timeout=30, check=add)


def own_control_bytes() -> int:
    total = 0
    for chain in ("INPUT", "OUTPUT"):
        out = subprocess.run(["iptables", "-nvxL", chain], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        total += sum(int(line.split()[1]) for line in out.splitlines() if ACCOUNTING in line)
    return total


def link_bytes() -> dict[str, int]:
    doc = json.loads(run([str(REPO / "scripts" / "dev-cluster"), "link-bytes"]))
    return {"control": doc["control"]["rx_bytes"] + doc["control"]["tx_bytes"],
            "registry_tx": doc["registry"]["tx_bytes"], "own": own_control_bytes()}


def load1() -> float:
    return round(os.getloadavg()[0], 2)


class Bench:
    def __init__(self, inventory: Path, work: Path, layout: Layout) -> None:
        self.inventory = inventory
        self.work = work
        self.store = work / "store"
        self.layout = layout
        self.hosts = {h["name"]: h for h in yaml.safe_load(inventory.read_text())["hosts"]}
        self.addresses = {n: h["address"] for n, h in self.hosts.items()}

    def coldsnapd(self, *args: str) -> dict[str, Any]:
        receipt = self.work / f"receipt-{secrets.token_hex(4)}.json"
        run([sys.executable, "-m", "coldsnap", *args, "--local", "--inventory",
             str(self.inventory), "--store", str(self.store), "--receipt-json", str(receipt)])
        doc: dict[str, Any] = json.loads(receipt.read_text())
        return doc

    def docker(self, host: str, *args: str) -> str:
        return run(["docker", "-H", f"unix://{self.hosts[host]['docker_socket']}", *args])

    def data_dir(self, host: str) -> Path:
        return Path(self.hosts[host]["data_dir"])

    def staged_bytes(self, host: str) -> tuple[int, list[str]]:
        d = self.data_dir(host) / "objects" / "sha256"
        files = sorted(p for p in d.iterdir() if p.is_file()) if d.is_dir() else []
        return sum(p.stat().st_size for p in files), [p.name for p in files]

    def make_cold(self) -> None:
        """Every unit container gone and every host's data_dir emptied (staged objects and
        the image sets assembled from them); the capsule's container image stays."""
        for host in self.hosts:
            ids = self.docker(host, "ps", "-aq", "--filter", "label=org.coldsnap.unit").split()
            if ids:
                self.docker(host, "rm", "-f", *ids)
            for entry in self.data_dir(host).glob("*"):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        os.sync()


def staging_seconds(receipt: dict[str, Any]) -> float:
    """The receipt's `restore.stage` span: every object on the host, from the survey of what
    it holds to the last fsync'd blob (one host per restore here)."""
    spans = [s for s in receipt["timing"]["spans"] if s["name"] == "restore.stage"]
    return round(max((s["duration_seconds"] for s in spans), default=0.0), 3)


def restores(b: Bench, capture: dict[str, Any], capture_id: str, hosts: list[str],
             way: str, tag: str, dr: Any, per_host_bytes: int) -> dict[str, Any]:
    """N restores at once, one per host, each with its own request; `way` is --stage-from."""
    paths = []
    for k, host in enumerate(hosts):
        req = dr.restore_request(capture, [host], b.addresses)
        req["id"] = f"{tag}-{way}-n{len(hosts)}-{k}"
        req["artifact"] = capture_id
        p = b.work / f"{req['id']}.yaml"
        p.write_text(yaml.safe_dump(req, sort_keys=False))
        paths.append(p)
    b.make_cold()
    before, load_before = link_bytes(), load1()
    wall, receipts = side_by_side([
        lambda p=p: b.coldsnapd("restore", "--request", str(p), "--stage-from", way)
        for p in paths])
    after = link_bytes()
    return {
        "wall_seconds": round(wall, 3),
        "restore_seconds": [round(r["duration_seconds"], 3) for r in receipts],
        "staging_seconds": [staging_seconds(r) for r in receipts],
        "control_bytes": after["own"] - before["own"],
        "control_bytes_csd_br0": after["control"] - before["control"],
        "registry_egress_bytes": after["registry_tx"] - before["registry_tx"],
        "staged_bytes": per_host_bytes * len(hosts),
        "objects_dir_bytes": sum(b.staged_bytes(h)[0] for h in hosts),
        "load_avg": [load_before, load1()],
        "_phases": [sorted({s["name"] for s in r["timing"]["spans"]}) for r in receipts[:1]],
    }


def floor(b: Bench, registry: str, blobs: dict[str, list[str]]) -> dict[str, Any]:
    """Raw curl of each host's blobs from the registry, inside its namespace, all at once."""
    b.make_cold()

    def pull(host: str) -> float:
        out = b.data_dir(host) / "curl-floor"
        out.mkdir(parents=True, exist_ok=True)
        netns = b.layout.net(int(host.rsplit("-", 1)[1])).netns
        t0 = time.perf_counter()
        for name in blobs[host]:
            run(["ip", "netns", "exec", netns, "curl", "-sSf", "--max-time", "1200", "-L",
                 "-o", str(out / name),
                 f"http://{registry}/v2/{REPOSITORY}/blobs/sha256:{name}"])
        return time.perf_counter() - t0

    hosts = list(blobs)
    before, load_before = link_bytes(), load1()
    wall, per_host = side_by_side([lambda h=h: pull(h) for h in hosts])
    after = link_bytes()
    written = sum(p.stat().st_size for h in hosts
                  for p in (b.data_dir(h) / "curl-floor").iterdir())
    b.make_cold()
    return {"wall_seconds": round(wall, 3), "per_host_seconds": [round(s, 3) for s in per_host],
            "control_bytes": after["own"] - before["own"],
            "control_bytes_csd_br0": after["control"] - before["control"],
            "registry_egress_bytes": after["registry_tx"] - before["registry_tx"],
            "staged_bytes": written, "load_avg": [load_before, load1()]}


def measure(b: Bench, gib: float, replicas: list[int]) -> dict[str, Any]:
    dr = dev_requests()
    ref = (BENCH_DIR / "test-capsule.ref").read_text().strip()
    image, _, digest = ref.partition("@")
    registry = image.split("/", 1)[0]
    for host in b.hosts:  # the capsule image on every host before anything is measured
        b.docker(host, "pull", ref)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    capture = dr.capture_request("bench-fanout", ref, digest, ["host-0"], 1,
                                 int(gib * (1 << 30)), b.work, b.addresses)
    capture["id"] = f"bench-fanout-{stamp}"
    capture["output"] = str(b.work / "artifact.json")
    os.sync()
    req = b.work / "capture.yaml"
    req.write_text(yaml.safe_dump(capture, sort_keys=False))
    log(f"capture {capture['id']} (TP1, {gib} GiB of weights)")
    cap = b.coldsnapd("capture", "--request", str(req))
    log("publish to the registry")
    published = run([sys.executable, "-m", "coldsnap", "publish", "--artifact", capture["id"],
                      "--to", f"{registry}/{REPOSITORY}", "--inventory", str(b.inventory),
                      "--store", str(b.store)]).strip().splitlines()[-1]
    artifact = json.loads((b.work / "artifact.json").read_text())
    # TP1: the one unit's host receives every object but the capsule manifests, which stay
    # on the control node (restore reads them from its store).
    blobs = [o for o in artifact["objects"] if o["role"] != "capsule-manifest"]
    per_host_bytes = sum(o["bytes"] for o in blobs)
    # The floor curls what the registry holds under the artifact's digests: not the documents
    # a publication redacts (replay plans, capture requests: the control node pushes them
    # redacted, under other digests, and a registry restore stages them from the store).
    pulled = [o for o in blobs if o["role"] not in IMPORTED_ROLES]
    runs: dict[str, Any] = {}
    for n in replicas:
        hosts = [f"host-{k}" for k in range(n)]
        out: dict[str, Any] = {}
        for way in ("store", "registry"):
            log(f"N={n}: {n} restore(s) at once, --stage-from {way}")
            out[way] = restores(b, capture, capture["id"], hosts, way, f"fanout-{stamp}", dr,
                                per_host_bytes)
        log(f"N={n}: the floor, raw curl of the same blobs")
        out["floor"] = floor(b, registry, {h: [o["sha256"][7:] for o in pulled] for h in hosts})
        phases = out["registry"].pop("_phases")
        out["store"].pop("_phases")
        reg = out["registry"]
        out["goals"] = {
            "control_bytes_vs_staged_registry": round(
                reg["control_bytes"] / max(1, reg["staged_bytes"]), 5),
            "pull_vs_floor_per_host": [round(s / max(1e-6, f), 3) for s, f in zip(
                reg["staging_seconds"], out["floor"]["per_host_seconds"], strict=True)],
        }
        out["span_names"] = phases[0] if phases else []
        runs[str(n)] = out
        log(json.dumps({k: v for k, v in out.items() if k != "span_names"}))
    first, last = str(replicas[0]), str(replicas[-1])
    return {
        "capture_id": capture["id"], "published": published,
        "capture_seconds": round(cap["duration_seconds"], 3),
        "artifact_bytes": sum(o["bytes"] for o in artifact["objects"]),
        "bytes_per_host": per_host_bytes,
        "objects": sorted({o["role"] for o in artifact["objects"]}),
        "payload_bytes": sum(o["bytes"] for o in artifact["objects"]
                             if o["role"] == "model-weight-payload"),
        "runs": runs,
        "goals": {
            f"registry_wall_n{last}_vs_n{first}": round(
                runs[last]["registry"]["wall_seconds"] / runs[first]["registry"]["wall_seconds"],
                3),
            f"store_wall_n{last}_vs_n{first}": round(
                runs[last]["store"]["wall_seconds"] / runs[first]["store"]["wall_seconds"], 3),
            # No goal: the same growth without the N CLI processes' own start (their clocks
            # start once each is running), and of the staging alone.
            f"registry_restore_max_n{last}_vs_n{first}": round(
                max(runs[last]["registry"]["restore_seconds"])
                / max(runs[first]["registry"]["restore_seconds"]), 3),
            f"registry_staging_max_n{last}_vs_n{first}": round(
                max(runs[last]["registry"]["staging_seconds"])
                / max(runs[first]["registry"]["staging_seconds"]), 3),
        },
        "targets": {"registry_wall_nmax_vs_n1": 1.3, "control_bytes_vs_staged_registry": 0.01,
                    "pull_vs_floor_per_host": 1.2},
    }


def table(doc: dict[str, Any]) -> str:
    mib = 1 << 20
    rows = [f"{'N':>2} {'way':<8} {'wall s':>8} {'ctrl MiB':>9} {'reg out MiB':>11} "
            f"{'staged MiB':>10}  notes"]
    for n, out in doc["runs"].items():
        for way in ("store", "registry", "floor"):
            r = out[way]
            note = ""
            if way == "registry":
                g = out["goals"]
                note = (f"ctrl/staged {g['control_bytes_vs_staged_registry']:.4f}, "
                        f"pull/floor {g['pull_vs_floor_per_host']}")
            rows.append(f"{n:>2} {way:<8} {r['wall_seconds']:>8.2f} "
                        f"{r['control_bytes'] / mib:>9.1f} "
                        f"{r['registry_egress_bytes'] / mib:>11.1f} "
                        f"{r['staged_bytes'] / mib:>10.1f}  {note}")
    rows.append(f"goals: {doc['goals']}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=sized(0.25, 4 / 1024),
                    help="GiB of weights (one worker)")
    # The smoke size leaves the links unshaped (0): the control node's link is the machine's,
    # shared with the clusters the test suite runs on.
    ap.add_argument("--link-mbit", type=int, default=sized(200, 0),
                    help="host and control node link rate, Mbit/s (0: unshaped)")
    ap.add_argument("--replicas", default=sized("1,2,4,8", "1,2"), help="comma-separated N values")
    ap.add_argument("--keep", action="store_true", help="leave the bench cluster running")
    args = ap.parse_args()
    try:
        replicas = sorted({int(x) for x in args.replicas.split(",")})
    except ValueError:
        raise SystemExit(f"--replicas: not a list of integers: {args.replicas!r}") from None
    if not replicas or replicas[0] < 1:
        raise SystemExit("--replicas: each N must be at least 1")
    if args.gib <= 0 or args.link_mbit < 0:
        raise SystemExit("--gib must be positive and --link-mbit not negative")
    seed_base_rootfs()
    load_start = list(os.getloadavg())
    layout = Layout.from_env(cluster_env())
    shape = ("--link-mbit", str(args.link_mbit)) if args.link_mbit else ()
    inventory = Path(run([str(REPO / "scripts" / "dev-cluster"), "up", str(replicas[-1]),
                          *shape]).strip().splitlines()[-1])
    work = Path(tempfile.mkdtemp(prefix="bench-fanout-", dir=BENCH_DIR))
    ours = [layout.net(i).address for i in range(replicas[-1])] + [layout.registry.address]
    accounting(ours, add=True)
    try:
        figures = measure(Bench(inventory, work, layout), args.gib, replicas)
    finally:
        accounting(ours, add=False)
        shutil.rmtree(work, ignore_errors=True)
        if args.keep:
            pass
        else:
            run([str(REPO / "scripts" / "dev-cluster"), "down"])
        # The control node's link is the machine's (csd-br0): never leave it shaped for the
        # other clusters here.
        if args.link_mbit and shaping.link(shaping.BRIDGE) is not None:
            shaping.shape_control(0)
    doc = {"gib": args.gib, "link_mbit": args.link_mbit or None, "registry_link": "unshaped",
           "hosts": replicas[-1], "replicas": replicas, "engine": "TP1 test engine",
           "load_avg_start": [round(x, 2) for x in load_start],
           "load_avg_end": [round(x, 2) for x in os.getloadavg()], **figures}
    emit("fanout", doc)
    log(table(doc))


if __name__ == "__main__":
    main()
