"""Capsule failure paths on the dev cluster: each is refused with an error naming host, unit
and step, and leaves nothing half-done behind."""

from __future__ import annotations

import dataclasses
import hashlib
import posixpath

import docker.errors
import pytest

from coldsnap.capsule import (
    CapsuleError,
    CriuProbeRefused,
    DumpFailed,
    ImageDigestMismatch,
    Mount,
    checkpoint_gpus,
    dump,
    probe_criu,
    quiesce,
    start_unit,
    validate,
    wait_ready,
)
from coldsnap.capsule.collect import checked_payload
from coldsnap.capsule.oci import capsule_reference
from coldsnap.capsule.spec import CRIU_IMAGES_DIR
from coldsnap.formats.artifact import CapsuleImage
from coldsnap.formats.capsule import CapsuleManifest, CriuImageSet
from coldsnap.hosts.http import http_request
from tests.integration.capsule_fixtures import *  # noqa: F403
from tests.integration.capsule_fixtures import (
    BREAK_CRIU,
    ENGINE_PORT,
    EXPECTED,
    ClusterHost,
    cleanup_paths,
    cleanup_unit,
    for_host,
    put_shards,
    sha256_text,
    unique,
    unit_containers,
    unit_spec,
)
from tests.integration.engine_view import engine_view

pytestmark = pytest.mark.integration


async def test_dump_refused_by_criu_leaves_original_serving(
    capsule_cluster: dict[str, ClusterHost], capsule_ref: str
) -> None:
    h0 = capsule_cluster["host-0"]
    s = h0.session
    unit_id = unique("refused")
    capture_id = unique("cap")
    models = None
    try:
        models = await put_shards(h0, 2, 1024 * 1024)
        # The engine holds a connected TCP socket, which CRIU dumps only with
        # --tcp-established (not passed).
        spec = unit_spec(capsule_ref, h0, unit_id, 2, models,
                         extra_args=("--hold-undumpable",))
        h = await start_unit(s, spec)
        await wait_ready(s, h)
        c = await s.container(h.container_id, unit_id, "test")
        await quiesce(s, h)
        await checkpoint_gpus(s, h)
        with pytest.raises(DumpFailed) as err:
            await dump(s, h)
        e = err.value
        assert (e.host, e.unit, e.step) == ("host-0", unit_id, "dump")
        assert "host-0" in str(e) and unit_id in str(e)
        assert "Connected TCP socket" in e.detail, e.detail  # CRIU's own reason is passed on

        # the original keeps serving: GPUs running again, awake, right answer
        view = await engine_view(s, c)
        assert [w["gpu_state"] for w in view["workers"]] == ["running", "running"]
        sleeping = await http_request(h0.target.host, h0.address, ENGINE_PORT, "GET",
                                      "/is_sleeping")
        assert sleeping.status == 200 and sleeping.json() == {"is_sleeping": False}
        v = await validate(s, h)
        assert v.text == EXPECTED
        # no half-written capsule: no CRIU images left on the host, no capsule image or objects
        assert h.images_dir is not None
        left = await h0.target.host.run(["ls", "-A", h.images_dir])
        assert left.stdout == b"", left.stdout
        seen = await s.exec(c, ["/bin/ls", "-A", CRIU_IMAGES_DIR])
        assert seen.ok and seen.stdout == "", "the container sees that same directory"
        with pytest.raises(docker.errors.ImageNotFound):
            repo, tag = capsule_reference(unit_id, capture_id)
            await s.call(s.client.images.get, f"{repo}:{tag}")
        ls = await h0.target.host.run(["ls", f"{h0.entry.data_dir}/capsules/{capture_id}"],
                                      check=False)
        assert ls.exit_status != 0
    finally:
        await cleanup_unit(h0, unit_id)
        await cleanup_paths(h0, models)


# A unit launcher that starts the engine as `capsule-init launch` does, less the seccomp filter
# coldsnapd hands it: stands in for a capsule whose engine is not confined by that filter.
UNFILTERED_LAUNCHER = (
    "sh", "-c",
    'for a; do shift; if [ -n "$skip" ]; then skip=; continue; fi; '
    'if [ "$a" = --seccomp-filter ]; then skip=1; continue; fi; set -- "$@" "$a"; done; '
    'exec /usr/local/bin/capsule-init launch "$@"', "sh")


