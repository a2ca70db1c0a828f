"""The demo's quick run (`scripts/demo --test-engine`): a 2-host dev cluster (real sshd +
dockerd per host, each host in its own network namespace, simulated GPUs), the test capsule,
a TP2 engine (one unit per host, vLLM's HTTP surface on port 8000, its two workers talking
over TCP) captured and restored, then the validation prompt sent from this machine to
http://<host-0 address>:8000/v1/completions and cold start vs capture vs restore time printed
(and, once every object is staged, a restore with no engine running there and one that
replaces the serving engine), with the bytes each host holds (its staged objects, and its
units' CRIU images assembled in its data_dir). The cluster is left up (stop it with
`scripts/dev-cluster down`).

    scripts/demo --test-engine [--shard-bytes N]     (default 256 MiB of weights per worker)
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from devtools.demo_common import (
    REPO,
    STATE,
    coldsnapd,
    inventory_hosts,
    print_table,
    remove_units,
    say,
    sh,
    span_max,
)

PREFIX = "demo-tp2-"


def host_bytes(work: Path, artifact: dict[str, Any], restore_log: Path) -> None:
    """The bytes each host holds of the artifact, and what the first restore sent it."""
    hosts = inventory_hosts()
    unit_host = {u["id"]: u["host"] for u in artifact["launch"]["units"]}
    worker_unit = {w["id"]: w["unit"] for w in artifact["launch"]["execution"]["workers"]}
    owned: dict[str, dict[str, int]] = {h["name"]: {} for h in hosts}
    for obj in artifact["objects"]:
        kind, oid = obj["owner"].split("/", 1)
        if obj["role"] in ("capsule-manifest", "capture-request"):
            continue  # stays on the control node
        h = unit_host[oid if kind == "unit" else worker_unit[oid]]
        owned[h][obj["sha256"]] = obj["bytes"]
    sent = {}
    for line in restore_log.read_text().splitlines():
        if " owned, " in line and "; sent " in line:
            sent[line.split(":", 1)[0]] = line.split("; sent ", 1)[1].split(",", 1)[0]
    print(f"{'host':<8} {'objects owned':>13} {'bytes owned':>14} {'all in data_dir':>16} "
          f"{'sent by this restore':>21}")
    # A unit's CRIU image objects are held assembled: their bytes are in the published image
    # directory, not among the staged objects.
    assembled = set()
    for h in hosts:
        sets = Path(h["data_dir"]) / "criu-images"
        if sets.is_dir() and any(not p.name.startswith(".") for p in sets.iterdir()):
            assembled |= {o["sha256"] for o in artifact["objects"] if o["role"] == "criu-image"
                          and unit_host[o["owner"].split("/", 1)[1]] == h["name"]}
    for h in hosts:
        objs = Path(h["data_dir"]) / "objects" / "sha256"
        mine = owned[h["name"]]
        present = all((objs / d[7:]).is_file() or d in assembled for d in mine)
        print(f"{h['name']:<8} {len(mine):>13} {sum(mine.values()):>14,} "
              f"{'yes' if present else 'NO':>16} {sent.get(h['name'], '-'):>21}")


def ask_restored(artifact: dict[str, Any]) -> None:
    """The restored engine, asked as any client would: over TCP, from this machine."""
    host0 = next(h for h in inventory_hosts() if h["name"] == "host-0")
    unit0 = artifact["launch"]["units"][0]
    port = int(unit0["command"][unit0["command"].index("--port") + 1])
    url = f"http://{host0['address']}:{port}/v1/completions"
    body = {"prompt": "Reply with exactly: coldsnap-cuda-snapshot-ok", "max_tokens": 32,
            "temperature": 0}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 (http only)
        answer = json.loads(resp.read())
    print(f"\nPOST {url}\n  -> {answer['choices'][0]['text']!r} "
          f"(model {answer['model']}, {answer['usage']['completion_tokens']} tokens)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shard-bytes", type=int, default=256 << 20)
    args = ap.parse_args()

    sh([str(REPO / "scripts" / "dev-cluster"), "up", "2"], quiet=True)
    # The engine an earlier demo restored is still serving on these hosts, on the ports this
    # capture needs: it goes first.
    remove_units(PREFIX)
    sh([str(REPO / "scripts" / "dev-requests"), "--shard-bytes", str(args.shard_bytes)],
       quiet=True)
    os.sync()  # the model files are on disk before the capture, as on a real host

    run = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    work = STATE / "demo" / run
    work.mkdir(parents=True)
    # A fresh capture id per run: a capture never replaces an artifact.
    doc = yaml.safe_load((STATE / "requests" / "tp2-two-hosts.yaml").read_text())
    capture_id = f"{PREFIX}{run}"
    doc["id"], doc["output"] = capture_id, str(work / "artifact.json")
    (work / "capture.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))

    say("== capture (TP2: unit-0 on host-0, unit-1 on host-1)")
    cap = coldsnapd("capture", "--request", str(work / "capture.yaml"),
                    receipt=work / "capture-receipt.json")
    say("== restore")
    res = coldsnapd("restore", "--artifact", capture_id,
                    receipt=work / "restore-receipt.json", log=work / "restore.log")
    # Again, now that every object is staged on its host and, as before a cold start, no
    # engine runs there: what a restore costs on a warm host.
    remove_units(PREFIX)
    say("== restore again (warm hosts, nothing running)")
    warm = coldsnapd("restore", "--artifact", capture_id,
                     receipt=work / "restore-warm-receipt.json")
    # Once more, replacing the engine that restore left serving (stopped while the new
    # containers start, removed once the new engine answers).
    say("== restore again (warm hosts, replacing the serving engine)")
    replacing = coldsnapd("restore", "--artifact", capture_id,
                          receipt=work / "restore-replacing-receipt.json")

    cold = span_max(cap, "capture.start") + span_max(cap, "capture.wait-ready")
    print_table([
        ("cold start (container start -> engine healthy)", cold),
        ("capture (whole operation)", cap["duration_seconds"]),
        ("restore (whole operation)", res["duration_seconds"]),
        ("restore: units started -> prompt answered",
         sum(span_max(res, f"restore.{s}") for s in
             ("start-restore", "criu-restore", "release", "validate"))),
        ("restore on warm hosts, nothing running (whole)", warm["duration_seconds"]),
        ("restore on warm hosts, replacing (whole)", replacing["duration_seconds"]),
    ])
    print(f"{'cold start / warm-host restore':<50} {cold / warm['duration_seconds']:>8.1f}x")
    print(f"{'cold start / warm-host restore, replacing':<50} "
          f"{cold / replacing['duration_seconds']:>8.1f}x")
    print()
    artifact = json.loads((work / "artifact.json").read_text())
    host_bytes(work, artifact, work / "restore.log")
    print(f"\nreceipts: {work}/capture-receipt.json {work}/restore-receipt.json "
          f"{work}/restore-warm-receipt.json {work}/restore-replacing-receipt.json")
    ask_restored(artifact)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
