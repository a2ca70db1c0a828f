"""Benchmark: the real vLLM (its CPU build) captured and restored by `coldsnapd`, against vLLM's
own cold start and the raw CRIU restore of the same images.

    scripts/bench vllm [--model tiny|large] [--traffic N] [--layout tp1|tp2] [--keep]
                       [--keep-caches]

--layout tp2 (scripts/bench_vllm_tp2.py says what it measures) benchmarks vLLM split across
two hosts instead; tp1, the default, is what follows.

Starts its own 2-host dev cluster (state in .cache/bench-vllm, network slots 96.., so hosts on
198.18.0.98 and .99; COLDSNAP_BENCH_NET_BASE moves them), builds or reuses the vLLM-CPU capsule
(scripts/build-vllm-capsule: cached outside the clone, keyed by its recipe), writes the
vllm-cpu-tp1 request of scripts/dev-requests (one unit, TP1, the tiny Llama of
devtools/tiny_model.py; with --model large the large random Llama of the same module, 1.13
GiB of float32 weights, built once under .cache/bench-vllm-models/) and measures, in one run:

  cold_start_seconds            vLLM's own cold start on host-1: `docker run` of the capsule
                                image with the request's command (no coldsnapd) to /health
                                answering 200 and the first completion answered
  cold_start_health_seconds     the same, to /health alone
  capture_seconds               the whole `coldsnapd capture` on host-0 (the engine's start
                                included), and capture_after_ready_seconds past its readiness;
                                the capture follows `traffic`: N distinct prompts (--traffic;
                                by default enough to fill 60% of the KV space, worked out from
                                the model's config and VLLM_CPU_KVCACHE_SPACE) sent the moment
                                the engine turns healthy, before the capture's drain, with the
                                largest KV usage vLLM's /metrics showed meanwhile
  kv_discard                    the same capture again after the same traffic with
                                policy.process.kv_discard false: image bytes (the CRIU images'
                                files), unique bytes (the chunk store's objects, identical
                                chunks once) and wire bytes (what the cold-host restore's
                                staging sent to host-1: its veth's bytes transmitted, protocol
                                included, the weights' payload as well as the images) of both,
                                and kv_released_bytes from the manifest. The kept capture
                                is not published: its cold-host restore
                                (restore_cold_host_kept_seconds) and wire bytes are the
                                store's, to compare with restore_cold_host_store_*; the
                                discard one's wire bytes here are the default path's
  published                     `coldsnapd publish` of the (discard) capture to the cluster's
                                registry (repository bench/vllm), as a user with a registry
                                does: its pinned reference and seconds
  link_floor                    the raw link floors of a file as large as the default path's
                                wire bytes, to host-1, in the same run: `scp` from the control
                                node and `curl` on host-1 of the same bytes as one blob from
                                the registry (each's seconds and bytes per second under
                                `tools`); `tool`, `seconds` and `bytes_per_second` are the
                                faster one's, the floor the goal's bound uses
  durable_floor                 the same curl followed by `sync` of the file on host-1: the
                                bytes on its disk, as staging has them (fsync'd) before it
                                publishes; the bound that floor gives (+ raw CRIU restore +
                                one validation round trip) and the cold-host restore against
                                it, beside the goal's (which takes the link floor alone)
  restore_cold_host_seconds     `coldsnapd restore` onto host-1 with nothing of the artifact
                                there (its data_dir emptied, the committed capsule image
                                removed, the control node's remembered CRIU probes forgotten;
                                the base image stays, as the cold start had it) and, unless
                                --keep-caches, the page cache dropped, on the default
                                path: `--stage-from auto`, which takes the registry for a
                                published artifact (restore_cold_host_source, from the
                                receipt, must say `registry`, else the run fails).
                                restore_cold_host_wire_bytes: what host-1's veth received
                                meanwhile (the bridge carries the registry's HTTP to it as it
                                does SSH: every byte that reached host-1, protocol included);
                                ..._registry_sent_bytes: what the registry host sent
  restore_cold_host_store_seconds the same restore from the control node's store
                                (`--stage-from store`, over SSH), with its source and wire
                                bytes, and ..._store_vs_cold_start
  restore_warm_host_seconds     the same restore again, every object staged, no unit running
  raw_criu_restore_seconds      by hand in the restored unit's own container, once its engine
                                tree is killed: /dev/shm put back from the images and `criu
                                restore` of the same images (what coldsnapd's restore exec
                                runs, typed by hand), a full restore; ..._to_answer_seconds
                                through /health and the first right answer
  raw_criu_lazy_restore_seconds the same with a `criu lazy-pages` daemon and --lazy-pages, as
                                coldsnapd restores images over 256 MiB (its cost moves to the
                                first requests: ..._to_answer_seconds counts them)
  validation_round_trip_seconds one validation prompt answered by the restored engine

and the issue's ratios: cold start / warm-host restore (goal >= 8, moonshot 15), warm-host
restore / (raw restore + one validation round trip) (goal <= 1.3), cold-host restore / cold
start (goal < 1); and, without a target, the warm-host restore against the lazy raw restore
through its first answer. `goals` holds issue 36's goals, each measured beside its goal and
whether it is met: the images with discard at most the images without it less 0.9x the KV
space; the (default path's) cold-host restore within 1.2x of (wire bytes / the best link
floor, scp's or curl's) + raw CRIU restore + one validation round trip; cold-host restore
/ cold start at most 0.15 for the tiny model (below 1 for the large one); cold start /
warm-host restore at least 30. One JSON line on stdout, appended to bench-results/vllm.jsonl.
The cluster is stopped and its state removed afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from bench_common import REPO, emit, log, push_blob
from bench_restore import Bench, drop_caches, phases, span_max, timed

from devtools.demo_common import VLLM_API_KEY, post
from devtools.layout import HostNet, RegistryNet, host_index
from devtools.vllm_traffic import (
    GIB,
    Goals,
    Traffic,
    best_floor,
    default_traffic,
    goal_figures,
    model_kv_bytes_per_token,
)

BENCH_DIR = REPO / ".cache" / "bench-vllm"
NET_BASE = os.environ.get("COLDSNAP_BENCH_NET_BASE", "96")
TIMEOUT = 1800.0
RAW_WORK = "/var/lib/coldsnap/raw-bench"
# The large model is built once (a minute of numpy) and kept outside the cluster's state,
# which `dev-cluster down --purge` removes after every run.
MODELS_DIR = REPO / ".cache" / "bench-vllm-models"
# Where the bench publishes its capture on the cluster's registry, and the link floor's blob.
REPOSITORY = "bench/vllm"
FLOOR_REPOSITORY = "bench/vllm-floor"
# Cold-host restore / cold start, per model: issue 36's goal for the tiny model, and "faster
# than its cold start" for the large one.
COLD_VS_COLD_START_MAX = {"tiny": 0.15, "large": 1.0}


def env() -> dict[str, str]:
    return dict(os.environ, COLDSNAP_DEV_CLUSTER_DIR=str(BENCH_DIR),
                COLDSNAP_DEV_NET_BASE=NET_BASE, PYTHONPATH=str(REPO),
                PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")


def run(argv: list[str]) -> str:
    r = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=TIMEOUT,
                       check=False)
    if r.returncode != 0:
        raise SystemExit(f"bench vllm: {' '.join(argv[:4])} ... exited {r.returncode}:\n"
                         f"{r.stderr[-3000:]}")
    return r.stdout


def get(address: str, path: str, timeout: float = 2) -> int | None:
    try:
        with urllib.request.urlopen(f"http://{address}:8000{path}",
                                    timeout=timeout) as r:
            return int(r.status)
    except (OSError, urllib.error.URLError):
        return None


def complete(b: Bench, host: str, prompt: str) -> str:
    # The engine answers its OpenAI endpoints only with the dev request's API key.
    answer = post(b.hosts[host]["address"], "/v1/completions",
                  {"model": "tiny-llama", "prompt": prompt, "max_tokens": 32, "temperature": 0})
    return str(answer["choices"][0]["text"])


def cold_start(b: Bench, host: str, unit: dict[str, Any], prompt: str,
               expected: str) -> tuple[float, float]:
    """vLLM started by hand from the capsule image with the request's command: seconds to
    /health 200, and to the first answer."""
    address = b.hosts[host]["address"]
    argv = ["run", "-d", "--name", "bench-vllm-cold-start", "--network", "host",
            "--shm-size", "8g"]
    for k, v in unit["environment"].items():
        argv += ["-e", f"{k}={v}"]
    for m in unit["mounts"]:
        argv += ["-v", f"{m['source']}:{m['target']}:ro"]
    t0 = time.perf_counter()
    b.docker(host, *argv, unit["image"], *unit["command"])
    try:
        while get(address, "/health") != 200:
            if time.perf_counter() - t0 > 900:
                raise SystemExit("bench vllm: vLLM's cold start took over 900 s")
            time.sleep(0.05)
        health = time.perf_counter() - t0
        text = complete(b, host, prompt)
        first = time.perf_counter() - t0
    finally:
        b.docker(host, "rm", "-f", "bench-vllm-cold-start")
    if text.strip() != expected:
        raise SystemExit(f"bench vllm: the cold-started engine answered {text!r}")
    return health, first


def raw_restore(b: Bench, host: str, manifest: dict[str, Any], *, lazy: bool) -> float:
    """In the restored unit's own container: kill its engine tree, then time what coldsnapd's
    restore exec runs, by hand: /dev/shm emptied and put back from the images, `criu
    restore` of those images with the options the capture used; with `lazy`, as coldsnapd
    restores images this large, a `criu lazy-pages` daemon first and `--lazy-pages`."""
    container = b.docker(host, "ps", "-q", "--filter", "label=org.coldsnap.unit=unit-0").split()[0]
    pids = [manifest["engine_pid"], *manifest["worker_pids"].values()]
    b.docker(host, "exec", container, "sh", "-c",
             f"kill -9 -{manifest['engine_pid']} 2>/dev/null; kill -9 {' '.join(map(str, pids))}"
             f" 2>/dev/null; for i in $(seq 500); do ok=1; for p in {' '.join(map(str, pids))};"
             ' do [ -d /proc/$p ] && ok=; done; [ -n "$ok" ] && break; sleep 0.02; done;'
             f" rm -rf {RAW_WORK}; mkdir -p {RAW_WORK}")
    images = "/var/lib/coldsnap/images"
    lazy_pages = (f"setsid criu lazy-pages -D {images} -W {RAW_WORK} -o lazy-pages.log "
                  f"</dev/null >/dev/null 2>&1 & until [ -S {RAW_WORK}/lazy-pages.socket ]; "
                  "do sleep 0.01; done && ")
    script = (f"find /dev/shm -mindepth 1 -delete && "
              f"tar -C /dev/shm --numeric-owner -xSpf {images}/tmpfs-dev-shm.tar && "
              + (lazy_pages if lazy else "")
              + f"criu restore -D {images} -W {RAW_WORK} -d -o restore.log "
              + ("--lazy-pages " if lazy else "") + "--tcp-established --link-remap")
    return timed(lambda: b.docker(host, "exec", container, "sh", "-c", script))


def raw_restore_to_answer(b: Bench, host: str, manifest: dict[str, Any], prompt: str,
                          expected: str, *, lazy: bool) -> tuple[float, float]:
    """(the raw restore alone, the raw restore through the first right answer) seconds."""
    t0 = time.perf_counter()
    restore = raw_restore(b, host, manifest, lazy=lazy)
    while get(b.hosts[host]["address"], "/health") != 200:
        time.sleep(0.02)
    answer = complete(b, host, prompt)
    if answer.strip() != expected:
        raise SystemExit(f"bench vllm: the engine restored by hand answered {answer!r}")
    return restore, time.perf_counter() - t0


def large_model() -> tuple[Path, str]:
    """The large random Llama (devtools/tiny_model.py --size large), built when its digest is
    unknown (it is deterministic)."""
    from devtools import tiny_model

    out, stamp = MODELS_DIR / "vllm-large", MODELS_DIR / "vllm-large.digest"
    if out.is_dir() and stamp.is_file() and tiny_model.model_digest(out) == stamp.read_text():
        return out, stamp.read_text()
    log(f"building the large model in {out}")
    digest = tiny_model.build(out, shape=tiny_model.LARGE)
    stamp.write_text(digest)
    return out, digest


def with_model(doc: dict[str, Any], model: str) -> Path:
    """Point the request's unit at `model`'s directory; that directory."""
    unit = doc["launch"]["units"][0]
    if model == "large":
        path, digest = large_model()
        unit["mounts"][0]["source"] = str(path)
        doc["launch"]["model"].update(id="coldsnap-dev/large-llama", revision=digest)
        os.sync()  # its GiB written back now, not during the cold start or the capture
    return Path(unit["mounts"][0]["source"])


def host_tx_bytes(b: Bench, host: str) -> int:
    """Bytes the bridge sent to `host` so far: its veth's root end transmits everything that
    reaches the host's namespace, from the control node (staging's SSH streams) and from the
    registry host alike (a registry pull's HTTP crosses the bridge to the same veth), with
    their protocol."""
    net = HostNet(host_index(host), int(NET_BASE))
    return int(Path(f"/sys/class/net/{net.veth_root}/statistics/tx_bytes").read_text())


def registry_sent_bytes() -> int:
    """Bytes the registry host sent so far: what its veth's root end received."""
    veth = RegistryNet(int(NET_BASE)).veth_root
    return int(Path(f"/sys/class/net/{veth}/statistics/rx_bytes").read_text())


def publish(b: Bench, artifact: str) -> tuple[str, float]:
    """`coldsnapd publish` of `artifact` to the cluster's registry (the inventory's), as a user
    with a registry publishes a capture: the pinned reference and the seconds it took. The
    store records the publication, so a restore's `--stage-from auto` pulls from there."""
    registry = yaml.safe_load(b.inventory.read_text())["registry"]
    t0 = time.perf_counter()
    out = run([sys.executable, "-m", "coldsnap", "publish", "--artifact", artifact,
               "--to", f"{registry}/{REPOSITORY}:{artifact}", "--inventory",
               str(b.inventory), "--store", str(b.store)])
    return out.strip().splitlines()[-1], time.perf_counter() - t0


def staged_from(receipt: dict[str, Any]) -> str | None:
    """Where a restore's staging took the objects from ("store" or "registry"): the source its
    restore.verify-objects span records."""
    for span in receipt["timing"]["spans"]:
        if span["name"] == "restore.verify-objects":
            source = (span.get("attributes") or {}).get("source")
            return None if source is None else str(source)
    return None


def capture_after_traffic(b: Bench, request: Path, host: str, count: int
                          ) -> tuple[dict[str, Any], Traffic]:
    """`coldsnapd capture` of `request`, with `count` warm-up prompts sent the moment its
    engine turns healthy: the capture's drain waits for them, so the dump follows them."""
    receipt = b.work / f"receipt-{request.stem}.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "coldsnap", "capture", "--request", str(request),
         "--inventory", str(b.inventory), "--store", str(b.store), "--receipt-json",
         str(receipt)], env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    traffic = Traffic(b.hosts[host]["address"], VLLM_API_KEY, "tiny-llama", count)
    try:
        while get(b.hosts[host]["address"], "/health") != 200:
            if proc.poll() is not None:
                raise SystemExit(f"bench vllm: the capture ended before its engine turned "
                                 f"healthy:\n{proc.communicate()[1][-3000:]}")
            time.sleep(0.02)
        traffic.send()
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise SystemExit(f"bench vllm: the capture exited {proc.returncode}:\n{err[-3000:]}")
    traffic.join()
    doc: dict[str, Any] = json.loads(receipt.read_text())
    return doc, traffic


