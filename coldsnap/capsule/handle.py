"""What the capsule steps pass each other (the handle of one unit's container; what a dump
left, for the commit), and the error every step raises through (`fail`: a CapsuleError naming
host, unit and step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import UnitSpec
from coldsnap.engines import KvRelease, adapter_for
from coldsnap.formats.capsule import CacheSeed


@dataclass(frozen=True)
class CheckedBind:
    """One bind of a unit's container as it was checked on its host."""

    field_name: str  # the request's field it comes from, or what coldsnapd binds
    source: str  # as the request (or coldsnapd) names it
    target: str  # inside the container
    real: str  # `source` resolved on the host when the container was created
    identity: str  # st_dev:st_ino of `real`, no symlink followed


@dataclass
class UnitHandle:
    """A unit's container on one host, as the steps hand it to each other."""

    spec: UnitSpec
    host: str
    container_id: str
    container_name: str
    role: Literal["capture", "restore", "replay"]
    devices: tuple[str, ...]  # GPU UUIDs this container was given, by device slot
    engine_pid: int | None = None  # PID of the engine tree's root inside the container
    worker_pids: dict[str, int] = field(default_factory=dict)  # worker id -> PID inside
    # Host directory mounted at CRIU_IMAGES_DIR: a capture's dump target (private to this
    # container), or a restore's published image set (read-only, shared).
    images_dir: str | None = None
    # The container's writable paths (coldsnap.capsule.spec.writable_paths), each a volume;
    # empty for a container found by label, whose engine no step of ours dumps or restores.
    writable: tuple[str, ...] = ()
    # What seeded the runtime cache before the engine started (policy.cache.staged).
    cache_seed: CacheSeed | None = None
    # Its binds as they were checked on the host (host_paths.checked_binds); verified once
    # the container runs, before anything is exec'd in it (host_paths.verify_binds).
    binds: tuple[CheckedBind, ...] = ()
    # What the quiesce of a drained engine (the CPU) gave back of its KV cache, once the
    # engine released it (spec.discard_kv); None: nothing released.
    kv_release: KvRelease | None = None

    @property
    def unit(self) -> str:
        return self.spec.unit_id


def kv_discarded(handle: UnitHandle) -> bool:
    """Whether the unit's snapshot goes without its KV cache. A sleeping engine's sleep drops
    it as its spec says; a drained engine (the CPU) only once it released it, except a
    headless unit, whose workers' KV caches its head releases (vLLM's collective_rpc reaches
    every worker of the engine, and the head's release counts their bytes)."""
    if handle.spec.drains and adapter_for(handle.spec.engine).serves_api(handle.spec.command):
        return handle.kv_release is not None
    return handle.spec.discard_kv


@dataclass(frozen=True)
class DumpResult:
    unit_id: str
    images_bytes: int
    seconds: float


def fail(s: CapsuleSession, unit: str, step: str, detail: str,
         kind: type[CapsuleError] = CapsuleError) -> CapsuleError:
    return kind(s.host, unit, step, detail)
