"""The OCI capsule: only the rootfs diff of the unit's container over its digest-pinned base
image, as an image of its own (manifest, config, layers), never the CRIU images.

Capture commits the dumped container. With a registry (the inventory's `registry`), the
capture host pushes it and the artifact names it by digest (`REGISTRY/coldsnap/capsule/UNIT@
sha256:...`); every restore host pulls it by digest, its base layers already there. Without
one, the capture host exports the layers above the base (`docker save`, then the base's layers
left out on the host) as the unit's `oci-capsule` object, and a restore host loads that after
making sure it has the base image: Docker reads no layer it already holds.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any

import docker.errors
import structlog

from coldsnap.capsule.errors import CapsuleError, ImageDigestMismatch, RestoreFailed
from coldsnap.capsule.runtime import fail
from coldsnap.capsule.session import LONG_DOCKER_CALL, CapsuleSession
from coldsnap.capsule.spec import docker_name
from coldsnap.formats.capsule import CapsuleManifest
from coldsnap.hosts.helper import helper_argv

log = structlog.get_logger("coldsnap.capsule")

_BARE_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def split_reference(ref: str) -> tuple[str, str | None, str | None]:
    """`repo[:tag][@sha256:...]` -> (repo, tag, digest); a registry port is not a tag, and a
    bare `sha256:<hex>` (which the request format allows) has no repository at all."""
    if _BARE_DIGEST.fullmatch(ref):
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
    if pushed is None or not _BARE_DIGEST.fullmatch(pushed):
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


__all__ = [
    "ExportedLayers",
    "capsule_repository",
    "ensure_image",
    "export_layers",
    "load_capsule",
    "push",
    "rootfs_layers",
    "split_reference",
]