def the_manifest(b: Bench, artifact_path: Path) -> dict[str, Any]:
    """The capsule manifest of the artifact's one unit, from the control node's store."""
    artifact = json.loads(artifact_path.read_text())
    manifest: dict[str, Any]
    (manifest,) = [json.loads((b.store / "objects" / "sha256" / o["sha256"][7:]).read_text())
                   for o in artifact["objects"] if o["role"] == "capsule-manifest"]
    return manifest


def link_floors(b: Bench, host: str, size: int) -> tuple[dict[str, float], float]:
    """The raw link floors of `size` bytes to `host`, in seconds, by tool: `scp` of a file of
    that many random bytes from the control node, and `curl` run on the host (over ssh, in its
    namespace) fetching the same bytes as one blob from the cluster's registry (the way the
    default path's pulls come), each with its connection setup. The file is written and pushed
    first, outside the timing; nothing is checked or fsync'd. Second: the durable floor, the
    same curl followed by `sync` of the file (the bytes on the host's disk, as staging must
    have them before it publishes)."""
    src = b.work / "floor.bin"
    h = hashlib.sha256()
    with src.open("wb") as f:
        left = size
        while left > 0:
            data = os.urandom(min(left, 64 << 20))
            h.update(data)
            f.write(data)
            left -= len(data)
    digest = "sha256:" + h.hexdigest()
    registry = yaml.safe_load(b.inventory.read_text())["registry"]
    push_blob(registry, FLOOR_REPOSITORY, src, digest, size)
    dest = f"{b.hosts[host]['data_dir']}/bench-floor.bin"
    url = f"http://{registry}/v2/{FLOOR_REPOSITORY}/blobs/{digest}"
    try:
        scp = timed(lambda: b.scp(host, [str(src)], b.remote(host, dest)))
        Path(dest).unlink(missing_ok=True)
        curl = timed(lambda: b.ssh(host, f"curl -sSf -o {dest} {url}"))
        Path(dest).unlink(missing_ok=True)
        durable = timed(lambda: b.ssh(host, f"curl -sSf -o {dest} {url} && sync {dest}"))
        return {"scp": scp, "curl": curl}, durable
    finally:
        src.unlink(missing_ok=True)
        Path(dest).unlink(missing_ok=True)


