"""The request's `policy`, and the defaults that depend on other fields of the request."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from coldsnap.formats.fields import (
    AbsPath,
    Digest,
    Id,
    NonEmpty,
    NonNegative,
    RelPath,
    StrictModel,
    invalid,
)

_REPOSITORY = re.compile(r"[a-z0-9._:/-]+")

DEFAULT_CACHE_PATHS = ("/var/cache/coldsnap/runtime",)
CACHE_ROOTS = (
    "/var/cache/coldsnap",
    "/root/.cache/vllm",
    "/root/.cache/torch",
    "/root/.cache/torch_extensions",
    "/root/.cache/flashinfer",
    "/root/.triton/cache",
    "/tmp/torchinductor_root",  # noqa: S108 - a path inside the engine container, not ours
    "/tmp/coldsnap-derived-cache",  # noqa: S108
)
DEFAULT_GRAPH_POLICY = {"n580": "recreate-from-plan", "n610": "preserve-nccl-exec"}


def _check_repository(value: str) -> str:
    # Empty is the reference's "no repository" (Sparkrun sends a recipe's unset one so).
    if value == "":
        return value
    if _REPOSITORY.fullmatch(value) is None:
        raise invalid("must use only lowercase [a-z0-9._:/-]")
    if "@" in value or ":" in value.rsplit("/", 1)[-1]:
        raise invalid("must name a repository without a tag or digest")
    return value


class ProcessPolicy(StrictModel):
    backend: Literal["cuda-criu"] = "cuda-criu"
    kv_discard: bool = True
    async_graphs: bool = True
    # The real default depends on the snapshot driver; `apply_defaults` fills it in.
    graph_policy: Literal["", "disabled", "preserve-exec", "recreate-from-plan",
                          "preserve-nccl-exec"] = ""
    shape_calibration: Literal["auto", "enabled", "disabled"] = "auto"
    artifact_scope: Literal["portable", "target-local"] = "portable"


class NativeStagedFile(StrictModel):
    worker: Id
    path: AbsPath
    bytes: NonNegative
    sha256: Digest
    validation: NonEmpty | None = None


class NativeWeights(StrictModel):
    repository: NonEmpty | None = None
    revision: NonEmpty | None = None
    files_by_worker: dict[Id, RelPath] | None = None
    staged: list[NativeStagedFile] | None = None
    materialize: Literal["off", "async", "required"] | None = None


class Recovery(StrictModel):
    enabled: bool = True
    source: NonEmpty | None = None
    loader_backend: Literal["direct", "buffered", "auto", "mmap", "torch"] | None = None


class WeightsPolicy(StrictModel):
    mode: Literal["auto", "native", "recovery", "cache-only-auto"] = "auto"
    native: NativeWeights | None = None
    recovery: Recovery = Field(default_factory=Recovery)


class CacheStaged(StrictModel):
    unit: Id
    path: AbsPath


class CachePolicy(StrictModel):
    seed: bool = True
    paths: list[AbsPath] = Field(default_factory=lambda: list(DEFAULT_CACHE_PATHS))
    staged: list[CacheStaged] = Field(default_factory=list)


class CapsulePolicy(StrictModel):
    repository: Annotated[str, AfterValidator(_check_repository)] | None = None


class CompatibilityPolicy(StrictModel):
    enforce_captured_driver_floor: bool = True
    kernel: Literal["capability", "exact"] = "capability"
    # Where the workers meet (--master-addr, --dist-init-addr, MASTER_ADDR): absent or
    # `rank0-host`, on the host of the world's rank-0 unit; `external`, a server elsewhere that
    # every unit's host must reach. Optional so that the canonical form of a request that does
    # not say stays as it was.
    rendezvous: Literal["rank0-host", "external"] | None = None


class Policy(StrictModel):
    process: ProcessPolicy = Field(default_factory=ProcessPolicy)
    weights: WeightsPolicy = Field(default_factory=WeightsPolicy)
    cache: CachePolicy = Field(default_factory=CachePolicy)
    capsule: CapsulePolicy = Field(default_factory=CapsulePolicy)
    compatibility: CompatibilityPolicy = Field(default_factory=CompatibilityPolicy)


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else None


def apply_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """Fill the defaults that depend on other fields; plain defaults live on the models.

    Works on untrusted input: anything of the wrong type is left alone for validation to name.
    """
    out = dict(raw)
    policy = out.get("policy", {})
    if not isinstance(policy, dict):
        return out
    policy = dict(policy)
    out["policy"] = policy

    process = policy.get("process", {})
    # An empty graph_policy with async graphs is the reference's "the driver's default".
    if isinstance(process, dict) and process.get("graph_policy", "") == "" \
            and process.get("async_graphs", True) is not False:
        driver = _get(out.get("snapshot_driver"), "id")
        if isinstance(driver, str) and driver in DEFAULT_GRAPH_POLICY:
            process = dict(process)
            process["graph_policy"] = DEFAULT_GRAPH_POLICY[driver]
            policy["process"] = process

    cache = policy.get("cache", {})
    if isinstance(cache, dict) and "paths" not in cache:
        cache = dict(cache)
        seed = cache.get("seed", True)
        cache["paths"] = [] if seed is False else list(DEFAULT_CACHE_PATHS)
        policy["cache"] = cache
    return out
