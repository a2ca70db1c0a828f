"""The policy `coldsnapd serve` enforces (`--policy FILE`, default /etc/coldsnap/policy.yaml):
who may submit, and which images, host paths and output paths a submission may name.

    images:      {allow: [registry/repository prefix | sha256:<digest>, ...]}
    mounts:      {allow: [host path root, ...]}     launch.units[].mounts[].source
                 targets: [container path root, ...]  launch.units[].mounts[].target
                   (optional: narrows where a mount may land, on top of the rule every
                   request obeys, coldsnap.formats.request.mount_targets; absent: that rule)
    log_paths:   {allow: [host path root, ...]}     workload.log_path
    outputs:     {allow: [path root, ...]}          output, --receipt-json, --timing-events
    submitters:  {groups: [group name, ...]}        whose members may submit
    queue:       {max_per_uid: 64, max_total: 1024} jobs accepted and not ended (HTTP 429 past)
    artifacts:   {shared_with: [group name, ...]}   who may use another uid's artifacts
    workloads:   {reserved: [{prefix: ID prefix, groups: [group name, ...]}, ...]}
    unrestricted: false   # true: root (uid 0) is not held to the rules above

A section left out allows nothing (`queue` has its defaults, `workloads` reserves nothing).
Without a policy file only root may submit, and root is then unrestricted
(`ServicePolicy.root_only()`).

Pure: the checks take the request and paths as given; the service reads the file and the
submitter's groups (coldsnap.service.submitter_checks), and the capsule layer checks the host's
`realpath` of each mount and log path against the same roots (`host_roots`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from coldsnap.digests import is_digest
from coldsnap.formats.artifact import Artifact
from coldsnap.formats.capsule import CapsuleManifest
from coldsnap.formats.documents import (
    DocumentUnreadable,
    decode_document,
    encoding_of,
    read_document,
    value_issues,
)
from coldsnap.formats.errors import DocumentInvalid, ValidationIssue
from coldsnap.formats.fields import AbsPath, NonEmpty, StrictModel
from coldsnap.formats.request import Request
from coldsnap.formats.request.parse import pydantic_issues

DEFAULT_POLICY = "/etc/coldsnap/policy.yaml"
MAX_POLICY_BYTES = 1024 * 1024


class PolicyInvalid(DocumentInvalid):
    """The policy file cannot be used; every issue names its key."""


class ImageRule(StrictModel):
    allow: list[NonEmpty] = Field(default_factory=list)


class PathRule(StrictModel):
    allow: list[AbsPath] = Field(default_factory=list)


class MountRule(PathRule):
    targets: list[AbsPath] | None = None


class SubmitterRule(StrictModel):
    groups: list[NonEmpty] = Field(default_factory=list)


# The queue's defaults: far above what one team's hosts run at once, far below what stalls the
# service (its admission is linear in the jobs a submission shares a unit, GPU or port with).
DEFAULT_MAX_PER_UID = 64
DEFAULT_MAX_TOTAL = 1024


class QueueRule(StrictModel):
    """Caps on the jobs the service holds (queued or running, not ended): one uid's, and
    everyone's. Root is held to `max_total` only (the service must keep working for it)."""

    max_per_uid: int = Field(default=DEFAULT_MAX_PER_UID, ge=1)
    max_total: int = Field(default=DEFAULT_MAX_TOTAL, ge=1)


class ArtifactRule(StrictModel):
    """Whose artifacts a non-root uid may restore, publish or delete besides its own: a
    member of one of `shared_with` may use any uid's (root always may)."""

    shared_with: list[NonEmpty] = Field(default_factory=list)


class ReservedWorkloads(StrictModel):
    """Workload ids (`workload.cluster_id`) starting with `prefix` may be started only by
    members of `groups` (and root)."""

    prefix: NonEmpty
    groups: list[NonEmpty] = Field(default_factory=list)


class WorkloadRule(StrictModel):
    reserved: list[ReservedWorkloads] = Field(default_factory=list)


