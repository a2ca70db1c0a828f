"""Where staging takes an object's bytes from: the control node's store (sent over the host's
SSH link), or an OCI registry the artifact is published to (the host pulls it itself, by
digest; the control node moves no object bytes). Either way the host's copy lands at the same
path, verified against the object's digest and stamped, so the survey and the skip of what is
held stay the same; a CRIU image object from a registry goes straight into the image set being
assembled instead (`Delivery.place`), its bytes written once.

`--stage-from` (`StageFrom`) chooses: `store`, `registry`, or `auto` (the registry when the
artifact records a publication, else the store). From a registry, the replay plans still come
from the store: the registry holds only their redacted form (coldsnap.formats.publication).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Literal, Protocol

from coldsnap.formats.artifact import ROLE_REPLAY_PLAN, ArtifactObject
from coldsnap.hosts.base import Host, ProgressCallback
from coldsnap.hosts.registry.access import RegistryAccess
from coldsnap.hosts.registry.blobs import BlobPuller, blob_puller, transfer_timeout
from coldsnap.store import LocalStore, ObjectCorrupt

StageFrom = Literal["auto", "store", "registry"]
STAGE_FROM: tuple[StageFrom, ...] = ("auto", "store", "registry")

Progress = Callable[[str], ProgressCallback | None] | None
Copies = list[list[tuple[str, int, int, int]]]


class Delivery(Protocol):
    """What brings objects to one host while its staging runs (`ObjectSource.session`)."""

    async def deliver(self, remote: str, obj: ArtifactObject, progress: Progress) -> int:
        """Bring the object's bytes to `remote` on the host, verified against its digest and
        published; returns the bytes that crossed to the host for it."""
        ...

    async def place(self, obj: ArtifactObject, part: str, copies: Copies,
                    progress: Progress) -> int | None:
        """Bring a CRIU image object's bytes straight into the files of the image set being
        assembled in `part` on the host (`copies`: `CriuImageSet.copies`), verified against
        its digest; the bytes that crossed, or None when this source cannot, and the object
        goes through `deliver` and a staged file."""
        ...


class ObjectSource(Protocol):
    @property
    def kind(self) -> str:
        """"store" or "registry": what reports and logs say."""
        ...

    def keeps_partial(self, obj: ArtifactObject) -> bool:
        """Whether a failed staging keeps the object's partial file: a registry pull's is
        resumed by the next try (gc sweeps it after a day); one sent from the store is
        discarded."""
        ...

    @property
    def in_flight(self) -> int:
        """How many objects staging brings to one host at once from here."""
        ...

    def after_the_rest(self, obj: ArtifactObject) -> bool:
        """Whether staging brings the object only once the others have landed on the host."""
        ...

    def session(self, host: Host,
                objects: Sequence[ArtifactObject]) -> AbstractAsyncContextManager[Delivery]:
        """What brings `objects` (those staging sends to `host`, `Delivery.deliver` called
        for each) there, open while the host's staging runs; leaving it ends what it started
        on the host."""
        ...

    def check(self, objects: list[ArtifactObject]) -> None:
        """Refuse (StoreError) before anything is staged when an object cannot come from
        here."""
        ...


@dataclass(frozen=True)
class StoreSource:
    """The control node's store: each object sent over the host's SSH transport."""

    store: LocalStore
    kind: str = "store"
    # Each object in flight is a transfer the control node itself runs (its reads, an
    # OpenSSH client or asyncssh's Python packet path): three overlap their fixed costs.
    in_flight: int = 3

    def check(self, objects: list[ArtifactObject]) -> None:
        for obj in objects:
            self.store.verify(obj.sha256)

    def keeps_partial(self, obj: ArtifactObject) -> bool:
        return False

    def after_the_rest(self, obj: ArtifactObject) -> bool:
        return False

    @contextlib.asynccontextmanager
    async def session(self, host: Host,
                      objects: Sequence[ArtifactObject]) -> AsyncIterator[Delivery]:
        yield _StoreDelivery(self, host)

    async def deliver(self, host: Host, remote: str, obj: ArtifactObject,
                      progress: Progress) -> int:
        """The object sent to `remote` on `host` (see `Delivery.deliver`)."""
        local = self.store.object_path(obj.sha256)
        if not local.is_file():
            raise ObjectCorrupt(f"object {obj.sha256} ({obj.role} of {obj.owner}) is missing "
                                f"from the store")
        callback = progress(f"{host.name} {obj.role} {obj.owner}") if progress else None
        # The far side's hash is checked against the object's digest, so the store's bytes
        # are verified by the one hash that also proves the far copy.
        sent = await host.put(local, remote, progress=callback, expected=obj.sha256)
        if sent.sha256 != obj.sha256:
            # The store's bytes changed under us: nothing was published, and nothing may stay.
            await host.run(["rm", "-f", "--", remote], check=False)
            raise ObjectCorrupt(f"object {obj.sha256} in the store hashed to {sent.sha256} "
                                f"while being sent to {host.name}")
        return sent.sent_bytes


@dataclass(frozen=True)
class RegistrySource:
    """A repository of an OCI registry that holds every object as a blob of its digest: each
    host pulls its own, resuming what an earlier pull left."""

    access: RegistryAccess
    repository: str
    kind: str = "registry"
    # One helper on the host runs a staging's pulls (`session`), and each pull still pays
    # fixed costs the link idles through (its first request, the fsync of a CRIU-sized
    # chunk at its end): five at once keep the link busier than three
    # (`scripts/bench staging --link`, docs/hosts.md "Measured").
    in_flight: int = 5
    # Where the replay plans come from: the registry holds them redacted (their environment
    # withheld), and the store holds the ones the artifact names (a capture or an import
    # brought them here).
    store: LocalStore | None = None

    def check(self, objects: list[ArtifactObject]) -> None:
        """The replay plans must be in the store; the registry answers for its blobs, and
        each pull verifies what lands."""
        if self.store is not None:
            StoreSource(self.store).check([o for o in objects if o.role == ROLE_REPLAY_PLAN])

    def from_store(self, obj: ArtifactObject) -> bool:
        """Whether the object comes from the store (a replay plan), not the registry."""
        return obj.role == ROLE_REPLAY_PLAN and self.store is not None

    def keeps_partial(self, obj: ArtifactObject) -> bool:
        # A replay plan comes from the store even here: nothing resumes its partial file.
        return not self.from_store(obj)

    def after_the_rest(self, obj: ArtifactObject) -> bool:
        # The store's plans wait for the host's pulls: a registry that refuses the host (its
        # credentials, a blob it lacks) then leaves nothing of the artifact there. A plan is
        # a few KiB: one round trip after the pulls.
        return self.from_store(obj)

    @contextlib.asynccontextmanager
    async def session(self, host: Host,
                      objects: Sequence[ArtifactObject]) -> AsyncIterator[Delivery]:
        """One `blob-pulls` helper on the host for every blob it pulls (started only when
        there is one to pull): a python start per staging, not per object."""
        if all(self.from_store(o) for o in objects):
            yield _RegistryDelivery(self, host, None)
            return
        async with blob_puller(host, self.access, self.repository) as puller:
            yield _RegistryDelivery(self, host, puller)


@dataclass(frozen=True)
class _StoreDelivery:
    source: StoreSource
    host: Host

    async def deliver(self, remote: str, obj: ArtifactObject, progress: Progress) -> int:
        return await self.source.deliver(self.host, remote, obj, progress)

    async def place(self, obj: ArtifactObject, part: str, copies: Copies,
                    progress: Progress) -> int | None:
        # Sent over SSH, an object lands in a staged file of its own (the put's far side
        # verifies and publishes whole files): `place_object` copies it into the set.
        return None


@dataclass(frozen=True)
class _RegistryDelivery:
    source: RegistrySource
    host: Host
    puller: BlobPuller | None  # None when the session pulls nothing

    async def deliver(self, remote: str, obj: ArtifactObject, progress: Progress) -> int:
        if self.source.from_store(obj) and self.source.store is not None:
            return await StoreSource(self.source.store).deliver(self.host, remote, obj,
                                                                progress)
        if self.puller is None:
            raise ValueError(f"{obj.sha256} was not among the objects the session was "
                             f"opened for")
        pulled = await self.puller.pull(obj.sha256, obj.bytes, remote,
                                        timeout=transfer_timeout(obj.bytes))
        return pulled.received

    async def place(self, obj: ArtifactObject, part: str, copies: Copies,
                    progress: Progress) -> int | None:
        if self.puller is None or self.source.from_store(obj):
            return None
        pulled = await self.puller.place(obj.sha256, obj.bytes, part, copies,
                                         timeout=transfer_timeout(obj.bytes))
        return pulled.received


@dataclass(frozen=True)
class Publication:
    """Where an artifact is published: a registry (HOST[:PORT]) and a repository in it."""

    registry: str
    repository: str


def parse_publication(ref: str) -> Publication:
    """`REGISTRY/REPOSITORY[:TAG][@sha256:HEX]`, as `publish` records it, to its registry and
    repository (a ValueError naming the reference when it has no registry or repository)."""
    name = ref.split("@", 1)[0]
    registry, sep, repository = name.partition("/")
    last = repository.rsplit("/", 1)[-1]
    if ":" in last:
        repository = repository[: len(repository) - len(last)] + last.split(":", 1)[0]
    if not sep or not registry or not repository:
        raise ValueError(f"publication {ref!r} is not REGISTRY/REPOSITORY[@DIGEST]")
    return Publication(registry, repository)


def published_at(store: LocalStore, capture_id: str) -> Publication | None:
    """The latest full publication the store records for the capture, else None."""
    # A native publication carries only the payloads and replay plans: staging needs a full one.
    refs = [ref for ref, kind in store.publication_records(capture_id) if kind == "full"]
    return parse_publication(refs[-1]) if refs else None


def choose_source(stage_from: StageFrom, store: LocalStore,
                  publication: Publication | None,
                  access: Callable[[str], RegistryAccess]) -> ObjectSource:
    """The source `--stage-from` asks for: `registry` needs a publication (ValueError naming
    the flag otherwise), `auto` takes the registry when there is one. `access`: how to reach
    a registry (the inventory's `registries` entry)."""
    if stage_from == "store" or (stage_from == "auto" and publication is None):
        return StoreSource(store)
    if publication is None:
        raise ValueError("--stage-from registry: the artifact is not published to a registry "
                         "(`coldsnapd publish`)")
    return RegistrySource(access(publication.registry), publication.repository, store=store)


__all__ = [
    "STAGE_FROM",
    "Copies",
    "Delivery",
    "ObjectSource",
    "Progress",
    "Publication",
    "RegistrySource",
    "StageFrom",
    "StoreSource",
    "choose_source",
    "parse_publication",
    "published_at",
]
