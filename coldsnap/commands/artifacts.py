"""`coldsnapd artifacts list|show`: the artifacts in the local store."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from coldsnap.commands.common import (
    add_store_argument,
    open_store,
    print_json,
)
from coldsnap.exits import EXIT_FAILED, EXIT_OK, report_failure
from coldsnap.formats.errors import ArtifactInvalid
from coldsnap.runner.report import human_bytes
from coldsnap.store import LocalStore, StoredArtifact, StoreError, resolve_reference


def _summary(store: LocalStore, stored: StoredArtifact) -> dict[str, Any]:
    a = stored.artifact
    return {
        "capture_id": a.capture_id,
        "digest": stored.digest,
        "engine": a.launch.engine,
        "model": a.launch.model.id,
        "snapshot_driver": a.snapshot_driver.id,
        "units": len(a.launch.units),
        "workers": len(a.launch.execution.workers),
        "bytes": sum(o.bytes for o in a.objects),
        "published": _published(store, stored),
    }


def _published(store: LocalStore, stored: StoredArtifact) -> list[str]:
    """Where the artifact is published; an unreadable record is said, not fatal."""
    try:
        return [f"{ref}" + (" (native)" if kind == "native" else "")
                for ref, kind in store.publication_records(stored.capture_id)]
    except StoreError as exc:
        return [f"unknown: {exc}"]



def _list(args: argparse.Namespace) -> int:
    try:
        store = open_store(args)
        stored, bad = store.scan_artifacts()
    except (StoreError, ValueError) as exc:
        return report_failure(str(exc), EXIT_FAILED)
    rows = [_summary(store, s) for s in stored]
    # The good ones are listed all the same; each bad index file is named, and the exit
    # status says the store needs a look.
    status = EXIT_FAILED if bad else EXIT_OK
    for path, why in bad:
        report_failure(f"unreadable artifact index file {path}: {why}", EXIT_FAILED)
    if args.json:
        print_json(rows)
        return status
    if not rows:
        sys.stdout.write("no artifacts\n")
        return status
    sys.stdout.write(f"{'CAPTURE ID':<32} {'DIGEST':<19} {'ENGINE':<7} {'UNITS':>5} "
                     f"{'WORKERS':>7} {'SIZE':>10}\n")
    for r in rows:
        sys.stdout.write(f"{r['capture_id']:<32} {r['digest'][:19]:<19} {r['engine']:<7} "
                         f"{r['units']:>5} {r['workers']:>7} {human_bytes(r['bytes']):>10}\n")
    return status


def _show(args: argparse.Namespace) -> int:
    try:
        store = open_store(args)
        stored = resolve_reference(store, args.artifact)
    except (StoreError, ArtifactInvalid, ValueError) as exc:
        return report_failure(str(exc), EXIT_FAILED)
    if args.json:
        print_json(stored.artifact.to_json())
        return EXIT_OK
    a = stored.artifact
    out = sys.stdout
    out.write(f"capture id:      {a.capture_id}\n")
    out.write(f"digest:          {stored.digest}\n")
    out.write(f"request:         {a.request_sha256}\n")
    out.write(f"engine / model:  {a.launch.engine} {a.launch.model.id}@{a.launch.model.revision}\n")
    out.write(f"snapshot driver: {a.snapshot_driver.id} (driver >= "
              f"{a.snapshot_driver.minimum_driver_major})\n")
    for unit in a.launch.units:
        compat = a.compatibility_unit(unit.id)
        gpus = ", ".join(f"{d.gpu_name} ({d.compute_capability})" for d in compat.devices)
        out.write(f"unit {unit.id}: captured on {unit.host}, {compat.architecture}, driver "
                  f"{compat.nvidia_driver_captured}, {gpus}\n")
    for ref in _published(store, stored):
        out.write(f"published:       {ref}\n")
    out.write(f"{'OWNER':<24} {'ROLE':<22} {'SIZE':>10}  SHA256\n")
    for obj in a.objects:
        out.write(f"{obj.owner:<24} {obj.role:<22} {human_bytes(obj.bytes):>10}  "
                  f"{obj.sha256[:19]}\n")
    return EXIT_OK


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "artifacts", help="list and inspect artifacts in the local store",
        description="""List the artifacts in the local content-addressed store, or show one by
                    capture id, by an unambiguous prefix of its digest, or by the path of its
                    artifact file (verified, and imported when the store does not index it yet).""")
    sub = parser.add_subparsers(dest="artifacts_command", metavar="ACTION", required=True)
    p_list = sub.add_parser("list", help="one line per artifact")
    p_show = sub.add_parser("show", help="one artifact: units, compatibility, objects")
    p_show.add_argument("artifact", metavar="REF",
                        help="capture id, digest prefix (6+ hex) or artifact file path")
    for p, handler in ((p_list, _list), (p_show, _show)):
        add_store_argument(p)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(handler=handler)
