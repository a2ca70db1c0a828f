"""`coldsnapd serve [--socket PATH] [--state-dir DIR] [--metrics-listen ADDR:PORT]`: the service's
own command line, registered by coldsnap.cli beside the CLI's commands (the service imports
nothing of the CLI)."""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path
from typing import Any

from coldsnap.exits import EXIT_FAILED, report_failure
from coldsnap.formats.service_policy import (
    DEFAULT_POLICY,
    PolicyInvalid,
    ServicePolicy,
    load_service_policy,
)
from coldsnap.hosts.inventory import (
    DEFAULT_INVENTORY,
    InventoryError,
    inventory_path,
    load_inventory,
)
from coldsnap.runner.service_api import DEFAULT_SOCKET
from coldsnap.service.daemon import ServeConfig, ServeError, serve
from coldsnap.store import LocalStore, default_store_root

DEFAULT_STATE_DIR = "/var/lib/coldsnap/service"


def parse_listen(text: str) -> tuple[str, int] | str:
    """(address, port) from `ADDR:PORT` (`[V6]:PORT` for IPv6), or why not."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return f"--metrics-listen {text!r}: must be ADDR:PORT with a port from 1 to 65535"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return f"--metrics-listen {text!r}: {host!r} is not an IP address"
    return host, int(port)


def _handler(args: argparse.Namespace) -> int:
    listen = None
    if args.metrics_listen is not None:
        parsed = parse_listen(args.metrics_listen)
        if isinstance(parsed, str):
            return report_failure(parsed)
        listen = parsed
    if args.drain_seconds < 0 or args.host_check_seconds <= 0:
        return report_failure("--drain-seconds must be 0 or more, --host-check-seconds more than 0")
    inventory = inventory_path(args.inventory).absolute()
    try:
        hosts = load_inventory(inventory)
    except InventoryError as exc:
        return report_failure(str(exc))
    policy: ServicePolicy | None = None
    if args.policy.exists() or args.policy != Path(DEFAULT_POLICY):
        # A file that is named must be read; only the default may be absent.
        try:
            policy = load_service_policy(args.policy)
        except PolicyInvalid as exc:
            for issue in exc.issues:
                sys.stderr.write(f"coldsnapd: {args.policy}: {issue}\n")
            return report_failure(f"serve: the policy {args.policy} is invalid")
    store = LocalStore(args.store if args.store is not None else default_store_root()).ensure()
    config = ServeConfig(
        socket=args.socket.absolute(), state_dir=args.state_dir.absolute(),
        inventory_path=inventory, inventory=hosts, store=store.root.absolute(),
        drain_seconds=args.drain_seconds, metrics_listen=listen,
        socket_group=args.socket_group or None, host_check_s=args.host_check_seconds,
        verbose=args.verbose, policy=policy)
    try:
        return serve(config)
    except (ServeError, OSError) as exc:
        return report_failure(f"serve: {exc}", EXIT_FAILED)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve", help="run the control node's service (systemd Type=notify)",
        description="""Serve the job API (HTTP and JSON) on a unix socket: the CLI's capture,
                    restore, sleep, wake and status submit to it when it answers. Jobs are kept in
                    SQLite under --state-dir; two jobs on the same host and unit, or the same
                    capture, run one after the other. At start, jobs a crash interrupted are rolled
                    back and marked failed (interrupted). SIGTERM stops intake, lets running jobs
                    finish for --drain-seconds, then cancels them (rolled back); exit 0 when every
                    job ended cleanly.""")
    parser.add_argument("--socket", type=Path, default=Path(DEFAULT_SOCKET), metavar="PATH",
                        help=f"""the API socket, mode 0660 (default {DEFAULT_SOCKET}); systemd
                             socket activation is used when it passes one""")
    parser.add_argument("--socket-group", default="coldsnap", metavar="GROUP",
                        help="group owning the socket (default coldsnap; '' keeps root's)")
    parser.add_argument("--policy", type=Path, default=Path(DEFAULT_POLICY), metavar="FILE",
                        help=f"""what submissions may name and who may submit (default
                             {DEFAULT_POLICY}; without that file only root may submit); an invalid
                             file exits 2""")
    parser.add_argument("--state-dir", type=Path, default=Path(DEFAULT_STATE_DIR),
                        metavar="DIR", help=f"the job store (default {DEFAULT_STATE_DIR})")
    parser.add_argument("--metrics-listen", metavar="ADDR:PORT", default=None,
                        help="also serve GET /metrics (Prometheus) on this TCP address")
    parser.add_argument("--drain-seconds", type=float, default=240.0, metavar="S",
                        help="""on SIGTERM, how long running jobs may go on before they are
                             cancelled (default 240)""")
    parser.add_argument("--host-check-seconds", type=float, default=60.0, metavar="S",
                        help="""how often every inventory host is checked over SSH for the
                             coldsnapd_host_reachable metric (default 60)""")
    parser.add_argument(
        "--inventory", type=Path, default=None, metavar="FILE",
        help="host inventory (default: $COLDSNAP_INVENTORY or " + DEFAULT_INVENTORY + ")")
    parser.add_argument(
        "--store", type=Path, default=None, metavar="DIR",
        help="""content-addressed store on this node (default: $COLDSNAP_STORE or
             /var/lib/coldsnap/store)""")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs on stderr")
    parser.set_defaults(handler=_handler)
