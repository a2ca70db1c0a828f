"""The OCI capsule: only the rootfs diff of the unit's container over its digest-pinned base
image, as an image of its own (manifest, config, layers), never the CRIU images.

Capture commits the dumped container. With a registry (the inventory's `registry`), the
capture host pushes it and the artifact names it by digest (`REGISTRY/coldsnap/capsule/UNIT@
sha256:...`); every restore host pulls it by digest, its base layers already there. A request's
`policy.capsule.repository` takes the place of `REGISTRY/coldsnap/capsule`, with or without an
inventory registry: the capsule goes to `REPOSITORY/UNIT`. Without either, the capture host
exports the layers above the base (`docker save`, then the base's layers left out on the host)
as the unit's `oci-capsule` object, and a restore host loads that after making sure it has the
base image: Docker reads no layer it already holds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import docker.errors
import structlog

from coldsnap.capsule.collect import HostFile, capsule_dir, remove_capsule_files
from coldsnap.capsule.errors import CapsuleError, CommitFailed, ImageDigestMismatch, RestoreFailed
from coldsnap.capsule.handle import DumpResult, UnitHandle, fail, kv_discarded
from coldsnap.capsule.images import (
    clear_dump,
    discard_dir,
    make_private_dir,
    pack_images,
)
from coldsnap.capsule.session import LONG_DOCKER_CALL, CapsuleSession
from coldsnap.capsule.spec import docker_name, docker_tag
from coldsnap.digests import is_digest
from coldsnap.engines import adapter_for
from coldsnap.formats.artifact import ROLE_CAPSULE, ROLE_CRIU_IMAGE, CapsuleImage
from coldsnap.formats.capsule import CapsuleManifest, InetSocketRecord
from coldsnap.hosts.helper import helper_argv

log = structlog.get_logger("coldsnap.capsule")


def split_reference(ref: str) -> tuple[str, str | None, str | None]:
    """`repo[:tag][@sha256:...]` -> (repo, tag, digest); a registry port is not a tag, and a
    bare `sha256:<hex>` (which the request format allows) has no repository at all."""
    if is_digest(ref):
        return "", None, ref
    name, _, digest = ref.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    return name, tag, digest or None


async def _bare_digest_image(s: CapsuleSession, unit: str, image_digest: str) -> Any:
    """A bare digest names no repository to pull from: Docker resolves it as a local image
    id, so the image must already be on the host."""
    try:
        return await s.call(s.client.images.get, image_digest)
    except docker.errors.NotFound:
        raise fail(s, unit, "pull",
                   f"image {image_digest} is not on this host, and a bare digest names no "
                   "repository to pull it from: load it there first, or write the image as "
                   "REPOSITORY@DIGEST", ImageDigestMismatch) from None
    except docker.errors.DockerException as exc:
        raise fail(s, unit, "pull", f"cannot inspect {image_digest}: {exc}") from exc


async def ensure_image(s: CapsuleSession, unit: str, image: str, image_digest: str) -> str:
    """Pull `image` and prove it is `image_digest`; returns the local image id.

    `image_digest` is matched against the image's repository digests, and for a bare-digest
    image (no repository) against its local image id too, which is what Docker resolves a
    bare digest to."""
    step = "pull"
    repo, tag, ref_digest = split_reference(image)
    if ref_digest is not None and ref_digest != image_digest:
        raise fail(s, unit, step, f"image {image} pins {ref_digest}, but the unit's "
                   f"image_digest is {image_digest}", ImageDigestMismatch)
    if not repo:
        found = await _bare_digest_image(s, unit, image_digest)
    else:
        want = ref_digest or tag or "latest"
        try:
            try:
                found = await s.call(s.client.images.get, f"{repo}@{image_digest}")
            except docker.errors.NotFound:
                found = await s.call(s.client.images.pull, repo, tag=want,
                                     timeout_s=LONG_DOCKER_CALL)
        except docker.errors.DockerException as exc:
            raise fail(s, unit, step, f"cannot pull {repo}@{want}: {exc}",
                       ImageDigestMismatch if ref_digest else CapsuleError) from exc
    digests = {d.partition("@")[2] for d in found.attrs.get("RepoDigests") or []}
    if not repo:
        digests.add(str(found.id))
    if image_digest not in digests:
        raise fail(s, unit, step,
                   f"pulled {image} has digest {', '.join(sorted(digests)) or 'none'}, "
                   f"not the unit's image_digest {image_digest}", ImageDigestMismatch)
    return str(found.id)


def capsule_repository(unit_id: str, registry: str | None = None) -> str:
    repo = f"coldsnap/capsule/{docker_name(unit_id)}"
    return f"{registry}/{repo}" if registry else repo


def push_repository(unit_id: str, *, registry: str | None,
                    repository: str | None) -> str | None:
    """Where a unit's capsule is pushed: under the request's `policy.capsule.repository`
    when it names one, else under the inventory's registry; None: not pushed."""
    if repository:
        return f"{repository}/{docker_name(unit_id)}"
    return capsule_repository(unit_id, registry) if registry else None