def floor_figures(size: int, floors: dict[str, float]) -> dict[str, Any]:
    """The line's link_floor: each tool's seconds and bytes per second for the same `size`
    bytes, and the best of them (tool, seconds, bytes_per_second), which the goal's bound
    uses (no vLLM needed: tests/unit/test_bench_vllm.py)."""
    tool, seconds = best_floor(floors)
    return {"tool": tool, "bytes": size, "seconds": round(seconds, 3),
            "bytes_per_second": round(size / seconds),
            "tools": {t: {"seconds": round(v, 3), "bytes_per_second": round(size / v)}
                      for t, v in floors.items()}}


def durable_figures(size: int, seconds: float, *, restore_cold_s: float, raw_criu_s: float,
                    validation_s: float) -> dict[str, Any]:
    """The durable floor (curl and `sync` of the same bytes on the host) and the cold-host
    restore against the bound it gives: what the goal's bound is once the bytes must be on
    the disk, as staging's fsync before publishing has them (no target of its own)."""
    bound = seconds + raw_criu_s + validation_s
    return {"tool": "curl+sync", "bytes": size, "seconds": round(seconds, 3),
            "bytes_per_second": round(size / seconds), "bound_seconds": round(bound, 3),
            "restore_cold_host_vs_bound": round(restore_cold_s / bound, 3)}


