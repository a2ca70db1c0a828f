"""Benchmark: the real vLLM (its CPU build) split across two hosts, tensor parallel 2, captured
and restored by `coldsnapd` with its connections between the hosts carried, against the pair's
own cold start and the raw CRIU restore of the same images.

    scripts/bench vllm --layout tp2 [--keep] [--keep-caches]

Starts its own 4-host dev cluster (state in .cache/bench-vllm, as the TP1 bench; network slots
96.., so hosts on 198.18.0.98 to .101; COLDSNAP_BENCH_NET_BASE moves them), builds or reuses
the vLLM-CPU capsule (scripts/build-vllm-capsule: cached outside the clone), writes the
vllm-cpu-tp2 requests of scripts/dev-requests (unit-0, the head, serving :8000; unit-1
headless; the tiny Llama of devtools/tiny_model.py) and measures, in one run:

  cold_start_seconds            the pair's own cold start on host-2/host-3: `docker run` of the
                                capsule image with each unit's command (no coldsnapd), both
                                units, to the head's /health answering 200 and the first
                                completion answered
  cold_start_health_seconds     the same, to /health alone
  capture_seconds               the whole `coldsnapd capture` on host-0/host-1 (the pair's start
                                included), and capture_after_ready_seconds past its readiness
  restore_cold_host_seconds     `coldsnapd restore` moved onto host-2/host-3 with nothing of
                                the artifact there (data_dirs emptied, the committed capsule
                                images removed; the base image stays, as the cold start had
                                it) and, unless --keep-caches, the page cache dropped
  restore_warm_host_seconds     the same restore again, every object staged, no unit running
  raw_criu_restore_seconds      by hand in the restored units' own containers, once both
                                engine trees are killed: /dev/shm put back from the images and
                                `criu restore --leave-stopped` of the same images (the moved
                                restore's rewritten copy; CRIU's own network lock skipped,
                                as coldsnapd's restore does) on both units side by side, then
                                both trees let run (SIGCONT); ..._to_answer_seconds through
                                /health and the first right answer (a failure is recorded in
                                raw_criu_restore_error, its figures null)
  validation_round_trip_seconds one validation prompt answered by the restored engine

and the ratios: cold start / warm-host restore (goal >= 20), warm-host restore / (raw restore
+ one validation round trip), cold-host restore / cold start (goal < 1). One JSON line on
stdout, appended to bench-results/vllm.jsonl. The cluster is stopped and its state removed
afterwards unless --keep.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import yaml
from bench_common import REPO, log
from bench_restore import Bench, drop_caches, phases, side_by_side, span_max, timed
from bench_vllm import BENCH_DIR, RAW_WORK, Recorded, run

from devtools.demo_common import native_start, post, wait_healthy

COLD_NAME = "bench-vllm-tp2-cold-start"
IMAGES = "/var/lib/coldsnap/images"
# Where a moved restore left the rewritten copy of the image set (coldsnapd's restore
# writes it in the unit's CRIU work directory; the staged originals never change).
REWRITTEN = "/var/lib/coldsnap/criu-work/images"
# SIGCONT to every process of the container but this exec's own shell: the restored tree
# (left stopped) and its init, which ignores it.
CONTINUE = ('for p in /proc/[0-9]*; do p=${p#/proc/}; '
            '[ "$p" = $$ ] || kill -CONT "$p" 2>/dev/null; done')


def complete(address: str, prompt: str) -> str:
    answer = post(address, "/v1/completions", {"model": "tiny-llama", "prompt": prompt,
                                               "max_tokens": 32, "temperature": 0}, timeout=120)
    return str(answer["choices"][0]["text"])


def cold_start(b: Bench, units: list[dict[str, Any]], prompt: str,
               expected: str) -> tuple[float, float]:
    """Both units started by hand from the capsule image with the request's commands:
    seconds to the head's /health 200, and to the first answer."""
    head = b.hosts[units[0]["host"]]["address"]

    def docker(host: str, *args: str) -> str:
        return b.docker(host, *args)

    t0 = native_start(units, COLD_NAME, docker_cli=docker)
    try:
        wait_healthy(head, 900)
        health = time.perf_counter() - t0
        text = complete(head, prompt)
        first = time.perf_counter() - t0
    finally:
        for unit in units:
            for c in b.docker(unit["host"], "ps", "-aq", "--filter",
                              f"name={COLD_NAME}").split():
                b.docker(unit["host"], "rm", "-f", c)
    if text.strip() != expected:
        raise SystemExit(f"bench vllm tp2: the cold-started pair answered {text!r}")
    return health, first


