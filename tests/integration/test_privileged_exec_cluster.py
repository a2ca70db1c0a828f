"""Issue 35, findings 1 and 2, as the attacks: what a request or its engine (root in its
container, without a capability) plants never runs with the capsule's capabilities, and the
engine never reaches its CRIU images. Each marker would be written where only a privileged
process can write: the unit's CRIU images directory on the host."""

from __future__ import annotations

import json
import shlex
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest

from coldsnap.capsule import checkpoint_gpus, dump, quiesce, remove_unit, start_unit, wait_ready
from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.handle import UnitHandle
from coldsnap.capsule.spec import CRIU_IMAGES_DIR, TRUSTED_EXEC_ENV, UnitSpec
from coldsnap.formats.request import Mount
from tests.integration.capsule_fixtures import *  # noqa: F403
from tests.integration.capsule_fixtures import (
    ClusterHost,
    cleanup_paths,
    cleanup_unit,
    put_shards,
    unique,
    unit_spec,
)
from tests.integration.engine_view import run_as_engine

pytestmark = pytest.mark.integration

# Run by whatever reads it with the capabilities: leaves a marker in the images directory.
_EVIL_SH = f"#!/bin/sh\ntouch {CRIU_IMAGES_DIR}/marker-$1-ran\n"


@asynccontextmanager
async def _ready_unit(host: ClusterHost, capsule_ref: str, prefix: str,
                      env_add: Mapping[str, str] | None = None,
                      ) -> AsyncIterator[tuple[UnitSpec, UnitHandle]]:
    """A one-worker unit of the test engine, started and serving; removed afterwards."""
    unit_id = unique(prefix)
    models = None
    try:
        models = await put_shards(host, 1, 1 << 20)
        spec = unit_spec(capsule_ref, host, unit_id, 1, models)
        spec = replace(spec, environment={**spec.environment, **(env_add or {})})
        handle = await start_unit(host.session, spec)
        await wait_ready(host.session, handle)
        yield spec, handle
        await remove_unit(host.session, handle)
    finally:
        await cleanup_unit(host, unit_id)
        await cleanup_paths(host, models)


# What the engine plants for each vector before the capture (its /tmp and /root are its own
# volumes), and the environment the request gives the container.
_PLANTS: dict[str, tuple[dict[str, str], str]] = {
    "CRIU_CONFIG_FILE": ({"CRIU_CONFIG_FILE": "/tmp/evil.conf"},
                         "printf 'action-script /tmp/evil-config.sh\\n' > /tmp/evil.conf"),
    "CRIU_LIBS_DIR": ({"CRIU_LIBS_DIR": "/tmp/plugins"},
                      # Not a loadable plugin: a CRIU that reads the directory fails its dump.
                      "mkdir -p /tmp/plugins && printf 'not an ELF' > /tmp/plugins/evil.so"),
    "criu-default-conf": ({}, "mkdir -p /root/.criu && printf 'action-script "
                              "/tmp/evil-home.sh\\n' > /root/.criu/default.conf"),
    "user-site-pth": ({}, 'site=$(HOME=/root python3 -c "import site; '
                          'print(site.getusersitepackages())") && mkdir -p "$site" && '
                          "printf 'import os; os.system(\"/tmp/evil.sh pth\")\\n' "
                          '> "$site/evil.pth"'),
}


@pytest.mark.parametrize("vector", sorted(_PLANTS))
async def test_criu_reads_nothing_the_request_or_the_engine_chose(
        capsule_cluster: dict[str, ClusterHost], capsule_ref: str, vector: str) -> None:
    """A request's CRIU_CONFIG_FILE or CRIU_LIBS_DIR, a ~/.criu/default.conf or a .pth of the
    user site planted by the engine: the dump runs as it would have, and no marker of theirs
    appears in the images directory on the host."""
    h0 = capsule_cluster["host-0"]
    s = h0.session
    env_add, plant = _PLANTS[vector]
    async with _ready_unit(h0, capsule_ref, "plant", env_add) as (spec, handle):
        scripts = " && ".join(
            f"printf %s {shlex.quote(_EVIL_SH)} > /tmp/{name} && chmod 0755 /tmp/{name}"
            for name in ("evil.sh", "evil-config.sh", "evil-home.sh"))
        said = await run_as_engine(s, handle, spec, f"{scripts} && {plant} && echo planted",
                                "/tmp/plant.out")
        assert "planted" in said, said
        # A privileged exec's environment is coldsnapd's alone, whatever the container's.
        container = await s.container(handle.container_id, spec.unit_id, "test")
        seen = await s.exec(container, ["/usr/bin/env"])
        names = {line.split("=", 1)[0] for line in seen.stdout.splitlines() if "=" in line}
        assert names == set(TRUSTED_EXEC_ENV), seen.stdout
        await quiesce(s, handle)
        await checkpoint_gpus(s, handle)
        dumped = await dump(s, handle)
        assert dumped.images_bytes > 0
        assert handle.images_dir is not None
        listed = await h0.target.host.run(["ls", "-A", handle.images_dir])
        names = set(listed.stdout.decode().split())
        assert not [n for n in names if n.startswith("marker-")], names
        assert any(n.endswith(".img") for n in names), names


