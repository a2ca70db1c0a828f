"""`coldsnapd plan --request-json PATH|- [--json]`: what an operation would do, without any host.

Resolves the execution graph of a valid request: every worker with its unit, host, service,
global rank, process slot and devices, and per host the units and workers it runs and the
artifact objects it owns (produced there at capture, staged there at restore).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from coldsnap.commands.validate import checked_request, emit_json, register_request_command
from coldsnap.exits import EXIT_OK
from coldsnap.formats.request import Request
from coldsnap.topology import Topology, resolve

HELP = "show the resolved execution graph and the objects each host owns"
DESCRIPTION = """\
Resolve a request's execution graph without touching any host: worker -> unit -> host,
each worker's global rank (its position in its *:world group), its process slot inside the
unit and the devices its slots select, and per host exactly the objects it owns:
one oci-capsule and its criu-image objects per unit (the oci-capsule only when no registry
carries the capsule; the CRIU images as one or more chunks), and each worker's
model-weight-payload and replay-plan only on the host of the worker's unit. Nothing is
inferred from parallel sizes.

An invalid request exits 2 with the same `PATH: message` lines as `coldsnapd validate`.
With --json the document is
  {"request_sha256", "operation", "workers": [{"id", "unit", "host", "service", "global_rank",
   "process_slot", "device_slots", "devices"}],
   "hosts": {HOST: {"units": [...], "workers": [...], "objects": [{"owner", "role"}]}}}
"""


def plan_document(req: Request, topo: Topology) -> dict[str, Any]:
    workers = []
    for w in topo.workers:
        entry = w.to_json()
        del entry["world_size"]
        workers.append(entry)
    return {
        "request_sha256": req.request_sha256,
        "operation": req.operation,
        "workers": workers,
        "hosts": {
            host: {
                "units": [u.id for u in topo.units_on(host)],
                "workers": [w.id for w in topo.workers_on(host)],
                "objects": [o.to_json() for o in topo.objects_for_host(host)],
            }
            for host in topo.hosts
        },
    }


def _table(rows: list[list[str]], indent: str) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def plan_text(req: Request, topo: Topology) -> str:
    launch = req.launch
    lines = [
        f"{req.operation} {req.id}: {launch.engine} {launch.model.id}@{launch.model.revision}, "
        f"snapshot driver {req.snapshot_driver.id}",
        f"request_sha256 {req.request_sha256}",
        f"{len(topo.hosts)} host(s), {len(topo.units)} unit(s), {len(topo.workers)} worker(s), "
        f"{len(topo.services)} service(s), {len(topo.groups)} group(s)",
    ]
    for host in topo.hosts:
        lines.append("")
        lines.append(f"host {host}")
        for unit in topo.units_on(host):
            lines.append(f"  unit {unit.id} (index {unit.index}), devices {','.join(unit.devices)}")
            rows = [["WORKER", "SERVICE", "RANK", "SLOT", "DEVICE_SLOTS", "DEVICES"]]
            for wid in unit.workers:
                w = topo.worker(wid)
                rows.append([w.id, w.service, f"{w.global_rank}/{w.world_size}",
                             str(w.process_slot), ",".join(map(str, w.device_slots)),
                             ",".join(w.devices)])
            lines.extend(_table(rows, "    "))
        lines.append("  objects")
        rows = [["OWNER", "ROLE"]] + [[str(o.owner), o.role] for o in topo.objects_for_host(host)]
        lines.extend(_table(rows, "    "))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = checked_request(args, summary=False)
    if isinstance(result, int):
        return result
    topo = resolve(result)
    if args.json:
        emit_json(plan_document(result, topo))
    else:
        sys.stdout.write(plan_text(result, topo) + "\n")
    return EXIT_OK


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    register_request_command(subparsers, "plan", HELP, DESCRIPTION, run)