class ServicePolicy(StrictModel):
    images: ImageRule = Field(default_factory=ImageRule)
    mounts: MountRule = Field(default_factory=MountRule)
    log_paths: PathRule = Field(default_factory=PathRule)
    outputs: PathRule = Field(default_factory=PathRule)
    submitters: SubmitterRule = Field(default_factory=SubmitterRule)
    queue: QueueRule = Field(default_factory=QueueRule)
    artifacts: ArtifactRule = Field(default_factory=ArtifactRule)
    workloads: WorkloadRule = Field(default_factory=WorkloadRule)
    unrestricted: bool = False

    @classmethod
    def root_only(cls) -> ServicePolicy:
        """The policy of a service without a policy file: no group may submit (root always
        may), and root is held to nothing."""
        return cls(unrestricted=True)

    def binds(self, uid: int) -> bool:
        """Whether the rules hold for `uid`: for everyone but an unrestricted root."""
        return not (uid == 0 and self.unrestricted)


def parse_service_policy(data: Any) -> ServicePolicy:
    """The policy from a decoded document; PolicyInvalid names every bad or unknown key."""
    if data is None:
        data = {}  # an empty file: every section absent, nothing allowed
    if not isinstance(data, dict):
        raise PolicyInvalid([ValidationIssue("", "the policy must be a mapping")])
    problems = value_issues(data, what="policy")
    if problems:
        raise PolicyInvalid(problems)
    try:
        return ServicePolicy.model_validate(data)
    except ValidationError as exc:
        raise PolicyInvalid([ValidationIssue(i.path, "unknown key" if i.message ==
                                             "unknown field" else i.message)
                             for i in pydantic_issues(exc)]) from None


def load_service_policy(path: Path) -> ServicePolicy:
    """The policy file at `path`, decoded strictly (a repeated key is refused)."""
    try:
        data = decode_document(read_document(path, limit=MAX_POLICY_BYTES), what="policy",
                               encoding=encoding_of(path))
    except DocumentUnreadable as exc:
        raise PolicyInvalid([ValidationIssue("", str(exc))]) from None
    return parse_service_policy(data)


# (mount roots, log path roots); None: unrestricted
HostRoots = tuple[tuple[str, ...] | None, tuple[str, ...] | None]


def host_roots(policy: ServicePolicy, uid: int) -> HostRoots:
    """The roots the capsule layer holds the host's `realpath` of mounts and log paths to."""
    if not policy.binds(uid):
        return None, None
    return tuple(policy.mounts.allow), tuple(policy.log_paths.allow)


def normalized(path: str) -> str | None:
    """`path` made canonical without touching a disk (posixpath.normpath, one leading '/');
    None when it is not absolute. An absolute path cannot climb above '/', so no `..` is
    left to escape a root after this."""
    if not path.startswith("/") or "\0" in path:
        return None
    return "/" + posixpath.normpath(path).lstrip("/")


def within(path: str, roots: Iterable[str]) -> bool:
    """Whether the normalized `path` is one of `roots` or lies beneath one of them."""
    norm = normalized(path)
    if norm is None:
        return False
    for root in roots:
        r = normalized(root)
        if r is not None and (norm == r or r == "/" or norm.startswith(r + "/")):
            return True
    return False


def path_refusal(field: str, path: str, roots: Sequence[str], rule: str) -> str | None:
    """`FIELD: PATH is outside RULE (ROOTS)`, or None when the path is within a root."""
    if normalized(path) is None:
        return f"{field}: {path} is not an absolute path ({rule} holds absolute roots)"
    if within(path, roots):
        return None
    return f"{field}: {path} is outside {rule} ({', '.join(roots) or 'nothing allowed'})"


