"""The engine runs confined inside its unit: no capability, no-new-privs, its own seccomp
filter, Docker's masked and read-only /proc paths, PIDs above the floor; CRIU, exec'd beside
it, keeps the container's capabilities (the round-trip tests prove it still dumps and
restores, and that a restored tree is confined the same)."""

from __future__ import annotations

import errno
import json
import shlex
from dataclasses import replace

import pytest

from coldsnap.capsule import checkpoint_gpus, dump, quiesce, remove_unit, start_unit, wait_ready
from coldsnap.capsule.containers import launch_argv
from coldsnap.capsule.engine_steps import engine_log_tail
from coldsnap.capsule.spec import ENGINE_PID_FLOOR, TRUSTED_EXEC_ENV
from tests.integration.capsule_fixtures import *  # noqa: F403
from tests.integration.capsule_fixtures import (
    ClusterHost,
    cleanup_paths,
    cleanup_unit,
    put_shards,
    unique,
    unit_spec,
)
from tests.integration.engine_view import CONFINED, confinement, run_as_engine

pytestmark = pytest.mark.integration

# Run as the engine is (same launcher, same filter): what the kernel answers it.
_PROBE = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(ret):
    return 0 if ret == 0 else ctypes.get_errno()
out = {
    "pid": os.getpid(),
    "unshare_user": errno_of(libc.unshare(0x10000000)),
    "unshare_net": errno_of(libc.unshare(0x40000000)),
    "mount": errno_of(libc.mount(b"none", b"/mnt", b"tmpfs", 0, None)),
    "keyctl": errno_of(libc.syscall(250, 0, 0, 0, 0, 0)),  # x86_64 keyctl(GET_KEYRING_ID)
    "status": {k: v.strip() for k, v in (l.split(":", 1) for l in open("/proc/self/status")
                                        if ":" in l) if k in ("CapBnd", "NoNewPrivs", "Seccomp")},
}
open("/tmp/confinement-probe.json", "w").write(json.dumps(out))
"""


async def test_engine_tree_holds_no_capability_and_proc_stays_masked(
        capsule_cluster: dict[str, ClusterHost], capsule_ref: str) -> None:
    h0 = capsule_cluster["host-0"]
    s = h0.session
    unit_id = unique("confine")
    models = None
    try:
        models = await put_shards(h0, 2, 1 << 20)
        spec = unit_spec(capsule_ref, h0, unit_id, 2, models)
        handle = await start_unit(s, spec)
        pids = await wait_ready(s, handle)
        assert handle.engine_pid is not None and handle.engine_pid > ENGINE_PID_FLOOR
        container = await s.container(handle.container_id, unit_id, "test")
        tree = [handle.engine_pid, *pids.values()]
        assert all(p > ENGINE_PID_FLOOR for p in tree), tree
        for pid, status in (await confinement(s, container, tree)).items():
            assert status == CONFINED, (pid, status)

        # CRIU's side: a docker exec keeps the container's capabilities.
        exec_status = await s.exec(container, ["/bin/grep", "^CapEff:", "/proc/self/status"])
        assert exec_status.stdout.split()[1] != "0000000000000000"

        # Docker's masked and read-only paths are kept: /proc/sys cannot be written even with
        # the container's capabilities, and /proc/keys is hidden.
        inspect = await s.call(s.client.api.inspect_container, handle.container_id)
        assert "/proc/keys" in inspect["HostConfig"]["MaskedPaths"]
        assert "/proc/sys" in inspect["HostConfig"]["ReadonlyPaths"]
        write = await s.exec(container, ["/bin/sh", "-c",
                                         "echo 20000 > /proc/sys/kernel/ns_last_pid"])
        assert not write.ok and "Read-only file system" in write.stderr, write
        keys = await s.exec(container, ["/bin/cat", "/proc/keys"])
        assert keys.stdout == ""

        # The filter is real: what the engine is refused, a process started the same way is.
        probe = replace(spec, command=("python3", "-c", _PROBE))
        launched = await s.exec(container, launch_argv(probe), timeout_s=60)
        assert launched.ok, launched.tail()
        got = {}
        for _ in range(100):
            read = await s.exec(container, ["/bin/cat", "/tmp/confinement-probe.json"])
            if read.ok and read.stdout:
                got = json.loads(read.stdout)
                break
        assert got["pid"] == int(launched.stdout.split()[-1]) > ENGINE_PID_FLOOR
        assert got["status"] == {"CapBnd": "0000000000000000", "NoNewPrivs": "1",
                                 "Seccomp": "2"}
        for call in ("unshare_user", "unshare_net", "mount", "keyctl"):
            assert got[call] == errno.EPERM, (call, got)
        await remove_unit(s, handle)
    finally:
        await cleanup_unit(h0, unit_id)
        await cleanup_paths(h0, models)


async def test_a_request_environment_reaches_the_engine_but_no_privileged_exec(
        capsule_cluster: dict[str, ClusterHost], capsule_ref: str) -> None:
    """A unit's `environment` may name a PATH that leads into a directory the engine writes.
    The engine gets that environment; what coldsnapd runs beside it with the container's
    capabilities (here the `tail` of the engine's log) runs with TRUSTED_EXEC_ENV instead, so
    a `tail` the engine planted there never runs."""
    h0 = capsule_cluster["host-0"]
    s = h0.session
    unit_id = unique("envtrap")
    models = None
    planted, marker = "/tmp/planted-bin", "/tmp/planted-ran"
    try:
        models = await put_shards(h0, 1, 1 << 20)
        spec = unit_spec(capsule_ref, h0, unit_id, 1, models)
        env = {**spec.environment, "PATH": f"{planted}:/usr/local/bin:/usr/bin:/bin",
               "PYTHONPATH": planted, "LD_PRELOAD": f"{planted}/missing.so"}
        handle = await start_unit(s, replace(spec, environment=env))
        await wait_ready(s, handle)
        container = await s.container(handle.container_id, unit_id, "test")
        # The engine's own environment is the request's.
        environ = await s.exec(container, ["/bin/cat", f"/proc/{handle.engine_pid}/environ"])
        got = dict(item.split("=", 1) for item in environ.stdout.split("\0") if "=" in item)
        assert (got["PATH"], got["PYTHONPATH"]) == (env["PATH"], planted)
        # What the engine (root in its container, without capabilities) can write: a `tail`
        # first on the request's PATH, which would leave a marker if it ever ran.
        plant = await s.exec(container, [
            "/bin/sh", "-c", f'mkdir -p {planted} && printf "#!/bin/sh\\ntouch {marker}\\n" '
                        f'> {planted}/tail && chmod 0755 {planted}/tail'])
        assert plant.ok, plant
        # The pristine `tail` ran: it read the engine's log (a planted one would print nothing).
        assert await engine_log_tail(s, container)
        seen = await s.exec(container, ["/bin/sh", "-c", 'echo "$PATH|$LD_PRELOAD|$PYTHONPATH"'])
        assert seen.stdout.strip() == f"{TRUSTED_EXEC_ENV['PATH']}||", seen
        assert not (await s.exec(container, ["/usr/bin/test", "-e", marker])).ok
    finally:
        await cleanup_unit(h0, unit_id)
        await cleanup_paths(h0, models)


# Run as the engine is (same launcher): replace each program coldsnapd runs with capabilities
# by a script that would leave a marker in the unit's CRIU images directory, a host directory.
_TAMPER = r"""
import json
result = {}
for path in ("/usr/sbin/criu", "/usr/local/bin/cuda-checkpoint", "/usr/local/bin/capsule-init",
             "/bin/sh"):
    try:
        with open(path, "w") as f:
            f.write("#!/bin/sh\ntouch /var/lib/coldsnap/images/tampered\n")
        result[path] = "written"
    except OSError as exc:
        result[path] = exc.strerror
print(json.dumps(result))
"""


async def test_an_engine_cannot_replace_what_coldsnapd_runs_with_capabilities(
        capsule_cluster: dict[str, ClusterHost], capsule_ref: str) -> None:
    """The engine is root in its container; the rootfs is read-only, so its attempt to
    overwrite criu, cuda-checkpoint, capsule-init and sh fails, the dump that follows runs the
    pristine programs, and the marker their replacement would leave on the host never
    appears. Not even an exec with the container's capabilities can write the rootfs."""
    h0 = capsule_cluster["host-0"]
    s = h0.session
    unit_id = unique("tamper")
    models = None
    try:
        models = await put_shards(h0, 1, 1 << 20)
        spec = unit_spec(capsule_ref, h0, unit_id, 1, models)
        handle = await start_unit(s, spec)
        await wait_ready(s, handle)
        container = await s.container(handle.container_id, unit_id, "test")
        inspect = await s.call(s.client.api.inspect_container, handle.container_id)
        assert inspect["HostConfig"]["ReadonlyRootfs"] is True
        got = json.loads(await run_as_engine(s, handle, spec,
                                             f"python3 -c {shlex.quote(_TAMPER)}",
                                             "/tmp/tamper.json"))
        assert set(got.values()) == {"Read-only file system"}, got
        with_caps = await s.exec(container, ["/bin/sh", "-c", "echo x >> /usr/sbin/criu"])
        assert not with_caps.ok and "Read-only file system" in with_caps.stderr, with_caps
        # The capture's dump (criu, its action script, tar) runs as it would have.
        await quiesce(s, handle)
        await checkpoint_gpus(s, handle)
        dumped = await dump(s, handle)
        assert dumped.images_bytes > 0
        assert handle.images_dir is not None
        listed = await h0.target.host.run(["ls", "-A", handle.images_dir])
        names = listed.stdout.decode().split()
        assert "tampered" not in names and any(n.endswith(".img") for n in names), names
        # The writable paths travel in the image set, the engine's state among them.
        assert "rootfs-var-lib-test-engine.tar" in names, names
        await remove_unit(s, handle)
    finally:
        await cleanup_unit(h0, unit_id)
        await cleanup_paths(h0, models)
