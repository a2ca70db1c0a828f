"""Integration fixtures: the dev cluster of real sshd (+ dockerd) hosts, each in its own network
namespace on the bridge csd-br0 (198.18.0.0/24).

The cluster is started by `scripts/test` (or by hand: `scripts/dev-cluster up 4`). When it is
not up these fixtures FAIL with that instruction; they never skip, so a missing cluster can
not pass for a green run.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

from coldsnap.hosts.inventory import HostEntry, Inventory, load_inventory
from coldsnap.hosts.pool import HostPool

if TYPE_CHECKING:  # ops_fixtures imports this module: the types only, not at run time
    from devtools.served import Served
    from tests.integration.ops_fixtures import Ops

REPO = Path(__file__).resolve().parents[2]
DEV_CLUSTER = REPO / "scripts" / "dev-cluster"
HOW_TO_START = "run `scripts/test`, or start the cluster with `scripts/dev-cluster up 4`"


def _inventory_path() -> Path:
    env = os.environ.get("COLDSNAP_DEV_INVENTORY")
    return Path(env) if env else REPO / ".dev-cluster" / "inventory.yaml"


def _answers(entry: HostEntry) -> bool:
    try:
        with socket.create_connection((entry.address, entry.port), timeout=2) as s:
            return s.recv(4).startswith(b"SSH-")
    except OSError:
        return False


@pytest.fixture(scope="session")
def dev_inventory() -> Path:
    """Path of the dev cluster's inventory; fails (never skips) when the cluster is down."""
    path = _inventory_path()
    if not path.exists():
        pytest.fail(f"dev cluster inventory {path} not found: {HOW_TO_START}", pytrace=False)
    inventory = load_inventory(path)
    down = [h.name for h in inventory.hosts if not _answers(h)]
    if down:
        pytest.fail(
            f"dev cluster hosts not answering SSH: {', '.join(down)}: {HOW_TO_START}", pytrace=False
        )
    return path


@pytest.fixture(scope="session")
def dev_hosts(dev_inventory: Path) -> Inventory:
    inventory = load_inventory(dev_inventory)
    if len(inventory.hosts) < 3:
        pytest.fail(f"the integration tests need at least 3 hosts: {HOW_TO_START}", pytrace=False)
    return inventory


@pytest_asyncio.fixture(scope="session")
async def pool(dev_hosts: Inventory) -> AsyncIterator[HostPool]:
    async with HostPool(dev_hosts) as p:
        yield p


class ClusterControl:
    """Stops and starts one simulated host's sshd or dockerd, or cuts and restores its network
    link (a partition: the host's processes keep running), through scripts/dev-cluster."""

    def __init__(self, inventory_path: Path) -> None:
        self.env = dict(os.environ, COLDSNAP_DEV_CLUSTER_DIR=str(inventory_path.parent))
        self.stopped: set[str] = set()
        self.partitioned: set[str] = set()
        self.docker_stopped: set[str] = set()

    def _run(self, *args: str) -> None:
        subprocess.run(
            [str(DEV_CLUSTER), *args],
            check=True,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=60,
        )

    def stop_host(self, name: str) -> None:
        self.stopped.add(name)
        self._run("stop-host", name)

    def start_host(self, name: str) -> None:
        self._run("start-host", name)
        self.stopped.discard(name)

    @contextmanager
    def host_stopped(self, name: str) -> Iterator[None]:
        """The host's sshd is down inside the block and always back up after it."""
        self.stop_host(name)
        try:
            yield
        finally:
            self.start_host(name)

    def stop_docker(self, name: str) -> None:
        self.docker_stopped.add(name)
        self._run("stop-docker", name)

    def start_docker(self, name: str) -> None:
        self._run("start-docker", name)
        self.docker_stopped.discard(name)

    def partition_host(self, name: str) -> None:
        self.partitioned.add(name)
        self._run("partition-host", name)

    def heal_host(self, name: str) -> None:
        self._run("heal-host", name)
        self.partitioned.discard(name)

    @contextmanager
    def host_partitioned(self, name: str) -> Iterator[None]:
        """The host's link is down inside the block (it is unreachable, its sshd, dockerd and
        containers keep running) and always back up after it."""
        self.partition_host(name)
        try:
            yield
        finally:
            self.heal_host(name)


@pytest.fixture(scope="session")
def cluster(dev_inventory: Path) -> Iterator[ClusterControl]:
    control = ClusterControl(dev_inventory)
    try:
        yield control
    finally:
        # Other engineers share the cluster: never leave a host down or cut off behind us.
        for name in sorted(control.partitioned):
            control.heal_host(name)
        for name in sorted(control.stopped):
            control.start_host(name)
        for name in sorted(control.docker_stopped):
            control.start_docker(name)


@pytest.fixture(scope="session", autouse=True)
def no_leftover_units() -> None:
    """Units share their host's network, so a unit left running by `scripts/demo` or an
    aborted run would hold the ports the tests' units need: the suite starts without them.
    (Only containers coldsnap labelled as units are touched.)"""
    path = _inventory_path()
    if not path.exists():
        return
    import docker

    for entry in load_inventory(path).hosts:
        if not entry.docker_socket or not Path(entry.docker_socket).exists():
            continue
        client = docker.DockerClient(base_url=f"unix://{entry.docker_socket}", timeout=60)
        try:
            for c in client.containers.list(all=True, filters={"label": "org.coldsnap.unit"}):
                c.remove(force=True)
        finally:
            client.close()


# The fixtures below need `ops` (tests.integration.ops_fixtures), which each module that uses
# them imports: pytest finds it from the requesting test's module.
@pytest.fixture
def clean(ops: Ops) -> Iterator[None]:
    """No unit container on any host before the test, nor after it."""
    ops.remove_units()
    yield
    ops.remove_units()


@pytest.fixture
def clean_staged(ops: Ops) -> Iterator[None]:
    """As `clean`, and nothing staged on the hosts before the test (a restore stages anew)."""
    ops.remove_units()
    ops.clear_staged()
    yield
    ops.remove_units()


@contextmanager
def default_service(served: Served) -> Iterator[Served]:
    """The CLI processes run inside the block submit to `served` (COLDSNAP_SOCKET names its
    socket); afterwards the previous value is back and the service is closed."""
    previous = os.environ.get("COLDSNAP_SOCKET")
    os.environ["COLDSNAP_SOCKET"] = str(served.socket)
    try:
        yield served
    finally:
        if previous is None:
            os.environ.pop("COLDSNAP_SOCKET", None)
        else:
            os.environ["COLDSNAP_SOCKET"] = previous
        served.close()
