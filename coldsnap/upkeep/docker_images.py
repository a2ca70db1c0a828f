"""Capsule images in a host's Docker that no artifact of this store references: the Docker part
of `coldsnapd gc --unreferenced` on a host.

Only images named under a `coldsnap/capsule/` repository are judged (base images are not
coldsnapd's). One is kept when an artifact names it (its id, or a repository digest, is an
artifact's capsule digest), when a tag of it was made by a capture this store did not record
(another control node's, told by the tag a capture derives from its id), or by a capture that
runs or whose artifact is kept. The rest go, one name at a time, never forced: Docker refuses
to delete an image a container uses (a stopped earlier instance a restore keeps for its
rollback included), and that image is kept, said why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import docker.errors

from coldsnap.capsule.session import CapsuleSession

REPOSITORY = "coldsnap/capsule/"

Judge = Callable[[str, int, str], None]  # what, bytes, why


def _capsule_names(image: Any) -> list[str]:
    names = [*(image.tags or []), *(image.attrs.get("RepoDigests") or [])]
    return [n for n in names if f"/{REPOSITORY}" in f"/{n.partition('@')[0]}"]


def _tagged(name: str) -> tuple[str, str] | None:
    """(repository, tag) of a tagged name; None for a digest reference."""
    if "@" in name:
        return None
    repo, _, tag = name.rpartition(":")
    return (repo, tag) if repo and "/" not in tag else None


async def sweep_capsule_images(s: CapsuleSession, referenced: set[str],
                               tag_owner: Callable[[str, str], str | None], *, dry_run: bool,
                               removed: Judge, kept: Judge) -> None:
    """`referenced`: every artifact's capsule digests; `tag_owner(repository, tag)`: None when
    the tag is of a capture of this store that is unreferenced (its image may go), else why it
    stays (another control node's tag included)."""
    for image in await s.call(s.client.images.list):
        names = _capsule_names(image)
        if not names:
            continue
        size = int(image.attrs.get("Size") or 0)
        what = f"image {image.id[:19]} ({', '.join(names)})"
        digests = {image.id} | {n.partition("@")[2] for n in names if "@" in n}
        if digests & referenced:
            kept(what, size, "an artifact's capsule")
            continue
        reasons = [tag_owner(*t) for t in map(_tagged, names) if t is not None]
        why = next((r for r in reasons if r is not None), None)
        if why is not None:
            kept(what, size, why)
            continue
        if dry_run:
            removed(what, size, "no artifact references it")
            continue
        try:
            for name in names:
                try:
                    await s.call(s.client.images.remove, name, force=False)
                except docker.errors.NotFound:
                    continue  # gone with an earlier name of it
        except docker.errors.APIError as exc:
            if exc.status_code != 409:
                raise
            kept(what, size, "a container uses it")
            continue
        removed(what, size, "no artifact references it")


__all__ = ["sweep_capsule_images"]
