"""A local cluster of simulated coldsnap hosts (run through scripts/dev-cluster).

    scripts/dev-cluster up N [--no-docker] [--gpus N] [--link-mbit R] [--registry-mbit R2]
                             [--cache-budget SIZE|none] start (or converge to) N hosts
    scripts/dev-cluster down [--purge]                  stop and remove everything it made;
                                                        --purge: and every file it wrote
    scripts/dev-cluster shape R [--registry-mbit R2]    shape the links (0 = unshaped)
    scripts/dev-cluster link-bytes                      JSON byte counters: control, registry
    scripts/dev-cluster stop-host NAME                  kill one host's sshd (a lost host)
    scripts/dev-cluster start-host NAME                 bring that sshd back
    scripts/dev-cluster partition-host NAME             cut a host's link (processes keep running)
    scripts/dev-cluster heal-host NAME                  reconnect it
    scripts/dev-cluster stop-docker NAME                stop one host's dockerd
    scripts/dev-cluster start-docker NAME               start it again (images kept)
    scripts/dev-cluster status                          one line per host, and the registry

Each host has its own network namespace (csd-host-N, address 198.18.0.{N+2} on interface ensN),
joined by a veth pair (csd-hN) to the bridge csd-br0 (198.18.0.1/24), with its own sshd and
(optionally) its own dockerd inside. The registry host (devtools/registry_host.py) is one more
namespace on the bridge, csd-registry at 198.18.0.254 (for the default network base), running
the plain registry on :5000. `up` writes .dev-cluster/inventory.yaml and prints its path as the
last line of stdout. With Docker it also builds the test capsule (cached), pushes it to the
registry host and writes ready-to-run requests into .dev-cluster/requests/ (dev-requests).
Idempotent: running `up` again reuses keys, GPU UUIDs, Docker image stores and the registry's
storage, and only starts what is not running. `--link-mbit R` shapes every host's link and the
control node's to R Mbit/s, `--registry-mbit R2` the registry's (devtools/shaping.py; absent or
0: unshaped; the registry stays unshaped unless asked).
Environment: COLDSNAP_DEV_CLUSTER_DIR (state, default .dev-cluster), COLDSNAP_DEV_SSH_PORT
(default 22), COLDSNAP_DEV_NET_BASE (a second cluster's first address slot; default 0, or,
when another checkout's cluster holds base 0's namespaces, the first free one of 160, 168,
... that `up` picks and records in the state's net-base file),
COLDSNAP_DEV_LINK_MBIT / COLDSNAP_DEV_REGISTRY_MBIT (defaults of the two rate options),
COLDSNAP_DEV_CACHE_BUDGET (each host's inventory `cache_budget`, default 4GiB; `none`: none).
`down` keeps the state (keys, image stores, data_dirs) for the next `up`; `down --purge`
removes all of it (devtools/purge.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from devtools import net, procs, registry_host, services, shaping
from devtools import purge as purging
from devtools.layout import (
    AUTO_NET_BASES,
    BRIDGE,
    OWNERS_DIR,
    REPO,
    HostNet,
    HostPaths,
    Layout,
    UsageError,
    fits,
    host_index,
    host_name,
    namespaces_of,
)
from devtools.render import (
    ClusterShape,
    InventoryHost,
    UpArgs,
    inventory_yaml,
    known_hosts_line,
    parse_up_args,
    rate_options,
    sshd_config,
)
from devtools.services import log

COMMANDS = ("up", "down", "stop-host", "start-host", "partition-host", "heal-host",
            "stop-docker", "start-docker", "status", "shape", "link-bytes")


class ClusterError(RuntimeError):
    """Something the cluster could not do; the CLI prints it and exits 1."""


def usage() -> str:
    return (__doc__ or "").split("\n\n", 2)[1].replace("    scripts/", "scripts/")


# --- setup pieces ------------------------------------------------------------------------------


def ensure_packages(docker: bool) -> None:
    missing: list[str] = []
    if not Path(services.SSHD).exists():
        missing.append("openssh-server")
    if shutil.which("ssh-keygen") is None:
        missing.append("openssh-client")
    if shutil.which("ip") is None:
        missing.append("iproute2")
    if docker and shutil.which("dockerd") is None:
        missing.append("docker.io")
    if shutil.which("docker-registry") is None:  # the registry host's, with or without Docker
        missing.append("docker-registry")
    if missing:
        log(f"installing {' '.join(missing)}")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (["apt-get", "update", "-qq"],
                     ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):
            subprocess.run(argv, env=env, stdout=sys.stderr, check=True)


def keygen(path: Path, comment: str) -> None:
    if path.exists() and path.stat().st_size > 0:
        return
    path.unlink(missing_ok=True)
    path.with_suffix(".pub").unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment,
                    "-f", str(path)], check=True)


def ensure_client_key(layout: Layout) -> None:
    client = layout.client_key.parent
    client.mkdir(parents=True, exist_ok=True)
    layout.state.chmod(0o700)
    client.chmod(0o700)
    keygen(layout.client_key, "coldsnap-dev-cluster")
    shutil.copyfile(layout.client_key.with_suffix(".pub"), layout.authorized_keys)
    layout.authorized_keys.chmod(0o600)


def ensure_gpus(paths: HostPaths, count: int) -> list[str]:
    """The first `count` of the host's GPU UUIDs, generated once and kept."""
    have = paths.gpu_uuids.read_text().split() if paths.gpu_uuids.exists() else []
    while len(have) < count:
        have.append(f"GPU-{uuid.uuid4()}")
    paths.gpu_uuids.write_text("".join(f"{u}\n" for u in have))
    return have[:count]


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def run_script(name: str, layout: Layout) -> None:
    """A repo script, its stdout to our stderr (our stdout ends with the inventory path). The
    running Python goes first on PATH, so python scripts get the venv's modules; the cluster's
    state and network base are passed on, so the capsule builds push to its registry host."""
    env = dict(os.environ, COLDSNAP_DEV_CLUSTER_DIR=str(layout.state),
               COLDSNAP_DEV_NET_BASE=str(layout.net_base))
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    r = subprocess.run([str(REPO / "scripts" / name)], env=env, stdout=sys.stderr, check=False)
    if r.returncode != 0:
        raise ClusterError(f"scripts/{name} failed (exit {r.returncode})")


# --- one host ----------------------------------------------------------------------------------


def host_paths(layout: Layout, name: str) -> HostPaths:
    return HostPaths(layout.host_dir(name))


def existing_host(layout: Layout, name: str) -> tuple[HostNet, HostPaths]:
    """A host named on the command line: a valid name with state, else a UsageError."""
    index = host_index(name)
    paths = host_paths(layout, name)
    if not paths.sshd_config.exists():
        raise UsageError(f"no such host: {name}")
    return layout.net(index), paths


def stop_host_fully(layout: Layout, name: str) -> None:
    """sshd, dockerd, whatever else runs in the namespace, then the namespace and its links
    (only those this cluster made: never another cluster's)."""
    hn = layout.net(host_index(name))
    paths = host_paths(layout, name)
    services.stop_sshd(paths)
    services.stop_dockerd(paths)
    if net.owner(hn) == str(layout.state):
        _kill_namespace(hn.netns)
        net.remove_host_net(hn, layout.state)


def _kill_namespace(netns: str) -> None:
    left = net.netns_pids(netns)
    if left:
        log(f"{netns}: stopping {len(left)} leftover process(es)")
        procs.terminate(left, grace=5)


def net_base_file(layout: Layout) -> Path:
    return layout.state / "net-base"


def resolve_net_base(layout: Layout, for_up: bool) -> Layout:
    """The network base a cluster was made with wins over the environment: its namespaces are
    found by it. Only `up` on a cluster without namespaces (after `down`) may change it."""
    try:
        recorded = int(net_base_file(layout).read_text().strip())
    except (FileNotFoundError, ValueError):
        return layout
    if recorded == layout.net_base:
        return layout
    env_set = bool(os.environ.get("COLDSNAP_DEV_NET_BASE"))
    if net.owned_namespaces(layout.state):
        if env_set:
            raise UsageError(
                f"the cluster in {layout.state} runs with COLDSNAP_DEV_NET_BASE={recorded}; "
                "run `down` first to change it")
        return replace(layout, net_base=recorded)
    if for_up and env_set:
        return layout
    return replace(layout, net_base=recorded)


def foreign_namespaces(layout: Layout, base: int, hosts: int) -> dict[str, str]:
    """The namespaces that another cluster (or something else) made where a cluster of
    `hosts` hosts on `base` would make its own: name -> owner."""
    mine = str(layout.state)
    found: dict[str, str] = {}
    for name in namespaces_of(base, hosts):
        if net.netns_exists(name):
            owner = net.owner_of(name)
            if owner != mine:
                found[name] = owner or "unknown"
    return found


def choose_net_base(layout: Layout, hosts: int) -> Layout:
    """The base `up` makes its cluster on. One the environment names, or this cluster already
    holds namespaces on, is kept (a clash then fails naming the namespace, as before). Else,
    when another checkout's cluster holds the default's namespaces, the first free base of
    AUTO_NET_BASES: CI's fresh clone then runs beside a developer's cluster instead of failing
    on it; every tool finds the base in the state's net-base file."""
    if os.environ.get("COLDSNAP_DEV_NET_BASE") or net.owned_namespaces(layout.state):
        return layout
    taken = foreign_namespaces(layout, layout.net_base, hosts)
    if not taken:
        return layout
    for base in AUTO_NET_BASES:
        if fits(base, hosts) and not foreign_namespaces(layout, base, hosts):
            name, owner = next(iter(taken.items()))
            log(f"network base {layout.net_base} is taken ({name}: {owner}); this cluster "
                f"uses base {base} (COLDSNAP_DEV_NET_BASE picks one)")
            return replace(layout, net_base=base)
    raise UsageError(f"no free network base for {hosts} hosts: {', '.join(sorted(taken))} and "
                     "every other candidate are taken; stop another cluster first")


# --- commands ----------------------------------------------------------------------------------


def cmd_up(layout: Layout, args: UpArgs) -> int:
    ensure_packages(args.docker)
    ensure_client_key(layout)
    write_atomic(net_base_file(layout), f"{layout.net_base}\n")
    write_atomic(layout.cluster_env, ClusterShape(args.hosts, args.docker, args.gpus).render())

    # Converge: hosts beyond N (from an earlier, larger `up`) are stopped and unplugged.
    for name in layout.known_host_names():
        if host_index(name) >= args.hosts:
            stop_host_fully(layout, name)

    net.ensure_bridge()
    reg = layout.registry
    registry_host.ensure_host(reg, layout.state)
    if registry_host.ensure_plain(reg, layout.registry_dir):
        log(f"registry on {reg.plain} (namespace {reg.netns}, storage "
            f"{layout.registry_dir / 'data'})")
    auth = registry_host.start_auth(reg, layout.registry_dir)
    inv: list[InventoryHost] = []
    for i in range(args.hosts):
        name = host_name(i)
        hn = layout.net(i)
        paths = host_paths(layout, name)
        for d in (paths.dir, paths.ssh, paths.data):
            d.mkdir(parents=True, exist_ok=True)
        paths.dir.chmod(0o700)
        paths.ssh.chmod(0o700)
        keygen(paths.host_key, name)
        net.ensure_host_net(hn, layout.state)
        services.write_sshd_config(paths, sshd_config(layout, hn, paths))
        gpus = ensure_gpus(paths, args.gpus)
        services.start_sshd(hn, paths)
        if args.docker:
            services.start_dockerd(hn, paths, reg.plain)
        else:
            services.stop_dockerd(paths)
        inv.append(InventoryHost(hn, paths, gpus))
    if args.docker:
        for h in inv:
            services.wait_dockerd(h.net.name, h.paths)

    write_atomic(layout.known_hosts, "".join(
        known_hosts_line(h.net.address, layout.ssh_port,
                         h.paths.host_key.with_suffix(".pub").read_text()) + "\n"
        for h in inv))
    write_atomic(layout.inventory, inventory_yaml(layout, inv, args.docker, auth,
                                                       args.cache_budget))
    if args.docker:
        # Ready-to-run requests need the capsule's digest: build (cached) and publish it first.
        run_script("build-test-capsule", layout)
        run_script("dev-requests", layout)
    # Shaped last: the capsule push above is not a benchmark.
    rates = shaping.LinkRates(args.link_mbit, args.registry_mbit)
    shaping.apply([h.net for h in inv], reg, rates)
    log(f"{args.hosts} host(s) up (docker: {'yes' if args.docker else 'no'}, "
        f"gpus/host: {args.gpus}, hosts on {layout.net(0).address}.."
        f"{layout.net(args.hosts - 1).address}, registry {reg.plain}, {rates.describe()})")
    print(layout.inventory, flush=True)
    return 0