@pytest.mark.parametrize("filtered", [True, False], ids=["filtered", "unfiltered"])
async def test_an_engine_holding_io_uring_is_refused_at_dump_by_name(
    capsule_cluster: dict[str, ClusterHost], capsule_ref: str, filtered: bool
) -> None:
    """The engine asks for an io_uring at start (as libuv does). Under coldsnapd's filter it
    gets ENOSYS and the dump goes through; launched without the filter it holds one, and the
    dump is refused before CRIU runs, naming io_uring and the holder, and the unit serves on."""
    h0 = capsule_cluster["host-0"]
    s = h0.session
    unit_id = unique("uring")
    models = None
    try:
        models = await put_shards(h0, 1, 1024 * 1024)
        spec = unit_spec(capsule_ref, h0, unit_id, 1, models, extra_args=("--try-io-uring",))
        if not filtered:
            spec = dataclasses.replace(spec, launcher=UNFILTERED_LAUNCHER)
        h = await start_unit(s, spec)
        await wait_ready(s, h)
        c = await s.container(h.container_id, unit_id, "test")
        said = await s.exec(c, ["/bin/grep", "^io_uring:", "/var/log/coldsnap/engine.log"])
        assert said.stdout.split()[:2] == ["io_uring:", "ENOSYS" if filtered else "held"], \
            said.stdout
        await quiesce(s, h)
        await checkpoint_gpus(s, h)
        if filtered:
            dumped = await dump(s, h)
            assert dumped.images_bytes > 0
            return
        with pytest.raises(DumpFailed) as err:
            await dump(s, h)
        e = err.value
        assert (e.host, e.unit, e.step) == ("host-0", unit_id, "dump")
        assert "io_uring" in e.detail and "seccomp" in e.detail, e.detail
        assert f"{h.engine_pid} (python3" in e.detail, e.detail  # the holder, by PID and name
        assert "criu dump exited" not in e.detail and "Unknown shit" not in e.detail, e.detail
        assert (await validate(s, h)).text == EXPECTED  # returned to serving
        assert h.images_dir is not None
        left = await h0.target.host.run(["ls", "-A", h.images_dir])
        assert left.stdout == b"", left.stdout
    finally:
        await cleanup_unit(h0, unit_id)
        await cleanup_paths(h0, models)


async def _broken_criu_image(host: ClusterHost, capsule_ref: str) -> str:
    """An image whose pinned CRIU fails `criu check` the way Debian 12's CRIU fails on this
    kernel: stands in for a destination whose kernel the capsule's CRIU cannot restore on."""
    s = host.session
    tag = f"coldsnap-test/broken-criu:{unique('t')}"
    capsule_repo, digest = capsule_ref.split("@", 1)
    # On a fresh cluster nothing has pulled the capsule onto this host yet.
    await s.call(s.client.images.pull, capsule_repo, tag=digest)
    c = await s.call(s.client.containers.create, capsule_ref, ["sh", "-c", BREAK_CRIU],
                     network_mode="none")
    try:
        await s.call(c.start)
        assert (await s.call(c.wait))["StatusCode"] == 0
        repo, t = tag.split(":")
        await s.call(c.commit, repository=repo, tag=t)
    finally:
        await s.call(c.remove, force=True)
    return tag


async def test_destination_failing_criu_probe_is_refused_before_any_container(
    capsule_cluster: dict[str, ClusterHost], capsule_ref: str
) -> None:
    h1 = capsule_cluster["host-1"]
    s = h1.session
    unit_id = unique("probe")
    broken = await _broken_criu_image(h1, capsule_ref)
    try:
        spec = for_host(unit_spec(capsule_ref, h1, unit_id, 1, "/nonexistent"), h1,
                        "/nonexistent")
        never = sha256_text("never loaded")
        capsule = CapsuleManifest(
            unit_id=unit_id, image=CapsuleImage(unit=unit_id, reference="coldsnap/capsule/x:y",
                                                digest=never),
            image_id=never, base_image=broken, base_image_digest=spec.image_digest,
            criu_images=CriuImageSet(chunk_bytes=1, files=[], objects=[]), engine_pid=10000,
            worker_pids={f"{unit_id}-w0": 10001}, captured_devices=["GPU-captured"])
        # A verdict (the probe ran and said no), which stops a restore's staging at once.
        with pytest.raises(CriuProbeRefused) as err:
            # A restore's first step on its unit's host (the operation's _load_and_probe).
            await probe_criu(s, capsule.base_image, unit=spec.unit_id)
        e = err.value
        assert (e.host, e.unit, e.step) == ("host-1", unit_id, "criu-probe")
        assert "vDSO" in e.detail
        assert await unit_containers(h1, unit_id) == []
        probes = await s.call(s.client.containers.list, all=True,
                              filters={"label": "org.coldsnap.role=probe"})
        assert probes == []
    finally:
        await s.call(s.client.images.remove, broken, force=True)


