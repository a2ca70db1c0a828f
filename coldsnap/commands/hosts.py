"""`coldsnapd hosts ...`: probe hosts of an inventory, copy files to and from one host."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from coldsnap.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from coldsnap.hosts.base import HostError
from coldsnap.hosts.inventory import InventoryError, load_inventory
from coldsnap.hosts.pool import HostPool
from coldsnap.hosts.probe import HostProbe, probe_pool
from coldsnap.logs import configure as configure_logging
from coldsnap.progress import TransferProgress

# `hosts get` names no object, so no size is known: the cap it holds the host to.
GET_MAX_BYTES = 1 << 40

def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "hosts",
        help="probe hosts, copy files to/from a host",
        description="Work with the hosts of an inventory file.",
    )
    sub = parser.add_subparsers(dest="hosts_command", metavar="ACTION", required=True)

    probe = sub.add_parser(
        "probe",
        help="report facts about every host (arch, kernel, Docker, NVIDIA driver, GPUs, disk)",
        description="""Probe hosts concurrently. Exit 1 when any host is unreachable or its probe
                    failed, 2 on a bad inventory.""",
    )
    probe.add_argument("--inventory", required=True, type=Path, metavar="FILE")
    probe.add_argument("--json", action="store_true", help="one JSON document on stdout")
    probe.add_argument(
        "--host", action="append", dest="hosts", metavar="NAME", help="only this host (repeatable)"
    )
    probe.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS")
    probe.set_defaults(handler=_probe)

    for name, helptext in (
        ("put", "copy a local file to a host"),
        ("get", "copy a file from a host"),
    ):
        p = sub.add_parser(
            name, help=helptext, description=helptext + " (sha256-verified, atomic, resumable)"
        )
        p.add_argument("--inventory", required=True, type=Path, metavar="FILE")
        p.add_argument("host", metavar="HOST")
        p.add_argument("source", metavar="SRC")
        p.add_argument("dest", metavar="DEST")
        if name == "get":
            p.add_argument("--max-bytes", type=int, default=GET_MAX_BYTES, metavar="N",
                           help=f"""refuse a file the host says is larger, before writing anything
                                (default {GET_MAX_BYTES})""")
        p.set_defaults(handler=_transfer, direction=name)


def _load(args: argparse.Namespace) -> Any:
    # Logs go to stderr, so `--json` output on stdout stays clean.
    configure_logging()
    try:
        return load_inventory(args.inventory)
    except InventoryError as exc:
        print(f"coldsnapd: bad inventory {exc.path}:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return None


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}G"


def _print_table(facts: list[HostProbe]) -> None:
    for f in facts:
        if not f.reachable:
            print(f"{f.host:<12} UNREACHABLE  {f.error}")
            continue
        if f.error:
            print(f"{f.host:<12} ERROR        {f.error}")
            continue
        gpus = ", ".join(f"{g.name} ({g.compute_capability}) {g.uuid}" for g in f.gpus) or "none"
        sim = " [simulated]" if f.simulated else ""
        print(
            f"{f.host:<12} {f.arch} linux {f.kernel}  docker {f.docker or '-'}  "
            f"driver {f.nvidia_driver or '-'}{sim}  free {_gib(f.data_dir_free_bytes)}"
        )
        print(f"{'':<12} gpus: {gpus}")
        for note in f.notes:
            print(f"{'':<12} note: {note}")


def _probe(args: argparse.Namespace) -> int:
    inventory = _load(args)
    if inventory is None:
        return EXIT_BAD_INPUT
    try:
        names = args.hosts or inventory.names
        for n in names:
            inventory.get(n)
    except KeyError as exc:
        print(f"coldsnapd: {exc.args[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT

    async def go() -> list[HostProbe]:
        async with HostPool(inventory) as pool:
            return await probe_pool(pool, names, timeout=args.timeout)

    facts = asyncio.run(go())
    if args.json:
        json.dump([f.to_json() for f in facts], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_table(facts)
    bad = [f.host for f in facts if not f.reachable or f.error]
    if bad:
        print(
            f"coldsnapd: {len(bad)} of {len(facts)} host(s) failed: {', '.join(bad)}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_OK


def _transfer(args: argparse.Namespace) -> int:
    inventory = _load(args)
    if inventory is None:
        return EXIT_BAD_INPUT
    try:
        inventory.get(args.host)
    except KeyError as exc:
        print(f"coldsnapd: {exc.args[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    progress = TransferProgress(f"{args.direction} {args.host}")

    async def go() -> str:
        async with HostPool(inventory) as pool:
            host = pool.host(args.host)
            if args.direction == "put":
                r = await host.put(Path(args.source), args.dest, progress=progress)
            else:
                r = await host.get(args.source, Path(args.dest), progress=progress,
                                   max_bytes=args.max_bytes)
            return f"{r.sha256} {r.bytes} bytes ({r.sent_bytes} sent)"

    try:
        with progress:
            print(asyncio.run(go()))
    except HostError as exc:
        print(f"coldsnapd: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as exc:
        print(f"coldsnapd: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK
