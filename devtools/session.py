"""Use the dev cluster from another script: start it when it is not up, stop it afterwards only
when this script started it (the benchmarks do this).

    with dev_cluster(hosts=2, docker=True) as inventory_path:
        ...
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from devtools import net, procs
from devtools.layout import REPO, HostPaths, Layout, host_index
from devtools.render import ClusterShape

DEV_CLUSTER = REPO / "scripts" / "dev-cluster"


class ClusterUnfit(RuntimeError):
    """The dev cluster is up but smaller than needed (or without Docker): it is shared, so it is
    not reshaped behind its users' backs."""


@dataclass(frozen=True)
class ClusterState:
    shape: ClusterShape | None  # what the last `up` asked for; None after `down`
    running: list[str]  # hosts with a live sshd or dockerd
    ready: list[str]  # hosts with sshd up, link up and (when the shape has Docker) dockerd up


def cluster_state(layout: Layout) -> ClusterState:
    try:
        shape: ClusterShape | None = ClusterShape.parse(layout.cluster_env.read_text())
    except (FileNotFoundError, ValueError):
        shape = None
    running: list[str] = []
    ready: list[str] = []
    for name in layout.known_host_names():
        paths = HostPaths(layout.host_dir(name))
        sshd = procs.pid_alive(paths.sshd_pid) is not None
        dockerd = procs.pid_alive(paths.docker_pid) is not None
        if sshd or dockerd:
            running.append(name)
        link_up = net.link_state(layout.net(host_index(name))) == "up"
        if sshd and link_up and (dockerd or not (shape and shape.docker)):
            ready.append(name)
    return ClusterState(shape, running, ready)


def _fits(state: ClusterState, hosts: int, docker: bool, layout: Layout) -> bool:
    if state.shape is None or state.shape.hosts < hosts or (docker and not state.shape.docker):
        return False
    need = [f"host-{i}" for i in range(hosts)]
    if docker and not (layout.state / "test-capsule.ref").exists():
        return False
    return layout.inventory.exists() and all(n in state.ready for n in need)


def _run(layout: Layout, *args: str) -> str:
    env = dict(os.environ, COLDSNAP_DEV_CLUSTER_DIR=str(layout.state))
    r = subprocess.run([str(DEV_CLUSTER), *args], env=env, stdout=subprocess.PIPE,
                       stderr=sys.stderr, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"scripts/dev-cluster {' '.join(args)} failed (exit {r.returncode})")
    return r.stdout


@contextmanager
def dev_cluster(hosts: int, *, docker: bool, layout: Layout | None = None) -> Iterator[Path]:
    """Yields the inventory of a dev cluster with at least `hosts` hosts (and Docker plus the
    test capsule when `docker`). When none is running, starts one (`up hosts`) and runs `down`
    on the way out; a running one is used as it is and left running."""
    lay = layout or Layout.from_env()
    state = cluster_state(lay)
    if _fits(state, hosts, docker, lay):
        yield lay.inventory
        return
    if state.running:
        shape = state.shape
        have = (f"{shape.hosts} host(s), docker: {'yes' if shape.docker else 'no'}"
                if shape else "no recorded shape")
        # The advice keeps what its users have: Docker stays on when it is on now.
        keep_docker = docker or shape is None or shape.docker
        grow = max(hosts, shape.hosts if shape else 0)
        raise ClusterUnfit(
            f"the dev cluster in {lay.state} is running ({have}; ready: "
            f"{', '.join(state.ready) or 'none'}) but this needs {hosts} ready host(s)"
            f"{' with Docker' if docker else ''}: run `scripts/dev-cluster up {grow}"
            f"{'' if keep_docker else ' --no-docker'}` (it is shared, so it is not reshaped "
            "here), or `scripts/dev-cluster down` to let this start its own")
    print(f"dev cluster not running: starting {hosts} host(s)"
          f"{' with Docker' if docker else ''} (stopped again afterwards)",
          file=sys.stderr, flush=True)
    try:
        out = _run(lay, "up", str(hosts), *(() if docker else ("--no-docker",)))
        inventory = Path(out.strip().splitlines()[-1])
        yield inventory
    finally:
        print("stopping the dev cluster this run started", file=sys.stderr, flush=True)
        _run(lay, "down")