def raw_restore(b: Bench, placement: dict[str, str], manifests: dict[str, dict[str, Any]],
                head: str, prompt: str, expected: str) -> tuple[float, float]:
    """In each restored unit's own container: both engine trees killed at once, then, timed,
    /dev/shm put back and `criu restore --leave-stopped` of the images that unit was restored
    from, both units side by side, then both trees let run together (what coldsnapd's
    restore execs run, typed by hand). (the raw restore alone, through the first right
    answer) seconds."""
    containers = {u: b.docker(h, "ps", "-q", "--filter", f"label=org.coldsnap.unit={u}").split()[0]
                  for u, h in placement.items()}

    def kill(u: str) -> Any:
        m = manifests[u]
        pids = " ".join(map(str, [m["engine_pid"], *m["worker_pids"].values()]))
        return lambda: b.docker(placement[u], "exec", containers[u], "sh", "-c",
                                f"kill -9 -{m['engine_pid']} 2>/dev/null; kill -9 {pids}"
                                f" 2>/dev/null; for i in $(seq 500); do ok=1; for p in {pids};"
                                ' do [ -d /proc/$p ] && ok=; done; [ -n "$ok" ] && break;'
                                f" sleep 0.02; done; rm -rf {RAW_WORK}; mkdir -p {RAW_WORK}")

    def restore(u: str) -> Any:
        script = (f"images={IMAGES}; [ -d {REWRITTEN} ] && images={REWRITTEN}; "
                  "find /dev/shm -mindepth 1 -delete && "
                  "{ [ ! -f $images/tmpfs-dev-shm.tar ] || "
                  "tar -C /dev/shm --numeric-owner -xSpf $images/tmpfs-dev-shm.tar; } && "
                  f"criu restore -D $images -W {RAW_WORK} -d -o restore.log --leave-stopped "
                  "--tcp-established --link-remap --network-lock skip")
        return lambda: b.docker(placement[u], "exec", containers[u], "sh", "-c", script)

    def release(u: str) -> Any:
        return lambda: b.docker(placement[u], "exec", containers[u], "sh", "-c", CONTINUE)

    side_by_side([kill(u) for u in placement])
    t0 = time.perf_counter()
    side_by_side([restore(u) for u in placement])
    side_by_side([release(u) for u in placement])
    seconds = time.perf_counter() - t0
    wait_healthy(head, 300)
    answer = complete(head, prompt)
    if answer.strip() != expected:
        raise SystemExit(f"bench vllm tp2: the pair restored by hand answered {answer!r}")
    return seconds, time.perf_counter() - t0