def cold_host_paths(default: dict[str, Any], store: dict[str, Any], *, cold_s: float,
                    wire: int, store_wire: int, registry_sent: int) -> dict[str, Any]:
    """The two cold-host restores side by side: the default path's (`--stage-from auto`, the
    registry pull of the published artifact) and the store's (`--stage-from store`), each with
    its source, wire bytes and ratio to the cold start (no vLLM needed:
    tests/unit/test_bench_vllm.py)."""
    return {
        "restore_cold_host_source": staged_from(default),
        "restore_cold_host_wire_bytes": wire,
        "restore_cold_host_registry_sent_bytes": registry_sent,
        "restore_cold_host_store_seconds": round(store["duration_seconds"], 3),
        "restore_cold_host_store_source": staged_from(store),
        "restore_cold_host_store_wire_bytes": store_wire,
        "restore_cold_host_store_vs_cold_start": round(store["duration_seconds"] / cold_s, 3),
    }


def measure(b: Bench, cold_caches: bool, model: str = "tiny",
            traffic: int | None = None) -> dict[str, Any]:
    run([str(REPO / "scripts" / "dev-requests")])
    doc = yaml.safe_load((BENCH_DIR / "requests" / "vllm-cpu-tp1.yaml").read_text())
    model_dir = with_model(doc, model)
    capture_id = f"bench-vllm-{time.strftime('%Y%m%dT%H%M%S')}"
    doc["id"], doc["output"] = capture_id, str(b.work / "artifact.json")
    doc.pop("lifecycle")  # the captured unit is removed afterwards: host-0 is left idle
    request = b.work / "capture.yaml"
    request.write_text(yaml.safe_dump(doc, sort_keys=False))
    # The same capture with the KV space kept in its images, after the same traffic.
    kept_doc = json.loads(json.dumps(doc))
    kept_doc["id"], kept_doc["output"] = f"{capture_id}-kept", str(b.work / "kept.json")
    kept_doc.setdefault("policy", {}).setdefault("process", {})["kv_discard"] = False
    kept_request = b.work / "capture-kept.yaml"
    kept_request.write_text(yaml.safe_dump(kept_doc, sort_keys=False))
    unit = doc["launch"]["units"][0]
    prompt, expected = doc["validation"]["prompt"], doc["validation"]["expected"]
    kv_space = int(float(unit["environment"]["VLLM_CPU_KVCACHE_SPACE"]) * GIB)
    per_token = model_kv_bytes_per_token(model_dir, unit["command"])
    count = traffic if traffic is not None else default_traffic(kv_space, per_token)

    log(f"vLLM's own cold start on host-1 (docker run, no coldsnapd), {model} model")
    b.docker("host-1", "pull", unit["image"])  # a host that serves has its image already
    if cold_caches:
        drop_caches()
    health_s, cold_s = cold_start(b, "host-1", unit, prompt, expected)

    log(f"capture {capture_id} on host-0 after {count} warm-up prompts")
    cap, sent = capture_after_traffic(b, request, "host-0", count)
    ready = span_max(cap, "capture.start") + span_max(cap, "capture.wait-ready")
    manifest = the_manifest(b, b.work / "artifact.json")
    log(f"capture {capture_id}-kept (kv_discard: false) after the same traffic")
    kept_cap, kept_sent = capture_after_traffic(b, kept_request, "host-0", count)
    kept_manifest = the_manifest(b, b.work / "kept.json")

    log(f"publish {capture_id} to the cluster's registry")
    published, publish_s = publish(b, capture_id)

    def restore(n: int, artifact: str = capture_id, stage_from: str = "auto"
                ) -> dict[str, Any]:
        moved = json.loads(json.dumps(doc))
        moved.update(operation="restore", id=f"{artifact}-restore-{n}", artifact=artifact)
        moved.pop("output")
        moved["launch"]["units"][0]["host"] = "host-1"
        path = b.work / f"restore-{n}.yaml"
        path.write_text(yaml.safe_dump(moved, sort_keys=False))
        return b.coldsnapd("restore", "--request", str(path), "--stage-from", stage_from)

    def cold_restore(n: int, artifact: str, image_id: str, stage_from: str = "auto"
                     ) -> tuple[dict[str, Any], int, int]:
        b.make_cold([image_id])
        # The control node's remembered CRIU probes (<store>/probes) forgotten too: else only
        # the first cold-host restore of the run pays the probe, and the paths compared after
        # it (registry, store) would not start alike.
        shutil.rmtree(b.store / "probes", ignore_errors=True)
        if cold_caches:
            drop_caches()
        before, registry_before = host_tx_bytes(b, "host-1"), registry_sent_bytes()
        receipt = restore(n, artifact, stage_from)
        return (receipt, host_tx_bytes(b, "host-1") - before,
                registry_sent_bytes() - registry_before)

    log("restore onto host-1, nothing of the artifact there (the default path: --stage-from "
        "auto, the registry's)")
    cold, wire, registry_sent = cold_restore(1, capture_id, manifest["image_id"])
    if staged_from(cold) != "registry":
        raise SystemExit(f"bench vllm: the default cold-host restore staged from "
                         f"{staged_from(cold)!r}, not from {published}")
    log("restore onto host-1 again, everything staged, no unit running")
    b.remove_units("host-1")
    warm = restore(2)
    rtts = [timed(lambda: complete(b, "host-1", prompt)) for _ in range(3)]
    log("raw criu restore of the same images, by hand, full then lazy")
    raw, raw_answer = raw_restore_to_answer(b, "host-1", manifest, prompt, expected,
                                            lazy=False)
    raw_lazy, raw_lazy_answer = raw_restore_to_answer(b, "host-1", manifest, prompt, expected,
                                                      lazy=True)
    b.remove_units("host-1")
    log("restore onto host-1 from the store (--stage-from store), nothing of it there")
    cold_store, store_wire, _ = cold_restore(4, capture_id, manifest["image_id"], "store")
    b.remove_units("host-1")
    log(f"the link floors: scp and curl (from the registry) of {wire} bytes to host-1")
    floors, durable = link_floors(b, "host-1", wire)
    # Not published (its bytes would double the registry's share of the disk): from the store.
    log("restore of the kept capture onto host-1 from the store, nothing of it there")
    kept_cold, kept_wire, _ = cold_restore(3, f"{capture_id}-kept", kept_manifest["image_id"],
                                           "store")
    b.make_cold([])
    figures = tp1_figures(Recorded(cold_s=cold_s, health_s=health_s, capture=cap, ready=ready,
                                   cold=cold, warm=warm, rtts=rtts, cold_caches=cold_caches),
                          manifest, raw=raw, raw_answer=raw_answer, raw_lazy=raw_lazy,
                          raw_lazy_answer=raw_lazy_answer)
    discard = kv_figures(manifest, kept_manifest, wire=wire, kept_wire=kept_wire)
    goals = goal_figures(Goals(
        kv_space_bytes=kv_space, images_bytes=discard["with_discard"]["images_bytes"],
        images_kept_bytes=discard["without_discard"]["images_bytes"], wire_bytes=wire,
        floor_seconds=floors, raw_criu_seconds=raw,
        validation_seconds=figures["validation_round_trip_seconds"], cold_start_seconds=cold_s,
        restore_cold_seconds=cold["duration_seconds"],
        restore_warm_seconds=warm["duration_seconds"],
        cold_vs_cold_start_max=COLD_VS_COLD_START_MAX[model]))
    kept_capture = round(kept_cap["duration_seconds"], 3)
    return {**figures,
            **cold_host_paths(cold, cold_store, cold_s=cold_s, wire=wire,
                              store_wire=store_wire, registry_sent=registry_sent),
            "published": {"ref": published, "seconds": round(publish_s, 3)},
            "kv_space_bytes": kv_space, "kv_bytes_per_token": per_token,
            "traffic": sent.figures(kv_space, per_token),
            "traffic_kept": kept_sent.figures(kv_space, per_token),
            "kv_discard": {**discard, "capture_kept_seconds": kept_capture,
                           "restore_cold_host_kept_seconds": round(
                               kept_cold["duration_seconds"], 3)},
            "link_floor": floor_figures(wire, floors),
            "durable_floor": durable_figures(
                wire, durable, restore_cold_s=cold["duration_seconds"], raw_criu_s=raw,
                validation_s=figures["validation_round_trip_seconds"]),
            "goals": goals,
            "phases": {**figures["phases"], "capture_kept": phases(kept_cap),
                       "restore_cold_store": phases(cold_store),
                       "restore_cold_kept": phases(kept_cold)}}


