"""The main job (`scripts/demo`): the real vLLM (its CPU build) split across two hosts, tensor
parallel 2, captured with its connections between the hosts and restored, moved and in place.

    scripts/demo

On a 4-host dev cluster (`scripts/dev-cluster up 4`; the vLLM capsule built or reused by
scripts/build-vllm-capsule, cached outside the clone), with the vllm-cpu-tp2 requests of
scripts/dev-requests (unit-0, the head, serving :8000 on host-0; unit-1 headless on host-1):
  1. cold start: both units started natively (`docker run` of the capsule image with the
     request's commands, no coldsnapd), timed to /health and to the first answer, then removed
  2. capture with `activation_state: running`, then the captured engine's answers: a greedy
     completion and a chat, both with logprobs
  3. the captured units removed; a restore moved onto host-2/host-3 (every socket's addresses
     rewritten with the pair's whole map), asked the same at host-2's address
  4. its units removed; a second restore of the same artifact in place on host-0/host-1
and prints the times, the connections each unit carried across, and whether both restores'
answers are byte-identical to the captured engine's (exit status 1 when not). The cluster is
left up with the in-place restore serving (stop it with `scripts/dev-cluster down`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from devtools.demo_common import (
    REPO,
    STATE,
    answers,
    coldsnapd,
    docker,
    host,
    native_remove,
    native_start,
    post,
    print_table,
    remove_units,
    same,
    say,
    sh,
    span_max,
    wait_healthy,
)

PREFIX = "demo-vllm-tp2-"
COLD_NAME = "demo-vllm-cold-start"
# A pair's cold start takes about a minute with a warm page cache, about twice that cold.
COLD_START_DEADLINE = 900.0


def requests(work: Path, run: str) -> tuple[Path, Path, Path, dict[str, Any]]:
    """The capture, moved restore and in-place restore requests of this run (a fresh
    capture id each run: a capture never replaces an artifact)."""
    req = STATE / "requests"
    capture = yaml.safe_load((req / "vllm-cpu-tp2.yaml").read_text())
    capture_id = f"{PREFIX}{run}"
    capture["id"], capture["output"] = capture_id, str(work / "artifact.json")
    moved = yaml.safe_load((req / "vllm-cpu-tp2-restore-moved.yaml").read_text())
    moved["id"], moved["artifact"] = f"{capture_id}-moved", capture_id
    # In place: the captured launch itself (its hosts, commands and variables).
    in_place = {**json.loads(json.dumps(moved)), "id": f"{capture_id}-in-place",
                "launch": capture["launch"]}
    paths = (work / "capture.yaml", work / "restore-moved.yaml", work / "restore-in-place.yaml")
    for path, doc in zip(paths, (capture, moved, in_place), strict=True):
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return (*paths, capture)


def cold_start(units: list[dict[str, Any]]) -> tuple[float, float]:
    """The pair started natively: seconds to the head's /health, and to its first answer."""
    for unit in units:
        # A host that serves has its image already: pulled before the clock starts.
        docker(unit["host"], "pull", unit["image"], timeout=1800)
    head = host(next(u for u in units if u["index"] == 0)["host"])["address"]
    native_remove(units, COLD_NAME)
    t0 = native_start(units, COLD_NAME)
    try:
        wait_healthy(head, COLD_START_DEADLINE)
        health = time.perf_counter() - t0
        post(head, "/v1/completions", {"model": "tiny-llama", "prompt": "Hello",
                                       "max_tokens": 8, "temperature": 0})
        first = time.perf_counter() - t0
    finally:
        native_remove(units, COLD_NAME)
    return health, first


def crossings(receipt: dict[str, Any]) -> list[dict[str, Any]]:
    """The receipt's per-unit account of how the unit crossed the operation: its way
    (`crossing`) and the connections it carried."""
    result = receipt.get("result") or {}
    for key in ("crossings", "units"):
        items = result.get(key)
        if isinstance(items, list) and all(isinstance(i, dict) and "crossing" in i
                                           for i in items) and items:
            return items
    return []


