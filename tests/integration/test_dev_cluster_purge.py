"""`scripts/dev-cluster down --purge` leaves nothing of the cluster on disk: a small cluster of
its own (its own state directory and network base, so the suite's cluster is untouched), with
a dockerd holding an image and a container, files in its data_dir and a mount left under
its state, purged."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

from devtools.layout import MAX_SLOT, OWNERS_DIR, RegistryNet, current_net_base
from devtools.purge import mounts_under
from tests.integration.conftest import DEV_CLUSTER

pytestmark = pytest.mark.integration

# Past the suite's cluster (4 hosts from its base) and below its registry host's slot.
OFFSET = 5


def _free_base() -> int:
    """A network base for a 1-host cluster that no cluster on this machine uses: neither its
    host's slot nor its registry host's is taken, as a host's or a registry's."""
    names = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                               check=True).stdout.split())
    for base in range(current_net_base() + OFFSET, MAX_SLOT // 2):
        reg = MAX_SLOT - base
        taken = {f"csd-host-{base}", f"csd-host-{reg}", RegistryNet(base).netns,
                 RegistryNet(MAX_SLOT - base).netns}
        if not taken & names:
            return base
    raise AssertionError("no free network base for a second cluster")


def _cluster(env: dict[str, str], *args: str) -> None:
    r = subprocess.run([str(DEV_CLUSTER), *args], env=env, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, f"dev-cluster {' '.join(args)}: {r.stderr[-3000:]}"


def _docker(state: Path, *args: str, stdin: bytes | None = None) -> None:
    sock = state / "host-0" / "docker.sock"
    subprocess.run(["docker", "-H", f"unix://{sock}", *args], input=stdin, check=True,
                   capture_output=True, timeout=120)


def _tiny_rootfs() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"a file in an image layer\n"
        info = tarfile.TarInfo("etc/purge-test")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_down_purge_leaves_nothing_on_disk() -> None:
    base = _free_base()
    # Short: containerd's sockets under the state must fit a unix socket path's 108 bytes.
    state = Path(tempfile.mkdtemp(prefix="csd-purge-")) / "c"
    env = dict(os.environ, COLDSNAP_DEV_CLUSTER_DIR=str(state),
               COLDSNAP_DEV_NET_BASE=str(base))
    try:
        _cluster(env, "up", "1", "--no-docker", "--gpus", "1")
        _cluster(env, "start-docker", "host-0")
        _docker(state, "import", "-", "coldsnap-purge-test:1", stdin=_tiny_rootfs())
        _docker(state, "create", "--name", "purge-test", "coldsnap-purge-test:1", "/none")
        data = state / "host-0" / "data"
        (data / "objects").mkdir(parents=True, exist_ok=True)
        (data / "objects" / "x").write_bytes(os.urandom(1 << 20))
        # What a dockerd killed hard can leave: a filesystem still mounted under its state.
        left = state / "host-0" / "docker" / "left-mounted"
        left.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(left)], check=True)
        (left / "file").write_text("held by a mount")
        assert sum(f.stat().st_size for f in state.rglob("*") if f.is_file()) > 1 << 20
    finally:
        _cluster(env, "down", "--purge")
    assert not state.exists()
    state.parent.rmdir()
    assert mounts_under(state) == []
    owners = [p for p in OWNERS_DIR.iterdir()] if OWNERS_DIR.is_dir() else []
    assert all(p.read_text().strip() != str(state) for p in owners)
    assert f"csd-host-{base}" not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                     text=True, check=True).stdout
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    assert str(state) not in ps.stdout  # no sshd, dockerd or containerd of it left