def cmd_down(layout: Layout, purge: bool = False) -> int:
    if purge:
        purging.check_markers(layout.state)  # before anything stops: a wrong directory
    names = layout.known_host_names()
    for name in names:
        services.stop_sshd(host_paths(layout, name))
    # Engines take seconds each to shut down; stop them side by side.
    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        list(pool.map(lambda n: services.stop_dockerd(host_paths(layout, n)), names))
    # The registry host and its registries (their storage stays for the next `up`).
    for what in registry_host.stop(layout.registry, layout.registry_dir, layout.state):
        log(f"{what} stopped")
    # Processes still in a namespace (started over ssh with setsid, say) would outlive
    # `ip netns del`; then every namespace and link this cluster made goes.
    for name in names:
        stop_host_fully(layout, name)
    for netns in net.owned_namespaces(layout.state):
        _kill_namespace(netns)
        net.remove_netns_by_name(netns)
    with contextlib.suppress(OSError):  # empty once no cluster holds a namespace
        OWNERS_DIR.rmdir()
    if net.remove_bridge_if_unused():
        # The control node's link went with it; its ingress shaping device too.
        if net.link(shaping.IFB) is not None:
            net.ip("link", "del", shaping.IFB)
        log(f"bridge {BRIDGE} removed")
    elif net.link(BRIDGE) is not None:
        log(f"bridge {BRIDGE} kept: another cluster still uses it "
            f"({', '.join(net.bridge_ports())})")
    layout.cluster_env.unlink(missing_ok=True)
    log("down")
    if purge:
        freed = purging.purge(layout.state)
        log(f"purged {layout.state} ({freed / 1e9:.1f} GB)")
    return 0


def cmd_stop_host(layout: Layout, name: str) -> int:
    _, paths = existing_host(layout, name)
    services.stop_sshd(paths)
    log(f"{name}: sshd stopped")
    return 0


def cmd_start_host(layout: Layout, name: str) -> int:
    hn, paths = existing_host(layout, name)
    if not net.netns_exists(hn.netns):
        raise ClusterError(f"{name}: namespace {hn.netns} missing; run scripts/dev-cluster up")
    services.start_sshd(hn, paths)
    log(f"{name}: sshd started")
    return 0


def cmd_docker(layout: Layout, name: str, up: bool) -> int:
    hn, paths = existing_host(layout, name)
    if up:
        services.start_dockerd(hn, paths, layout.registry.plain)
        services.wait_dockerd(name, paths)
    else:
        services.stop_dockerd(paths)
    log(f"{name}: dockerd {'started' if up else 'stopped'}")
    return 0


def cmd_link(layout: Layout, name: str, up: bool) -> int:
    hn, _ = existing_host(layout, name)
    net.set_link(hn, up)
    log(f"{name}: link {hn.veth_root} {'up (healed)' if up else 'down (partitioned)'}")
    return 0