def kv_figures(manifest: dict[str, Any], kept: dict[str, Any], *, wire: int,
               kept_wire: int) -> dict[str, Any]:
    """Image, unique and wire bytes of the capture with its KV space discarded and of the one
    that kept it (their capsule manifests; no vLLM needed: tests/unit/test_bench_vllm.py)."""
    def one(m: dict[str, Any], sent: int) -> dict[str, Any]:
        images = m["criu_images"]
        return {"images_bytes": sum(f["size"] for f in images["files"]),
                "unique_bytes": sum(o["bytes"] for o in images["objects"]),
                "wire_bytes": sent, "kv_discarded": m.get("kv_discarded"),
                "kv_released_bytes": m.get("kv_released_bytes")}

    return {"with_discard": one(manifest, wire), "without_discard": one(kept, kept_wire)}


@dataclass(frozen=True)
class Recorded:
    """What a vLLM benchmark run recorded before its figures are worked out: seconds by
    hand and the coldsnapd receipts of the capture and the two restores."""

    cold_s: float  # the engine's own cold start, to its first answer
    health_s: float  # the same, to /health
    capture: dict[str, Any]  # receipts (`coldsnapd ... --receipt-json`)
    ready: float  # the capture's start + wait-ready spans
    cold: dict[str, Any]
    warm: dict[str, Any]
    rtts: list[float]  # validation round trips against the restored engine
    cold_caches: bool