async def test_image_digest_mismatch_is_refused(
    capsule_cluster: dict[str, ClusterHost], capsule_ref: str
) -> None:
    h0 = capsule_cluster["host-0"]
    s = h0.session
    unit_id = unique("digest")
    repo, real = capsule_ref.split("@", 1)
    other = sha256_text("some other image")
    good = unit_spec(capsule_ref, h0, unit_id, 1, "/nonexistent")

    # 1. the reference pins one digest, the unit's image_digest says another
    with pytest.raises(ImageDigestMismatch) as err:
        await start_unit(s, dataclasses.replace(good, image_digest=other))
    assert (err.value.host, err.value.unit, err.value.step) == ("host-0", unit_id, "pull")

    # 2. a tag that resolves, at pull time, to an image that is not image_digest
    tag = f"{repo}:{unique('mismatch')}"
    await s.call(s.client.api.tag, capsule_ref, tag.rsplit(":", 1)[0], tag.rsplit(":", 1)[1])
    await s.call(s.client.images.push, tag.rsplit(":", 1)[0], tag=tag.rsplit(":", 1)[1])
    try:
        with pytest.raises(ImageDigestMismatch) as err:
            await start_unit(s, dataclasses.replace(good, image=tag, image_digest=other))
        assert real in err.value.detail and other in err.value.detail
    finally:
        await s.call(s.client.images.remove, tag)
    assert await unit_containers(h0, unit_id) == []


async def test_docker_session_survives_a_dropped_ssh_connection(
    capsule_cluster: dict[str, ClusterHost],
) -> None:
    h1 = capsule_cluster["host-1"]
    s = h1.session
    assert await s.call(s.client.ping)
    before = h1.target.host.connects  # type: ignore[attr-defined]
    # What an sshd restart or a network drop does to the transport under a running operation.
    await h1.target.host.close()
    assert await s.call(s.client.ping)
    assert (await s.call(s.client.version))["ApiVersion"]
    assert h1.target.host.connects == before + 1  # type: ignore[attr-defined]


async def test_payload_paths_are_resolved_and_checked_on_the_host(
    capsule_cluster: dict[str, ClusterHost],
) -> None:
    """A payload path from a request may only name a regular file under a mount source of the
    unit, after symlinks are resolved on the host: never /etc/shadow through a link, never a
    device that would be read forever."""
    h0 = capsule_cluster["host-0"]
    s = h0.session
    # Clean (no '..'): a mount's source is an absolute, clean path like every request path.
    root = f"{posixpath.dirname(h0.entry.data_dir)}/payload-check-{unique('d')}"
    models = f"{root}/models"
    mounts = (Mount(source=models, target="/models", read_only=True),)
    run = h0.target.host.run
    await run(["mkdir", "-p", models])
    try:
        await run(["sh", "-c", 'printf abc > "$1/ok.bin" && ln -s /etc/shadow "$1/escape.bin" '
                   '&& ln -s /dev/zero "$1/zero.bin" && mkfifo "$1/fifo.bin" '
                   '&& printf x > "$2/outside.bin"', "sh", models, root])
        found = await checked_payload(s, "u", "w", f"{models}/ok.bin", mounts)
        assert found.real.endswith("/models/ok.bin") and ".." not in found.real
        assert found.bytes == 3 and found.root == models
        assert found.sha256 == "sha256:" + hashlib.sha256(b"abc").hexdigest()
        for name, why in (("escape.bin", "outside every mount"),
                          ("zero.bin", "outside every mount"),
                          ("fifo.bin", "not a regular file"),
                          ("missing.bin", "does not exist")):
            with pytest.raises(CapsuleError) as err:
                await checked_payload(s, "u", "w", f"{models}/{name}", mounts)
            assert why in err.value.detail, err.value.detail
            assert err.value.step == "collect"
        with pytest.raises(CapsuleError, match="outside every mount"):
            await checked_payload(s, "u", "w", f"{models}/../outside.bin", mounts)
    finally:
        await cleanup_paths(h0, root)
