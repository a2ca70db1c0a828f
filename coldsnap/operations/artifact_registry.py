"""Artifacts to and from an OCI registry, as OCI artifacts (coldsnap.formats.oci_artifact).

What is published is the artifact's published form (coldsnap.formats.publication): its
documents with every environment value and secret flag value withheld, the redacted
documents being objects of their own (pushed from memory: the store keeps only what its
artifacts name). A registry never receives a secret of the artifact's documents, whoever
captured or publishes it.

- `publish_artifact`: every object's blob from the local store (digest-verified: the store's
  stamp, and the registry checks what it receives), skipping blobs the repository holds and
  mounting those another repository of the registry holds (from the repositories this
  store's publications name), then the document as config, then the manifest. The pinned
  reference is recorded in the store's publications and returned.
- `publish_document`: the same when the hosts pushed their objects themselves (a capture
  with a registry): their blobs must be there already; the control-node-only objects come
  from the store.
- `import_published`: a published artifact into the store: its document (verified, parsed
  strictly, its layers matched against its objects), the control-node-only objects and the
  replay plans (a restore reads them); the other host-owned objects stay in the registry,
  and a restore's staging pulls them from there. When the store holds the full artifact
  that the publication is the published form of (this control node captured it), that one
  is kept and returned: its secrets are here, and a restore needs no request to give them.
  A failure indexes nothing (the verified objects fetched stay, for gc to judge).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from coldsnap.formats.artifact import (
    ROLE_CAPSULE_MANIFEST,
    ROLE_CAPTURE_REQUEST,
    ROLE_REPLAY_PLAN,
    Artifact,
    ArtifactObject,
    artifact_from_bytes,
)
from coldsnap.formats.canonical import canonical_json
from coldsnap.formats.errors import ArtifactInvalid
from coldsnap.formats.fields import is_registry_reference
from coldsnap.formats.oci_artifact import (
    MANIFEST_MEDIA_TYPE,
    ManifestInvalid,
    build_manifest,
    check_layers,
    manifest_digest,
    parse_manifest,
    published_objects,
)
from coldsnap.formats.publication import PublishedForm, published_form
from coldsnap.hosts.inventory import Inventory
from coldsnap.hosts.registry.access import RegistryAccess, access_for
from coldsnap.hosts.registry.reference import RegistryRef, parse_ref
from coldsnap.store import LocalStore, StoredArtifact, StoreError
from coldsnap.store.object_kinds import kind_problem
from coldsnap.store.refs import MAX_ARTIFACT_BYTES
from coldsnap.store.registry_client import RegistryClient

# Objects only the control node uses: a capture with a registry pushes them from the store.
CONTROL_NODE_ROLES = frozenset({ROLE_CAPSULE_MANIFEST, ROLE_CAPTURE_REQUEST})
# Objects an import brings into the store: those, and the workers' replay plans, which a
# restore reads on the control node too (where each payload is mounted) besides staging them.
# They are also the documents a publication redacts, so the control node pushes them
# (redacted), never their hosts.
IMPORTED_ROLES = CONTROL_NODE_ROLES | {ROLE_REPLAY_PLAN}
# Blobs sent at once (each a stream from the store's disk).
PUSHING = 4
# An import from a registry: one deadline for all of it, and a cap on each object it fetches
# (a control-node object: a capsule manifest, a capture request, a replay plan).
IMPORT_DEADLINE_S = 300.0
MAX_IMPORTED_OBJECT_BYTES = 64 * 1024 * 1024

# (object, bytes sent of it so far)
PublishProgress = Callable[[ArtifactObject, int], None]


class PublishFailed(Exception):
    """A publish or an import that cannot go on; the message names the artifact and object."""


def _unique(objects: list[ArtifactObject]) -> list[ArtifactObject]:
    seen: dict[str, ArtifactObject] = {}
    for obj in objects:
        seen.setdefault(obj.sha256, obj)
    return list(seen.values())


def mount_sources(store: LocalStore, target: RegistryRef) -> dict[str, list[str]]:
    """digest -> other repositories of the target's registry that this store published it
    to (any artifact's publication that carries it)."""
    sources: dict[str, list[str]] = {}
    good, _bad = store.scan_artifacts()
    for stored in good:
        try:
            records = store.publication_records(stored.capture_id)
        except StoreError:
            continue
        for text, kind in records:
            try:
                ref = parse_ref(text)
            except ValueError:
                continue
            if ref.registry != target.registry or ref.repository == target.repository:
                continue
            # What went is the published form: its redacted documents have digests of their own.
            try:
                form = published_form(stored.artifact, store.read_bytes).artifact
            except (StoreError, ValueError, ArtifactInvalid):
                continue
            for obj in published_objects(form, kind):
                repos = sources.setdefault(obj.sha256, [])
                if ref.repository not in repos:
                    repos.append(ref.repository)
    return sources


async def _push_object(client: RegistryClient, store: LocalStore, repo: str,
                       artifact: Artifact, obj: ArtifactObject, mounts: list[str],
                       progress: PublishProgress | None, documents: dict[str, bytes]) -> None:
    if await client.has_blob(repo, obj.sha256):
        return
    for other in mounts:
        if await client.mount_blob(repo, obj.sha256, other):
            return
    if obj.sha256 in documents:  # a redacted document: small, and not in the store
        await client.push_blob_bytes(repo, documents[obj.sha256])
        return
    what = f"artifact {artifact.capture_id}: {obj.role} of {obj.owner} ({obj.sha256})"
    try:
        path = store.verify(obj.sha256)
        size = path.stat().st_size
    except (StoreError, OSError) as exc:
        raise PublishFailed(f"{what}: {exc}") from None
    if size != obj.bytes:
        raise PublishFailed(f"{what}: the store's copy has {size} bytes, the artifact says "
                            f"{obj.bytes}")
    report = (lambda n: progress(obj, n)) if progress is not None else None
    await client.push_blob_file(repo, path, obj.sha256, size, report)


async def _push_all(client: RegistryClient, store: LocalStore, target: RegistryRef,
                    artifact: Artifact, objects: list[ArtifactObject],
                    progress: PublishProgress | None,
                    documents: dict[str, bytes] | None = None) -> None:
    sources = mount_sources(store, target)
    gate = asyncio.Semaphore(PUSHING)

    async def one(obj: ArtifactObject) -> None:
        async with gate:
            await _push_object(client, store, target.repository, artifact, obj,
                               sources.get(obj.sha256, []), progress, documents or {})

    # Largest first: they set the pace. The first failure cancels the others and is raised
    # as itself (it names the registry and the object).
    tasks = [asyncio.create_task(one(obj)) for obj in sorted(objects, key=lambda o: -o.bytes)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _finish(client: RegistryClient, store: LocalStore, target: RegistryRef,
                  artifact: Artifact, document: bytes, kind: str) -> str:
    await client.push_blob_bytes(target.repository, document)
    manifest = build_manifest(artifact, document, native_only=kind == "native")
    digest = await client.put_manifest(target.repository, target.tag or manifest_digest(manifest),
                                       manifest, MANIFEST_MEDIA_TYPE)
    pinned = RegistryRef(target.registry, target.repository, None, digest).pinned
    store.record_publication(artifact.capture_id, pinned, kind)
    return pinned


async def publish_artifact(store: LocalStore, stored: StoredArtifact, target: RegistryRef,
                           access: RegistryAccess, *, native_only: bool,
                           progress: PublishProgress | None = None,
                           client: RegistryClient | None = None) -> str:
    """Publish `stored` to `target` (REGISTRY/REPOSITORY[:TAG]; without a tag, by digest);
    returns `REGISTRY/REPOSITORY@sha256:<manifest digest>`. `client`: an open client of
    that registry to use (its counters then say what moved)."""
    if target.digest is not None:
        raise PublishFailed(f"publish target {target}: name a repository and optionally a "
                            "tag, not a digest (the manifest's digest is the result)")
    if access.registry != target.registry:
        raise PublishFailed(f"publish target {target}: access is for {access.registry}")
    kind = "native" if native_only else "full"
    form = _published(store, stored.artifact)
    artifact, document = form.artifact, form.document
    objects = _unique(published_objects(artifact, kind))
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(RegistryClient(access))
        await _push_all(client, store, target, artifact, objects, progress, form.documents)
        return await _finish(client, store, target, artifact, document, kind)
    raise AssertionError("unreachable")  # pragma: no cover (mypy: the with may swallow)


async def publish_document(client: RegistryClient, target: RegistryRef, artifact: Artifact,
                           store: LocalStore) -> str:
    """Publish `artifact` (full) whose host-owned objects the hosts pushed to `target`
    already: each is checked (HEAD; PublishFailed names the first missing one), the
    control-node objects and the replay plans are pushed from here, redacted, then the
    published document and the manifest. Returns the pinned reference, recorded in the
    store's publications."""
    repo = target.repository
    form = _published(store, artifact)
    artifact = form.artifact
    objects = _unique(list(artifact.objects))
    hosts_pushed = [o for o in objects if o.role not in IMPORTED_ROLES]
    present = await asyncio.gather(*(client.has_blob(repo, o.sha256) for o in hosts_pushed))
    for obj, there in zip(hosts_pushed, present, strict=True):
        if not there:
            raise PublishFailed(f"artifact {artifact.capture_id}: {obj.role} of {obj.owner} "
                                f"({obj.sha256}) is not in {target.registry}/{repo}: its "
                                "host did not push it")
    ours = [o for o in objects if o.role in IMPORTED_ROLES]
    await _push_all(client, store, target, artifact, ours, None, form.documents)
    return await _finish(client, store, target, artifact, form.document, "full")


def _published(store: LocalStore, artifact: Artifact) -> PublishedForm:
    """The artifact's published form (PublishFailed when a document cannot be read)."""
    try:
        return published_form(artifact, store.read_bytes)
    except (StoreError, ValueError, ArtifactInvalid) as exc:
        raise PublishFailed(f"artifact {artifact.capture_id}: its documents cannot be "
                            f"redacted for publishing: {exc}") from None


async def import_published(store: LocalStore, ref: RegistryRef, access: RegistryAccess,
                           *, client: RegistryClient | None = None) -> StoredArtifact:
    """Index the artifact published at `ref` (by digest, or a tag resolved to one) with its
    control-node-only objects; returns it. Already indexed with the same document: its
    publication is recorded and it is returned."""
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(RegistryClient(access))
        return await _import(store, ref, client)
    raise AssertionError("unreachable")  # pragma: no cover


async def _import(store: LocalStore, ref: RegistryRef, client: RegistryClient) -> StoredArtifact:
    repo = ref.repository
    data, _media_type, digest = await client.get_manifest(repo, ref.reference)
    pinned = RegistryRef(ref.registry, repo, None, digest).pinned
    try:
        manifest = parse_manifest(data)
    except ManifestInvalid as exc:
        raise PublishFailed(f"{pinned}: not a ColdSnap artifact manifest: {exc}") from None
    config = await client.get_blob_bytes(repo, manifest.config.digest, MAX_ARTIFACT_BYTES)
    try:
        artifact = artifact_from_bytes(config, f"{pinned}: its config")
    except ValueError as exc:
        raise PublishFailed(str(exc)) from None
    try:
        check_layers(manifest, artifact)
    except ManifestInvalid as exc:
        raise PublishFailed(f"{pinned}: {exc}") from None
    document_digest = manifest.config.digest
    indexed = store.indexed(artifact.capture_id)
    if indexed is not None:
        # The same publication imported before, or the full artifact it was published from
        # (redacting a published form again changes nothing).
        try:
            ours = published_form(indexed.artifact, store.read_bytes).document
        except (StoreError, ValueError, ArtifactInvalid):
            ours = canonical_json(indexed.artifact.to_json())
        if ours != canonical_json(artifact.to_json()):
            raise PublishFailed(f"{pinned}: the store {store.root} holds another artifact "
                                f"under capture id {artifact.capture_id} "
                                f"({indexed.digest[:19]}, not {document_digest[:19]})")
        store.record_publication(artifact.capture_id, pinned, manifest.kind)
        return indexed
    # The objects fetched stay on failure: whole and verified, named by their digest, and
    # `gc --unreferenced` removes them if nothing comes to reference them.
    stored: StoredArtifact | None = None
    try:
        carried = {o.sha256 for o in published_objects(artifact, manifest.kind)}
        for obj in _unique(list(artifact.objects)):
            if obj.role not in IMPORTED_ROLES or obj.sha256 not in carried \
                    or store.holds(obj.sha256):
                continue
            # The document's own claim is no bound: a control-node object is a manifest or a
            # request, far below MAX_IMPORTED_OBJECT_BYTES.
            if obj.bytes > MAX_IMPORTED_OBJECT_BYTES:
                raise PublishFailed(f"{pinned}: {obj.role} of {obj.owner} claims {obj.bytes} "
                                    f"bytes, over the import's cap of "
                                    f"{MAX_IMPORTED_OBJECT_BYTES} per object")
            blob = await client.get_blob_bytes(repo, obj.sha256, max(obj.bytes, 0))
            problem = kind_problem(obj, blob)
            if problem is not None:
                raise PublishFailed(f"{pinned}: {obj.role} of {obj.owner} ({obj.sha256[:19]}):"
                                    f" {problem}; nothing was indexed")
            store.add_bytes(blob)
        stored = store.put_artifact(artifact)
        store.record_publication(artifact.capture_id, pinned, manifest.kind)
        return stored
    except BaseException:
        if stored is not None:
            store.remove_artifact(artifact.capture_id)
        raise


def import_reference(store: LocalStore, text: str, inventory: Inventory) -> StoredArtifact:
    """`import_published` for a command's `--artifact REGISTRY/REPOSITORY@sha256:...`,
    reached as the inventory's `registries` says; run to completion from synchronous code
    (in a thread of its own when an event loop runs in this one). ValueError for a bad
    reference; PublishFailed, RegistryError or RegistryAccessError otherwise."""
    ref = parse_ref(text)
    if ref.digest is None:
        raise ValueError(f"registry reference {text!r}: name the artifact by digest "
                         "(REGISTRY/REPOSITORY@sha256:...), as `publish` prints it")
    # The control node fetches as root: only from a registry the site named, never one the
    # reference alone chose (a server-side request anywhere).
    if ref.registry not in inventory.registries:
        named = ", ".join(sorted(inventory.registries)) or "none"
        raise ValueError(f"registry reference {text!r}: registry {ref.registry} is not one of "
                         f"the inventory's registries ({named}); an artifact is imported only "
                         "from a registry the inventory names")
    access = access_for(inventory, ref.registry)
    work = _bounded_import(store, ref, access)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, work).result()


async def _bounded_import(store: LocalStore, ref: RegistryRef,
                          access: RegistryAccess) -> StoredArtifact:
    """`import_published` under one deadline for the whole import (IMPORT_DEADLINE_S): a
    slow registry holds a submission no longer than that."""
    try:
        return await asyncio.wait_for(import_published(store, ref, access), IMPORT_DEADLINE_S)
    except TimeoutError:
        raise PublishFailed(f"{ref.pinned if ref.digest else ref}: the import did not finish "
                            f"within {IMPORT_DEADLINE_S:.0f} s; nothing was indexed") from None


__all__ = ["CONTROL_NODE_ROLES", "IMPORTED_ROLES", "PublishFailed", "PublishProgress",
           "import_published", "import_reference", "is_registry_reference", "mount_sources",
           "publish_artifact", "publish_document"]