def _repository(image: str) -> str:
    """`registry/repository` of an image reference, without its digest or tag."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


def image_allowed(allow: Sequence[str], image: str, image_digest: str) -> bool:
    """An entry that is a digest must equal the unit's `image_digest`, one that is a whole
    reference (`repo@sha256:...`) the unit's `image`; any other entry is a
    `registry/repository` prefix, matched on `/` boundaries (`reg/team` allows
    `reg/team/engine` but not `reg/team-b/engine`)."""
    repo = _repository(image)
    for entry in allow:
        if "@" in entry:
            if entry == image:
                return True
            continue
        if is_digest(entry):
            if entry == image_digest:
                return True
            continue
        prefix = entry.rstrip("/")
        if prefix and (repo == prefix or repo.startswith(prefix + "/")):
            return True
    return False


def request_refusals(policy: ServicePolicy, uid: int, request: Request | None, *,
                     client_paths: Sequence[tuple[str, str]] = ()) -> list[str]:
    """Every rule the submission breaks, one line each naming its field. `client_paths` are
    the (field, path) pairs of the files the client will write (its receipt, timing events);
    `-` (stdout) is no path."""
    if not policy.binds(uid):
        return []
    lines: list[str] = []
    outputs = policy.outputs.allow
    if request is not None:
        for i, unit in enumerate(request.launch.units):
            if not image_allowed(policy.images.allow, unit.image, unit.image_digest):
                allowed = ", ".join(policy.images.allow) or "nothing allowed"
                lines.append(f"launch.units[{i}].image: {unit.image} is outside images.allow "
                             f"({allowed})")
            for j, mount in enumerate(unit.mounts):
                lines.append(path_refusal(f"launch.units[{i}].mounts[{j}].source",
                                          mount.source, policy.mounts.allow,
                                          "mounts.allow") or "")
                if policy.mounts.targets is not None:
                    lines.append(path_refusal(f"launch.units[{i}].mounts[{j}].target",
                                              mount.target, policy.mounts.targets,
                                              "mounts.targets") or "")
        log_path = request.workload.log_path if request.workload else None
        if log_path is not None:
            lines.append(path_refusal("workload.log_path", log_path, policy.log_paths.allow,
                                      "log_paths.allow") or "")
        if request.output is not None:
            lines.append(path_refusal("output", request.output, outputs, "outputs.allow") or "")
    for field, path in client_paths:
        if path != "-":
            lines.append(path_refusal(field, path, outputs, "outputs.allow") or "")
    return [line for line in lines if line]



def restore_image_refusals(allow: Sequence[str], artifact: Artifact,
                           manifests: Mapping[str, CapsuleManifest]) -> list[str]:
    """Every image a restore of `artifact` would start that `allow` (images.allow) does not
    match, one line each naming the artifact's field: each unit's base (its launch image, and
    the base its capsule manifest says it was committed over, by digest) and each capsule
    pushed to a registry (started from there by digest). A capsule kept as an `oci-capsule`
    object is loaded over its base, which is checked. `manifests`: by unit id."""
    where = f"artifact {artifact.capture_id}"
    rule = f"images.allow ({', '.join(allow) or 'nothing allowed'})"
    lines = []
    for i, unit in enumerate(artifact.launch.units):
        if not image_allowed(allow, unit.image, unit.image_digest):
            lines.append(f"{where}: launch.units[{i}].image: {unit.image} is outside {rule}")
        manifest = manifests.get(unit.id)
        if manifest is not None and not image_allowed(allow, manifest.base_image,
                                                      manifest.base_image_digest):
            lines.append(f"{where}: the capsule manifest of unit {unit.id}: base_image "
                         f"{manifest.base_image} ({manifest.base_image_digest}) is outside "
                         f"{rule}")
    for i, image in enumerate(artifact.capsule.images):
        if "@" in image.reference and not image_allowed(allow, image.reference, image.digest):
            lines.append(f"{where}: capsule.images[{i}] (unit {image.unit}): "
                         f"{image.reference} is outside {rule}")
    return lines


def reserved_workload_refusal(policy: ServicePolicy, uid: int, request: Request | None,
                              groups: Iterable[str]) -> str | None:
    """Why `uid`, in `groups`, may not name its request's `workload.cluster_id`: a prefix of
    the policy's workloads.reserved that none of its groups holds. Root always may."""
    cluster = request.workload.cluster_id if request and request.workload else None
    if uid == 0 or not cluster:
        return None
    mine = set(groups)
    for i, rule in enumerate(policy.workloads.reserved):
        if cluster.startswith(rule.prefix) and not mine & set(rule.groups):
            return (f"workload.cluster_id: {cluster} is reserved by workloads.reserved[{i}] "
                    f"(prefix {rule.prefix!r}, groups {', '.join(rule.groups) or 'none'}); "
                    f"uid {uid} is in none of them")
    return None