def measure(b: Bench, cold_caches: bool) -> dict[str, Any]:
    run([str(REPO / "scripts" / "dev-requests")])
    requests = BENCH_DIR / "requests"
    doc = yaml.safe_load((requests / "vllm-cpu-tp2.yaml").read_text())
    capture_id = f"bench-vllm-tp2-{time.strftime('%Y%m%dT%H%M%S')}"
    doc["id"], doc["output"] = capture_id, str(b.work / "artifact.json")
    doc.pop("lifecycle")  # the captured units are removed afterwards: host-0/1 left idle
    request = b.work / "capture.yaml"
    request.write_text(yaml.safe_dump(doc, sort_keys=False))
    moved = yaml.safe_load((requests / "vllm-cpu-tp2-restore-moved.yaml").read_text())
    moved["artifact"] = capture_id
    units = moved["launch"]["units"]
    placement = {u["id"]: u["host"] for u in units}
    head = b.hosts[placement["unit-0"]]["address"]
    prompt, expected = doc["validation"]["prompt"], doc["validation"]["expected"]

    log("the pair's own cold start on host-2/host-3 (docker run, no coldsnapd)")
    for unit in units:  # a host that serves has its image already
        b.docker(unit["host"], "pull", unit["image"])
    if cold_caches:
        drop_caches()
    health_s, cold_s = cold_start(b, units, prompt, expected)

    log(f"capture {capture_id} on host-0/host-1")
    cap = b.coldsnapd("capture", "--request", str(request))
    ready = span_max(cap, "capture.start") + span_max(cap, "capture.wait-ready")
    artifact = json.loads((b.work / "artifact.json").read_text())
    manifests = {o["owner"].split("/", 1)[1]: json.loads(
        (b.store / "objects" / "sha256" / o["sha256"][7:]).read_text())
        for o in artifact["objects"] if o["role"] == "capsule-manifest"}

    def restore(n: int) -> dict[str, Any]:
        path = b.work / f"restore-{n}.yaml"
        moved["id"] = f"{capture_id}-restore-{n}"
        path.write_text(yaml.safe_dump(moved, sort_keys=False))
        return b.coldsnapd("restore", "--request", str(path))

    log("restore moved onto host-2/host-3, nothing of the artifact there")
    b.make_cold([m["image_id"] for m in manifests.values()])
    if cold_caches:
        drop_caches()
    cold = restore(1)
    log("restore onto host-2/host-3 again, everything staged, no unit running")
    for h in set(placement.values()):
        b.remove_units(h)
    warm = restore(2)
    rtts = [timed(lambda: complete(head, prompt)) for _ in range(3)]
    log("raw criu restore of the same images, by hand, both units")
    raw_error: str | None = None
    raw: float | None = None
    raw_answer: float | None = None
    try:
        raw, raw_answer = raw_restore(b, placement, manifests, head, prompt, expected)
    except (SystemExit, OSError) as exc:
        # Recorded, not fatal: the figures coldsnapd's own restores gave still stand.
        raw_error = str(exc)[-1500:]
        log(f"the raw restore failed: {raw_error}")
    b.make_cold([])
    return tp2_figures(Recorded(cold_s=cold_s, health_s=health_s, capture=cap, ready=ready,
                                cold=cold, warm=warm, rtts=rtts, cold_caches=cold_caches),
                       manifests, raw=raw, raw_answer=raw_answer, raw_error=raw_error)


def tp2_figures(r: Recorded, manifests: dict[str, dict[str, Any]], *, raw: float | None,
                raw_answer: float | None, raw_error: str | None) -> dict[str, Any]:
    """The tp2 line's figures from what the run recorded and each unit's capsule manifest;
    the raw restore's figures are null when it failed (its error is recorded instead). No
    vLLM needed: tests/unit/test_bench_vllm.py."""
    cold_s, health_s, cap, cold, warm = r.cold_s, r.health_s, r.capture, r.cold, r.warm
    ready, cold_caches = r.ready, r.cold_caches
    rtt = statistics.median(r.rtts)
    criu_bytes = sum(f["size"] for m in manifests.values() for f in m["criu_images"]["files"])
    return {
        "cold_start_seconds": round(cold_s, 3),
        "cold_start_health_seconds": round(health_s, 3),
        "capture_seconds": round(cap["duration_seconds"], 3),
        "capture_after_ready_seconds": round(cap["duration_seconds"] - ready, 3),
        "restore_cold_host_seconds": round(cold["duration_seconds"], 3),
        "restore_warm_host_seconds": round(warm["duration_seconds"], 3),
        "raw_criu_restore_seconds": None if raw is None else round(raw, 3),
        "raw_criu_restore_to_answer_seconds": None if raw_answer is None else round(raw_answer, 3),
        "raw_criu_restore_error": raw_error,
        "validation_round_trip_seconds": round(rtt, 3),
        "criu_images_bytes": criu_bytes,
        "crossings": {"restore_warm": (warm.get("result") or {}).get("crossings")},
        "caches_dropped": cold_caches,
        "ratios": {
            "cold_start_vs_restore_warm_host": round(cold_s / warm["duration_seconds"], 2),
            "restore_warm_host_vs_raw_restore_plus_validation": None if raw is None else round(
                warm["duration_seconds"] / (raw + rtt), 3),
            "restore_cold_host_vs_cold_start": round(cold["duration_seconds"] / cold_s, 3),
        },
        "targets": {"cold_start_vs_restore_warm_host_min": 20.0,
                    "restore_cold_host_vs_cold_start": 1.0},
        "phases": {"capture": phases(cap), "restore_cold": phases(cold),
                   "restore_warm": phases(warm)},
    }


if __name__ == "__main__":  # `scripts/bench vllm_tp2` is `scripts/bench vllm --layout tp2`
    import sys

    import bench_vllm

    sys.argv[1:1] = ["--layout", "tp2"]
    bench_vllm.main()