def show_crossings(name: str, receipt: dict[str, Any]) -> None:
    for c in crossings(receipt):
        rest = ", ".join(f"{k} {v}" for k, v in c.items()
                         if k not in ("unit", "crossing") and not isinstance(v, dict | list))
        print(f"  {name:<10} {c.get('unit', '?'):<8} crossing {c['crossing']}: {rest}")


def main() -> int:
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    say("== dev cluster (4 hosts) and the vLLM capsule (built once, cached)")
    sh([str(REPO / "scripts" / "dev-cluster"), "up", "4"], quiet=True)
    sh([str(REPO / "scripts" / "build-vllm-capsule")], quiet=True)
    # An engine an earlier demo restored is still serving on these hosts, on the ports this
    # one needs: it goes first.
    remove_units(PREFIX)
    sh([str(REPO / "scripts" / "dev-requests")], quiet=True)
    os.sync()  # the model files are on disk before anything starts, as on a real host

    run = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    work = STATE / "demo" / run
    work.mkdir(parents=True)
    capture_req, moved_req, in_place_req, capture = requests(work, run)
    units = capture["launch"]["units"]
    head0, head2 = host("host-0")["address"], host("host-2")["address"]

    say("== cold start: the pair started natively on host-0/host-1 (no coldsnapd)")
    health_s, first_s = cold_start(units)

    say("== capture (unit-0, the head, on host-0; unit-1, headless, on host-1; kept running)")
    cap = coldsnapd("capture", "--request", str(capture_req),
                    receipt=work / "capture-receipt.json")
    before = answers(head0)
    remove_units(PREFIX)

    say("== restore moved onto host-2/host-3")
    moved = coldsnapd("restore", "--request", str(moved_req),
                      receipt=work / "restore-moved-receipt.json")
    moved_answers = answers(head2)
    remove_units(PREFIX)

    say("== restore in place on host-0/host-1")
    in_place = coldsnapd("restore", "--request", str(in_place_req),
                         receipt=work / "restore-in-place-receipt.json")
    in_place_answers = answers(head0)
    (work / "answers.json").write_text(json.dumps(
        {"captured": before, "moved": moved_answers, "in_place": in_place_answers}, indent=1))

    ready = span_max(cap, "capture.start") + span_max(cap, "capture.wait-ready")
    print_table([
        ("cold start, pair natively: to /health", health_s),
        ("cold start, pair natively: to the first answer", first_s),
        ("capture (whole operation)", cap["duration_seconds"]),
        ("capture, once the engine was ready", cap["duration_seconds"] - ready),
        ("restore moved onto host-2/host-3 (whole)", moved["duration_seconds"]),
        ("restore in place on host-0/host-1 (whole)", in_place["duration_seconds"]),
    ])
    print(f"{'cold start / restore moved':<50} {first_s / moved['duration_seconds']:>8.1f}x")
    print(f"{'cold start / restore in place':<50} "
          f"{first_s / in_place['duration_seconds']:>8.1f}x")
    print("\nconnections carried across, per unit:")
    for name, receipt in (("capture", cap), ("moved", moved), ("in place", in_place)):
        show_crossings(name, receipt)
    text = before["completion"][0]["text"]
    chat = before["chat"][0]["message"]["content"]
    print(f"\ncaptured engine (http://{head0}:8000): completion {text!r}, chat {chat!r}")
    ok = True
    for name, got, at in (("moved", moved_answers, head2), ("in place", in_place_answers, head0)):
        verdict = "byte-identical" if same(before, got) else "DIFFERENT"
        ok = ok and same(before, got)
        print(f"restore {name:<9} (http://{at}:8000): completion and chat with logprobs "
              f"{verdict}")
    print(f"\nreceipts and answers: {work}")
    print(f"served now: the in-place restore, http://{head0}:8000/v1 (API key "
          "coldsnap-dev-vllm-key); stop the cluster with `scripts/dev-cluster down`")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