def cmd_shape(layout: Layout, argv: Sequence[str]) -> int:
    if not argv or not argv[0].isdigit():
        raise UsageError("shape needs a rate in Mbit/s (0 = unshaped): "
                         "shape R [--registry-mbit R2]")
    # The environment's defaults are for `up`: `shape` sets exactly what it is given.
    rest, link_mbit, registry_mbit = rate_options(["--link-mbit", *argv], env={})
    if rest:
        raise UsageError(f"shape: unexpected argument {rest[0]!r}")
    names = [n for n in layout.known_host_names()
             if net.netns_exists(layout.net(host_index(n)).netns)]
    if not names:
        raise ClusterError("no host is up: run scripts/dev-cluster up first")
    reg = layout.registry
    rates = shaping.LinkRates(link_mbit, registry_mbit)
    shaping.apply([layout.net(host_index(n)) for n in names],
                  reg if net.netns_exists(reg.netns) else None, rates)
    log(f"{len(names)} host(s): {rates.describe()}")
    return 0


def cmd_link_bytes(layout: Layout) -> int:
    reg = layout.registry
    if not net.netns_exists(reg.netns):
        raise ClusterError(f"no registry host ({reg.netns}): run scripts/dev-cluster up first")
    print(json.dumps(shaping.link_bytes(reg), sort_keys=True))
    return 0


def status_line(layout: Layout, name: str) -> str:
    hn = layout.net(host_index(name))
    paths = host_paths(layout, name)
    sshd = "up" if procs.pid_alive(paths.sshd_pid) else "down"
    dockerd = "up" if services.dockerd_running(paths) else "down"
    return (f"{name:<8} {hn.address:<13} sshd={sshd:<4} dockerd={dockerd:<4} "
            f"link={net.link_state(hn)}")


def cmd_status(layout: Layout) -> int:
    names = layout.known_host_names()
    for name in names:
        print(status_line(layout, name))
    if not names:
        print("no hosts (run: scripts/dev-cluster up 4)")
    reg = layout.registry
    if net.netns_exists(reg.netns):
        up = "up" if registry_host.answers(reg.plain, timeout=1) else "down"
        print(f"{'registry':<8} {reg.address:<13} registry={up:<4} "
              f"link={net.link_state(reg)}")
    if layout.inventory.exists() and layout.cluster_env.exists():
        print(layout.inventory)
    return 0


def dispatch(layout: Layout, argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        raise UsageError("")
    cmd, rest = argv[0], list(argv[1:])
    if cmd not in COMMANDS:
        raise UsageError(f"unknown command {cmd!r}")
    layout = resolve_net_base(layout, for_up=cmd == "up")
    if cmd == "up":
        up = parse_up_args(rest, layout.net_base)
        return cmd_up(choose_net_base(layout, up.hosts), up)
    if cmd == "shape":
        return cmd_shape(layout, rest)
    if cmd == "down" and rest in ([], ["--purge"]):
        return cmd_down(layout, purge=bool(rest))
    if cmd in ("down", "status", "link-bytes"):
        if rest:
            raise UsageError(f"{cmd} takes no arguments" if cmd != "down"
                             else "down takes only --purge")
        if cmd == "link-bytes":
            return cmd_link_bytes(layout)
        return cmd_down(layout) if cmd == "down" else cmd_status(layout)
    if len(rest) != 1:
        raise UsageError(f"{cmd} needs exactly one host name")
    host_index(rest[0])
    if cmd == "stop-host":
        return cmd_stop_host(layout, rest[0])
    if cmd == "start-host":
        return cmd_start_host(layout, rest[0])
    if cmd in ("stop-docker", "start-docker"):
        return cmd_docker(layout, rest[0], up=cmd == "start-docker")
    return cmd_link(layout, rest[0], up=cmd == "heal-host")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        layout = Layout.from_env()
        if args and args[0] not in ("-h", "--help", "help") and os.geteuid() != 0:
            raise ClusterError("must run as root (it makes network namespaces, starts sshd "
                               "and dockerd)")
        return dispatch(layout, args)
    except UsageError as exc:
        if str(exc):
            log(f"error: {exc}")
        print(usage(), file=sys.stderr)
        return 2
    except (ClusterError, purging.PurgeError, net.NetError, services.ServiceError,
            registry_host.RegistryError, subprocess.CalledProcessError,
            subprocess.TimeoutExpired) as exc:
        log(f"error: {exc}")
        return 1
    except BrokenPipeError:  # `status | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