@dataclass(frozen=True)
class ExportedLayers:
    """The capsule's layers above its base, as a `docker load` tar on the capture host."""

    path: str
    sha256: str
    bytes: int


async def rootfs_layers(s: CapsuleSession, image: str) -> list[str]:
    attrs = await s.call(s.client.api.inspect_image, image)
    return [str(x) for x in (attrs.get("RootFS") or {}).get("Layers") or []]


async def push(s: CapsuleSession, unit: str, image_id: str, repo: str, tag: str) -> str:
    """Push the committed capsule; returns `repo@sha256:<manifest digest>`."""
    step = "push"
    try:
        await s.call(s.client.api.tag, image_id, repo, tag)
        lines = await s.call(
            lambda: list(s.client.api.push(repo, tag=tag, stream=True, decode=True)),
            timeout_s=LONG_DOCKER_CALL)
    except (docker.errors.DockerException, TimeoutError) as exc:
        raise fail(s, unit, step, f"cannot push {repo}:{tag}: {exc!r}") from exc
    pushed: str | None = None
    for line in lines:
        if line.get("error"):
            raise fail(s, unit, step, f"push of {repo}:{tag}: {line['error']}")
        aux = line.get("aux") or {}
        if isinstance(aux, dict) and isinstance(aux.get("Digest"), str):
            pushed = aux["Digest"]
    if pushed is None or not is_digest(pushed):
        raise fail(s, unit, step, f"push of {repo}:{tag} reported no manifest digest")
    return f"{repo}@{pushed}"


async def export_layers(s: CapsuleSession, unit: str, image_ref: str, base_layers: int,
                        out: str) -> ExportedLayers:
    """`docker save` of the capsule on its host, kept there only with the layers above the
    base's `base_layers`: the unit's `oci-capsule` object."""
    step = "export"
    host = s.target.host
    saved = f"{out}.saved"
    try:
        await s.host_docker("save", "-o", saved, image_ref, timeout_s=LONG_DOCKER_CALL)
        res = await host.run(helper_argv("layers", saved, out, str(base_layers)),
                             timeout=LONG_DOCKER_CALL, check=False)
    finally:
        await host.run(["rm", "-f", "--", saved], check=False)
    if not res.ok:
        raise fail(s, unit, step, f"cannot export the layers of {image_ref}: "
                   f"{res.stderr.decode(errors='replace').strip()[-800:]}")
    hexd, size = res.stdout.decode().split()
    return ExportedLayers(out, f"sha256:{hexd}", int(size))


async def load_capsule(s: CapsuleSession, manifest: CapsuleManifest,
                       staged_layers: str | None) -> str:
    """Make the capsule image present on this host and prove it is the captured one; returns
    its image id. Pulled by digest when it was pushed; else its base is pulled (or found) by
    digest and the staged layers loaded on top. Nothing is done when it is there already."""
    step = "load"
    unit = manifest.unit_id
    with contextlib.suppress(docker.errors.NotFound):
        found = await s.call(s.client.images.get, manifest.image_id)
        s.inspected(manifest.image_id, found.attrs)
        return manifest.image_id
    if manifest.pushed is not None:
        repo, _, digest = split_reference(manifest.pushed)
        try:
            await s.call(s.client.images.pull, repo, tag=digest, timeout_s=LONG_DOCKER_CALL)
        except docker.errors.DockerException as exc:
            raise fail(s, unit, step, f"cannot pull {manifest.pushed}: {exc}",
                       RestoreFailed) from exc
    else:
        if staged_layers is None:
            raise fail(s, unit, step, "the capsule was not pushed to a registry and no "
                       "oci-capsule object was staged", RestoreFailed)
        await ensure_image(s, unit, manifest.base_image, manifest.base_image_digest)
        try:
            await s.host_docker("load", "-q", "-i", staged_layers, timeout_s=LONG_DOCKER_CALL)
        except Exception as exc:
            raise fail(s, unit, step, f"docker load {staged_layers}: {exc}",
                       RestoreFailed) from exc
    try:
        found = await s.call(s.client.images.get, manifest.image_id)
    except docker.errors.NotFound:
        raise fail(s, unit, step, f"{manifest.pushed or staged_layers} does not hold image "
                   f"{manifest.image_id}", ImageDigestMismatch) from None
    s.inspected(manifest.image_id, found.attrs)
    return manifest.image_id