_REWRITE = f"""import json, os
out = {{}}
for name in ("inventory.img", "planted.img"):
    path = os.path.join({CRIU_IMAGES_DIR!r}, name)
    try:
        with open(path, "ab") as f:
            f.write(b"REWRITTEN-BY-THE-ENGINE")
        out[name] = "written"
    except OSError as exc:
        out[name] = exc.strerror
try:
    os.listdir({CRIU_IMAGES_DIR!r})
    out["list"] = "listed"
except OSError as exc:
    out["list"] = exc.strerror
print(json.dumps(out))
"""


async def test_an_engine_cannot_rewrite_its_images_between_dump_and_pack(
        capsule_cluster: dict[str, ClusterHost], capsule_ref: str) -> None:
    """The engine keeps running after its dump (--leave-running) until the host packs the
    images: it tries to rewrite one and add another, before the dump and after it. Both are
    refused, and the images the host would pack never hold its bytes."""
    h0 = capsule_cluster["host-0"]
    s = h0.session
    async with _ready_unit(h0, capsule_ref, "rewrite") as (spec, handle):
        program = f"python3 -c {shlex.quote(_REWRITE)}"
        before = json.loads(await run_as_engine(s, handle, spec, program, "/tmp/before.json"))
        await quiesce(s, handle)
        await checkpoint_gpus(s, handle)
        await dump(s, handle)
        after = json.loads(await run_as_engine(s, handle, spec, program, "/tmp/after.json"))
        assert set(before.values()) == set(after.values()) == {"Permission denied"}, (
            before, after)
        assert handle.images_dir is not None
        found = await h0.target.host.run(
            ["grep", "-rl", "REWRITTEN-BY-THE-ENGINE", handle.images_dir], check=False)
        assert found.exit_status == 1, found.stdout
        listed = await h0.target.host.run(["ls", "-A", handle.images_dir])
        names = listed.stdout.decode().split()
        assert "inventory.img" in names and "planted.img" not in names, names


async def test_a_mount_over_a_program_directory_is_refused(
        capsule_cluster: dict[str, ClusterHost], capsule_ref: str) -> None:
    """A host directory holding an `sh` that would leave a marker, mounted at /usr/local/sbin
    (first on the privileged execs' PATH): the unit is refused naming the mount's target, and
    no container is ever started, so nothing leaves the marker."""
    h0 = capsule_cluster["host-0"]
    s = h0.session
    unit_id = unique("mnt")
    models = None
    try:
        models = await put_shards(h0, 1, 1 << 20)
        tools = f"{models}/tools"
        # Inside the container the marker lands in the mounted directory itself.
        await h0.target.host.run(["sh", "-c", f"mkdir -p {tools} && printf '#!/bin/sh\\n"
                                  "touch /usr/local/sbin/marker\\n' "
                                  f"> {tools}/sh && chmod 0755 {tools}/sh"])
        spec = unit_spec(capsule_ref, h0, unit_id, 1, models)
        spec = replace(spec, mounts=(*spec.mounts, Mount(source=tools,
                                                         target="/usr/local/sbin")))
        with pytest.raises(CapsuleError) as refused:
            await start_unit(s, spec)
        assert "mounts[1].target" in str(refused.value), refused.value
        assert "/usr" in str(refused.value)
        gone = await h0.target.host.run(["test", "-e", f"{tools}/marker"], check=False)
        assert gone.exit_status != 0
    finally:
        await cleanup_unit(h0, unit_id)
        await cleanup_paths(h0, models)