def tp1_figures(r: Recorded, manifest: dict[str, Any], *, raw: float, raw_answer: float,
                raw_lazy: float, raw_lazy_answer: float) -> dict[str, Any]:
    """The tp1 line's figures from what the run recorded and the captured unit's capsule
    manifest (no vLLM needed: tests/unit/test_bench_vllm.py)."""
    cold_s, health_s, cap, cold, warm = r.cold_s, r.health_s, r.capture, r.cold, r.warm
    ready, cold_caches = r.ready, r.cold_caches
    rtt = statistics.median(r.rtts)
    criu_bytes = sum(f["size"] for f in manifest["criu_images"]["files"])
    return {
        "cold_start_seconds": round(cold_s, 3),
        "cold_start_health_seconds": round(health_s, 3),
        "capture_seconds": round(cap["duration_seconds"], 3),
        "capture_after_ready_seconds": round(cap["duration_seconds"] - ready, 3),
        "restore_cold_host_seconds": round(cold["duration_seconds"], 3),
        "restore_warm_host_seconds": round(warm["duration_seconds"], 3),
        "raw_criu_restore_seconds": round(raw, 3),
        "raw_criu_restore_to_answer_seconds": round(raw_answer, 3),
        "raw_criu_lazy_restore_seconds": round(raw_lazy, 3),
        "raw_criu_lazy_restore_to_answer_seconds": round(raw_lazy_answer, 3),
        "validation_round_trip_seconds": round(rtt, 3),
        "criu_images_bytes": criu_bytes,
        "weights_released": manifest["weights_released"],
        "accelerator": manifest["accelerator"],
        "caches_dropped": cold_caches,
        "ratios": {
            "cold_start_vs_restore_warm_host": round(cold_s / warm["duration_seconds"], 2),
            "restore_warm_host_vs_raw_restore_plus_validation": round(
                warm["duration_seconds"] / (raw + rtt), 3),
            "restore_cold_host_vs_cold_start": round(cold["duration_seconds"] / cold_s, 3),
            # No target: against the same restore done by hand as coldsnapd does it (lazy
            # pages), through the first right answer, which is where a lazy restore's cost
            # lands.
            "restore_warm_host_vs_raw_lazy_restore_to_answer": round(
                warm["duration_seconds"] / raw_lazy_answer, 3),
        },
        "targets": {"cold_start_vs_restore_warm_host_min": 8.0,
                    "cold_start_vs_restore_warm_host_moonshot": 15.0,
                    "restore_warm_host_vs_raw_restore_plus_validation": 1.3,
                    "restore_cold_host_vs_cold_start": 1.0},
        "phases": {"capture": phases(cap), "restore_cold": phases(cold),
                   "restore_warm": phases(warm)},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", action="store_true", help="leave the bench cluster running")
    ap.add_argument("--keep-caches", action="store_true",
                    help="do not drop the page cache before the cold start and the cold-host "
                         "restore (dropped by default when run as root)")
    ap.add_argument("--layout", choices=("tp1", "tp2"), default="tp1",
                    help="tp1: one unit on one host (default); tp2: tensor parallel 2 split "
                         "across two hosts, its connections carried (4-host cluster)")
    ap.add_argument("--model", choices=("tiny", "large"), default="tiny",
                    help="tp1: the tiny Llama of the tests (default) or the large random one "
                         "(devtools/tiny_model.py --size large, 1.13 GiB of weights)")
    ap.add_argument("--traffic", type=int, metavar="N",
                    help="tp1: warm-up prompts before each capture (default: enough to fill "
                         "60%% of the KV space, from the model's config and "
                         "VLLM_CPU_KVCACHE_SPACE)")
    args = ap.parse_args(argv)
    if args.traffic is not None and args.traffic < 1:
        ap.error("--traffic: must be at least 1")
    if args.layout == "tp2" and (args.model != "tiny" or args.traffic is not None):
        ap.error("--model and --traffic are for --layout tp1; tp2 serves the tiny model "
                 "without warm-up traffic")
    return args


def layout_figures(args: argparse.Namespace) -> dict[str, Any]:
    """The line's description of the cluster and the engine's split."""
    if args.layout == "tp2":
        return {"layout": "tp2", "hosts": 4, "units": 2, "workers": 2}
    return {"hosts": 2, "workers": 1}


def document(args: argparse.Namespace, figures: dict[str, Any]) -> dict[str, Any]:
    """The JSON line (less emit's own fields) from the arguments and the measured figures."""
    model = ("large-llama (devtools/tiny_model.py --size large)" if args.model == "large"
             else "tiny-llama (devtools/tiny_model.py)")
    return {**layout_figures(args), "model": model, **figures}


def main() -> None:
    args = parse_args()
    hosts = layout_figures(args)["hosts"]
    inventory = Path(run([str(REPO / "scripts" / "dev-cluster"), "up", str(hosts)]).strip()
                     .splitlines()[-1])
    try:
        run([str(REPO / "scripts" / "build-vllm-capsule")])
        work = Path(tempfile.mkdtemp(prefix="bench-vllm-", dir=BENCH_DIR))
        try:
            if args.layout == "tp2":
                import bench_vllm_tp2

                figures = bench_vllm_tp2.measure(Bench(inventory, work),
                                                 cold_caches=not args.keep_caches)
            else:
                figures = measure(Bench(inventory, work), cold_caches=not args.keep_caches,
                                  model=args.model, traffic=args.traffic)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        if not args.keep:
            # Its hosts' state is tens of GB (two captures of the engine, staged twice): a
            # stopped bench cluster left it all on the disk.
            run([str(REPO / "scripts" / "dev-cluster"), "down", "--purge"])
    emit("vllm", document(args, figures))


if __name__ == "__main__":
    main()