@dataclass(frozen=True)
class CapsuleObject:
    """One object of a committed capsule, where it lies on the capture host."""

    role: str  # ROLE_CAPSULE (the layers above the base) or ROLE_CRIU_IMAGE
    file: HostFile


@dataclass(frozen=True)
class CommittedCapsule:
    """A committed capsule: its manifest (what the artifact records) and the objects on the
    capture host that the controller pulls into the store."""

    manifest: CapsuleManifest
    objects: tuple[CapsuleObject, ...]
    capture_id: str

    @property
    def unit_id(self) -> str:
        return self.manifest.unit_id


def capsule_reference(unit_id: str, capture_id: str) -> tuple[str, str]:
    """Repository and tag of a unit's committed capsule on its capture host. The tag is
    injective in (unit, capture): the repository is the unit's lowercased id, so the tag
    carries the exact unit id too."""
    return capsule_repository(unit_id), docker_tag(f"{capture_id}/{unit_id}")


def env_reset_changes(container_env: Sequence[str], base_env: Sequence[str]) -> list[str]:
    """The `docker commit` changes that give the capsule its base image's environment back.

    A commit copies the container's `Env` (the request's environment: tokens, keys) into the
    capsule's image config, which a registry then serves to anyone who may pull it. A commit
    cannot drop a variable, so each one the container set over its base is set back to the
    base's value, or to an empty value when the base has none. A restore loses nothing: its
    container is created with the restore's own environment, never the image's."""
    base = dict(str(item).partition("=")[::2] for item in base_env)
    changes = []
    for item in container_env:
        name, _, value = str(item).partition("=")
        if base.get(name) == value:
            continue
        # Dockerfile ENV: a quoted value, its `\`, `"` and `$` escaped (no expansion).
        kept = base.get(name, "")
        for ch in ("\\", '"', "$"):
            kept = kept.replace(ch, "\\" + ch)
        changes.append(f'ENV {name}="{kept}"')
    return changes


async def _commit_without_env(s: CapsuleSession, container: Any, base_image: str, repo: str,
                              tag: str, message: str) -> str:
    """`docker commit` of `container` as `repo:tag`, its image's configs holding no variable
    of the container's environment but its base image's; returns the image id.

    Two commits: the first resets `Env` (`env_reset_changes`), but Docker before 25 also
    writes the container's whole config, environment included, into the image's
    `container_config`. The second commits a container created from the first image (never
    started: an empty layer), whose config is that image's, already reset. The first image
    stays on this host only, untagged under the second (removing the capsule prunes it)."""
    base_env = (await s.image_config(base_image)).get("Env") or []
    # Inspected now: a container object may carry a sparse listing's attrs, without Config.
    attrs = await s.call(s.client.api.inspect_container, container.id)
    own_env = (attrs.get("Config") or {}).get("Env") or []
    first = await s.call(container.commit, message=message,
                         changes=env_reset_changes(own_env, base_env),
                         timeout_s=LONG_DOCKER_CALL)
    blank: Any = None
    image: Any = None
    try:
        blank = await s.call(s.client.containers.create, first.id, network_mode="none")
        image = await s.call(blank.commit, repository=repo, tag=tag, message=message,
                             timeout_s=LONG_DOCKER_CALL)
    finally:
        with contextlib.suppress(docker.errors.DockerException):
            if blank is not None:
                await s.call(blank.remove, force=True)
            if image is None:  # failed: the first image is no one's parent
                await s.call(s.client.images.remove, first.id, force=True)
    return str(image.id)


async def commit(s: CapsuleSession, handle: UnitHandle, capture_id: str, dumped: DumpResult,
                 *, registry: str | None = None,
                 repository: str | None = None,
                 inet_sockets: Sequence[InetSocketRecord] = ()) -> CommittedCapsule:
    """The dumped unit as a capsule, all or nothing:
    - its CRIU images packed into objects on this host, under
      <data_dir>/capsules/<capture>/<unit>/criu/, and the dump directory emptied;
    - `docker commit` of its container: the rootfs diff over the base image only, with the
      base image's environment (`_commit_without_env`);
    - with a `registry` or a `repository` (`push_repository`), that image pushed there (the
      manifest names it by digest); without either, its layers above the base exported to
      .../capsule.tar (the `oci-capsule` object).
    """
    step = "commit"
    spec = handle.spec
    container = await s.container(handle.container_id, handle.unit, step)
    repo, tag = capsule_reference(spec.unit_id, capture_id)
    out_dir = capsule_dir(s.target.data_dir, capture_id, spec.unit_id)
    host = s.target.host
    image_id: str | None = None
    marks = [time.monotonic()]
    objects: list[CapsuleObject] = []
    pushed: str | None = None
    try:
        if handle.images_dir is None:
            raise ValueError("the unit has no dumped CRIU images")
        await make_private_dir(host, out_dir)
        image_set, packed = await pack_images(host, handle.images_dir, f"{out_dir}/criu",
                                              size_hint=dumped.images_bytes)
        objects += [CapsuleObject(ROLE_CRIU_IMAGE, HostFile(s.host, p.path, p.sha256, p.bytes,
                                                               out_dir))
                    for p in packed]
        await clear_dump(s.target.host, handle.images_dir)
        marks.append(time.monotonic())
        image_id = await _commit_without_env(s, container, spec.image, repo, tag,
                                             f"coldsnap capsule of unit {spec.unit_id}")
        base = await rootfs_layers(s, spec.image)
        layers = await rootfs_layers(s, image_id)
        if layers[:len(base)] != base:
            raise ValueError(f"the committed capsule {image_id} is not layered on its base "
                             f"{spec.image}")
        marks.append(time.monotonic())
        target = push_repository(spec.unit_id, registry=registry, repository=repository)
        if target is not None:
            pushed = await push(s, spec.unit_id, image_id, target, tag)
        else:
            exported = await export_layers(s, spec.unit_id, f"{repo}:{tag}", len(base),
                                           f"{out_dir}/capsule.tar")
            objects.append(CapsuleObject(ROLE_CAPSULE, HostFile(
                s.host, exported.path, exported.sha256, exported.bytes, out_dir)))
        marks.append(time.monotonic())
    except Exception as exc:
        await discard_dir(host, out_dir)
        if image_id is not None:
            with contextlib.suppress(docker.errors.DockerException):
                await s.call(s.client.images.remove, image_id, force=True)
        raise fail(s, handle.unit, step, f"{type(exc).__name__}: {exc}", CommitFailed) from exc
    assert handle.engine_pid is not None
    log.info("capsule.committed", host=s.host, unit=handle.unit, step=step, image=image_id,
             pushed=pushed, criu_objects=len(packed), criu_bytes=image_set.total_bytes,
             pack_seconds=round(marks[1] - marks[0], 3),
             commit_seconds=round(marks[2] - marks[1], 3),
             export_seconds=round(marks[3] - marks[2], 3))
    manifest = CapsuleManifest(
        unit_id=spec.unit_id,
        image=CapsuleImage(unit=spec.unit_id, reference=pushed or f"{repo}:{tag}",
                                   digest=pushed.partition("@")[2] if pushed else image_id),
        image_id=image_id, pushed=pushed, base_image=spec.image,
        base_image_digest=spec.image_digest, criu_images=image_set,
        engine_pid=handle.engine_pid, worker_pids=dict(handle.worker_pids),
        captured_devices=list(handle.devices), weights_released=spec.release_weights,
        kv_discarded=kv_discarded(handle), kv_released_bytes=(
            handle.kv_release.released_bytes if handle.kv_release is not None else None),
        accelerator=spec.accelerator,
        quiesce="drain" if spec.drains else "sleep", cache_seed=handle.cache_seed,
        crossing=adapter_for(spec.engine).crossing(spec.accelerator),
        host_address=spec.address, inet_sockets=list(inet_sockets))
    return CommittedCapsule(manifest, tuple(objects), capture_id)


async def discard_capsule(s: CapsuleSession, capsule: CommittedCapsule) -> None:
    """Delete a committed capsule from its capture host (image, objects and the replay plans
    beside them), e.g. on rollback. A pushed capsule stays in the registry: nothing names it
    once no artifact does."""
    await remove_capsule_files(s.target.host, s.target.data_dir, capsule.capture_id,
                               capsule.unit_id)
    with contextlib.suppress(docker.errors.DockerException):
        await s.call(s.client.images.remove, capsule.manifest.image_id, force=True)


async def discard_capsule_by_name(s: CapsuleSession, unit_id: str, capture_id: str) -> None:
    """What a commit of this unit for `capture_id` may have left (its tagged image, its files
    on the host), known by name only: the commit was cancelled before it returned."""
    repo, tag = capsule_reference(unit_id, capture_id)
    with contextlib.suppress(docker.errors.DockerException):
        await s.call(s.client.images.remove, f"{repo}:{tag}", force=True)
    await remove_capsule_files(s.target.host, s.target.data_dir, capture_id, unit_id)


__all__ = [
    "CapsuleObject",
    "CommittedCapsule",
    "ExportedLayers",
    "capsule_reference",
    "capsule_repository",
    "commit",
    "discard_capsule",
    "discard_capsule_by_name",
    "ensure_image",
    "env_reset_changes",
    "export_layers",
    "load_capsule",
    "push",
    "rootfs_layers",
    "split_reference",
]
