"""Operation request, format 4: strict models, defaults, every validation rule, `request_sha256`.

Public API:
- `load_request(path, *, expected_operation=None) -> Request`: read a YAML or JSON file (at most
  16 MiB) and validate it; raises `RequestInvalid` whose `.issues` lists every problem.
- `parse_request(data, *, expected_operation=None, encoding=None) -> Request`: the same from
  bytes, text or an already decoded mapping. `encoding` is `"json"`, `"yaml"` or None (sniffed).
- `Request.request_sha256` / `request_sha256(req)`: digest of the canonical JSON of the request
  after defaults were applied. `Request.canonical()` is that JSON object.
- `launch_issues(launch) -> list[ValidationIssue]`: the execution-graph rules alone (used by
  `coldsnap.topology.resolve` on launches that did not come through `parse_request`).
- `apply_defaults(raw) -> dict`: the context-dependent policy defaults, on a raw mapping.

Validation runs in two passes. The first (pydantic, strict, unknown fields refused) checks every
field's type, pattern and enum and reports all of them at once. The second checks the rules that
relate fields to each other (references, uniqueness, ranges, cross-field policy); it needs
well-typed input, so it runs in full only when the first pass found nothing; when only fields
outside `launch` are mistyped, the execution-graph rules still run and are reported too.

A field that is absent and has no default is omitted from the canonical form (never written as
`null`), so a request that leaves out `workload` hashes the same as one that never knew of it.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)
from pydantic_core import PydanticCustomError

from coldsnap.formats.canonical import canonical_json, digest
from coldsnap.formats.errors import RequestInvalid, ValidationIssue, format_path, join

MAX_REQUEST_BYTES = 16 * 1024 * 1024
# Alias expansion in YAML can turn a small file into a huge tree; a request never needs this many.
MAX_NODES = 4_000_000

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_REPOSITORY = re.compile(r"[a-z0-9._:/-]+")

SUPPORTED_OPERATIONS = ("capture", "restore", "sleep", "wake", "status")
LATER_OPERATIONS = ("publish", "publish-native")
# Operations on a workload that a restore started: they name the artifact it came from and the
# workload's cluster id, by which its containers are labelled.
LIFECYCLE_OPERATIONS = ("sleep", "wake", "status")

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
DRIVER_MINIMUM_MAJOR = {"n580": 580, "n610": 610}
DEFAULT_GRAPH_POLICY = {"n580": "recreate-from-plan", "n610": "preserve-nccl-exec"}

DEFAULT_HEALTH_PATH = "/health"
DEFAULT_PROMPT = "Reply with exactly: coldsnap-cuda-snapshot-ok"
DEFAULT_EXPECTED = "coldsnap-cuda-snapshot-ok"


def _fail(message: str) -> PydanticCustomError:
    return PydanticCustomError("coldsnap", message)


def _is_id(value: str) -> bool:
    return _ID.fullmatch(value) is not None


def _check_id(value: str) -> str:
    if not _is_id(value):
        raise _fail(f"must match {ID_PATTERN}")
    return value


def _check_qualified(value: str) -> str:
    parts = value.split(":")
    if len(parts) != 2 or not all(_is_id(p) for p in parts):
        raise _fail("must be NAMESPACE:NAME, exactly one ':' with an id on each side")
    return value


def _check_digest(value: str) -> str:
    if _DIGEST.fullmatch(value) is None:
        raise _fail("must be sha256: followed by 64 lowercase hex digits")
    return value


def _check_non_empty(value: str) -> str:
    if not value:
        raise _fail("must not be empty")
    return value


def is_clean_absolute(value: str) -> bool:
    # normpath keeps a leading '//' (POSIX allows it a meaning), so refuse it explicitly.
    return (
        value.startswith("/")
        and not value.startswith("//")
        and "\0" not in value
        and posixpath.normpath(value) == value
    )


def _check_abs_path(value: str) -> str:
    if not is_clean_absolute(value):
        raise _fail("must be an absolute, clean path (no '.', '..', '//' or trailing '/')")
    return value


def _check_rel_path(value: str) -> str:
    if (
        not value
        or value.startswith("/")
        or "\0" in value
        or posixpath.normpath(value) != value
        or value == "."
        or value.split("/")[0] == ".."
    ):
        raise _fail("must be a clean relative path that stays inside its root")
    return value


def _check_env_name(value: str) -> str:
    if _ENV_NAME.fullmatch(value) is None:
        raise _fail("is not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
    return value


def _check_health_path(value: str) -> str:
    if not value.startswith("/"):
        raise _fail("must start with '/'")
    return value


def _check_log_path(value: str) -> str:
    _check_abs_path(value)
    if value == "/":
        raise _fail("must not be '/'")
    return value


def _check_repository(value: str) -> str:
    if _REPOSITORY.fullmatch(value) is None:
        raise _fail("must use only lowercase [a-z0-9._:/-]")
    if "@" in value or ":" in value.rsplit("/", 1)[-1]:
        raise _fail("must name a repository without a tag or digest")
    return value


def _check_host(value: str) -> str:
    if not value or any(c.isspace() for c in value):
        raise _fail("must be a non-empty host name without whitespace")
    return value


def _check_operation(value: str) -> str:
    if value in LATER_OPERATIONS:
        raise _fail(f"operation '{value}' is not supported by this coldsnapd ("
                    + ", ".join(SUPPORTED_OPERATIONS) + ")")
    if value not in SUPPORTED_OPERATIONS:
        raise _fail("must be one of " + ", ".join(f"'{o}'" for o in SUPPORTED_OPERATIONS))
    return value


Id = Annotated[str, AfterValidator(_check_id)]
QualifiedName = Annotated[str, AfterValidator(_check_qualified)]
Digest = Annotated[str, AfterValidator(_check_digest)]
NonEmpty = Annotated[str, AfterValidator(_check_non_empty)]
AbsPath = Annotated[str, AfterValidator(_check_abs_path)]
RelPath = Annotated[str, AfterValidator(_check_rel_path)]
EnvName = Annotated[str, AfterValidator(_check_env_name)]
HostName = Annotated[str, AfterValidator(_check_host)]
NonNegative = Annotated[int, Field(ge=0)]


class StrictModel(BaseModel):
    """Base of every format model: strict types, unknown fields refused, absent fields omitted."""

    model_config = ConfigDict(extra="forbid", strict=True, serialize_by_alias=True)

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Only this model's own fields are filtered: a null inside an opaque JSON value (an
        # adapter payload) is data and must survive, or its digest would change.
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None}

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# ---------------------------------------------------------------------------------------------
# launch


class ModelRef(StrictModel):
    id: NonEmpty
    revision: NonEmpty
    source: NonEmpty | None = None


class Mount(StrictModel):
    source: AbsPath
    target: AbsPath
    read_only: bool = False


class Unit(StrictModel):
    id: Id
    index: NonNegative
    host: HostName
    devices: Annotated[list[NonEmpty], Field(min_length=1)]
    image: str
    image_digest: Digest
    command: Annotated[list[NonEmpty], Field(min_length=1)]
    environment: dict[EnvName, str] = Field(default_factory=dict)
    mounts: list[Mount] = Field(default_factory=list)


class Worker(StrictModel):
    id: Id
    unit: Id
    service: Id
    process_slot: NonNegative
    device_slots: Annotated[list[NonNegative], Field(min_length=1)]


class Group(StrictModel):
    id: Id
    kind: QualifiedName
    service: Id
    members: Annotated[list[Id], Field(min_length=1)]

    @property
    def is_world(self) -> bool:
        return self.kind.split(":", 1)[-1] == "world"


class Service(StrictModel):
    id: Id
    role: QualifiedName
    workers: Annotated[list[Id], Field(min_length=1)]


class Adapter(StrictModel):
    schema_: QualifiedName = Field(alias="schema")
    digest: Digest
    payload: dict[str, Any]


class Execution(StrictModel):
    workers: Annotated[list[Worker], Field(min_length=1)]
    groups: Annotated[list[Group], Field(min_length=1)]
    services: Annotated[list[Service], Field(min_length=1)]
    adapter: Adapter


class Launch(StrictModel):
    engine: Literal["vllm", "sglang"]
    model: ModelRef
    units: Annotated[list[Unit], Field(min_length=1)]
    execution: Execution


# ---------------------------------------------------------------------------------------------
# policy


class ProcessPolicy(StrictModel):
    backend: Literal["cuda-criu"] = "cuda-criu"
    kv_discard: bool = True
    async_graphs: bool = True
    # The real default depends on the snapshot driver; `apply_defaults` fills it in.
    graph_policy: Literal["", "preserve-exec", "recreate-from-plan", "preserve-nccl-exec"] = ""
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


class Policy(StrictModel):
    process: ProcessPolicy = Field(default_factory=ProcessPolicy)
    weights: WeightsPolicy = Field(default_factory=WeightsPolicy)
    cache: CachePolicy = Field(default_factory=CachePolicy)
    capsule: CapsulePolicy = Field(default_factory=CapsulePolicy)
    compatibility: CompatibilityPolicy = Field(default_factory=CompatibilityPolicy)


# ---------------------------------------------------------------------------------------------
# top level


class SnapshotDriver(StrictModel):
    id: Literal["n580", "n610"]

    @property
    def minimum_driver_major(self) -> int:
        return DRIVER_MINIMUM_MAJOR[self.id]


class Workload(StrictModel):
    cluster_id: NonEmpty | None = None
    intent_id: NonEmpty | None = None
    recipe: NonEmpty | None = None
    runtime: NonEmpty | None = None
    model: NonEmpty | None = None
    served_model_name: NonEmpty | None = None
    log_path: Annotated[str, AfterValidator(_check_log_path)] | None = None


class Lifecycle(StrictModel):
    activation_state: Literal["running", "warm"] = "running"


class Validation(StrictModel):
    health_path: Annotated[str, AfterValidator(_check_health_path)] = DEFAULT_HEALTH_PATH
    prompt: NonEmpty = DEFAULT_PROMPT
    expected: NonEmpty = DEFAULT_EXPECTED


class Request(StrictModel):
    format: Literal[4] = 4
    kind: Literal["coldsnap-operation-request"] = "coldsnap-operation-request"
    operation: Annotated[str, AfterValidator(_check_operation)]
    id: Id
    snapshot_driver: SnapshotDriver
    output: NonEmpty | None = None
    artifact: NonEmpty | None = None
    workload: Workload | None = None
    lifecycle: Lifecycle | None = None
    launch: Launch
    policy: Policy = Field(default_factory=Policy)
    validation: Validation = Field(default_factory=Validation)

    def canonical(self) -> dict[str, Any]:
        """The request as hashed: JSON object with every default applied."""
        return self.model_dump(mode="json")

    @property
    def request_sha256(self) -> str:
        return digest(self.canonical())


def request_sha256(req: Request) -> str:
    return req.request_sha256


# ---------------------------------------------------------------------------------------------
# decoding


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and keeps timestamps as strings.

    A YAML date would otherwise become a Python date, which JSON cannot carry; keeping it a
    string gives the YAML and JSON spellings of one request the same digest.
    """


_Loader.yaml_implicit_resolvers = {
    key: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    out: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in out
        except TypeError as exc:
            raise yaml.constructor.ConstructorError(
                None, None, "unhashable mapping key", key_node.start_mark
            ) from exc
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        out[key] = loader.construct_object(value_node, deep=True)
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _decode(data: bytes, encoding: str | None) -> Any:
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestInvalid([ValidationIssue("", f"request is not UTF-8: {exc.reason}")]) from None
    use_json = encoding == "json" or (encoding is None and text.lstrip().startswith("{"))
    json_error: str | None = None
    if use_json:
        try:
            return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
        except (ValueError, RecursionError) as exc:
            json_error = f"request is not valid JSON: {exc}"
            if encoding == "json":
                raise RequestInvalid([ValidationIssue("", json_error)]) from None
            # A YAML flow mapping also starts with '{'; let the YAML parser have its say.
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        # Text that looked like JSON is reported as JSON: that is what its author wrote.
        message = json_error or "request is not valid YAML: " + " ".join(str(exc).split())
        raise RequestInvalid([ValidationIssue("", message)]) from None
    except RecursionError:
        raise RequestInvalid([ValidationIssue("", "request is nested too deeply")]) from None


def _json_issues(root: Any) -> list[ValidationIssue]:
    """Refuse anything canonical JSON cannot carry, so later hashing cannot fail."""
    issues: list[ValidationIssue] = []
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), root)]
    count = 0
    while stack:
        loc, value = stack.pop()
        count += 1
        if count > MAX_NODES:
            return [ValidationIssue("", f"request has more than {MAX_NODES} values")]
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    issues.append(ValidationIssue(format_path(loc), f"key {key!r} is not a string"))
                    continue
                stack.append(((*loc, key), item))
        elif isinstance(value, list):
            stack.extend(((*loc, i), item) for i, item in enumerate(value))
        elif isinstance(value, float):
            if not math.isfinite(value):
                issues.append(ValidationIssue(format_path(loc), "is not a finite number"))
        elif value is not None and not isinstance(value, str | int | bool):
            kind = type(value).__name__
            issues.append(ValidationIssue(format_path(loc), f"a {kind} value is not JSON"))
        if len(issues) >= 1000:
            break
    return issues


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
    if isinstance(process, dict) and "graph_policy" not in process:
        process = dict(process)
        async_graphs = process.get("async_graphs", True)
        driver = _get(out.get("snapshot_driver"), "id")
        if async_graphs is False:
            process["graph_policy"] = ""
        elif isinstance(driver, str) and driver in DEFAULT_GRAPH_POLICY:
            process["graph_policy"] = DEFAULT_GRAPH_POLICY[driver]
        policy["process"] = process

    cache = policy.get("cache", {})
    if isinstance(cache, dict) and "paths" not in cache:
        cache = dict(cache)
        seed = cache.get("seed", True)
        cache["paths"] = [] if seed is False else list(DEFAULT_CACHE_PATHS)
        policy["cache"] = cache
    return out


_MESSAGES = {
    "missing": "required field is missing",
    "extra_forbidden": "unknown field",
    "too_short": "must not be empty",
}


def _pydantic_issues(error: ValidationError) -> list[ValidationIssue]:
    issues = []
    for item in error.errors(include_url=False):
        loc = [p for p in item["loc"] if p != "[key]"]
        message = _MESSAGES.get(item["type"], item["msg"])
        if item["type"] == "literal_error":
            message = message.replace("Input should be", "must be")
        elif item["type"] == "greater_than_equal":
            message = "must be >= 0"
        issues.append(ValidationIssue(format_path(loc), message))
    return issues


def parse_request(
    data: bytes | str | Mapping[str, Any],
    *,
    expected_operation: str | None = None,
    encoding: Literal["json", "yaml"] | None = None,
) -> Request:
    raw: Any
    if isinstance(data, str | bytes):
        blob = data.encode("utf-8") if isinstance(data, str) else data
        if len(blob) > MAX_REQUEST_BYTES:
            raise RequestInvalid([ValidationIssue("", f"request is larger than 16 MiB "
                                                      f"({len(blob)} bytes)")])
        raw = _decode(blob, encoding)
    else:
        raw = data
    if not isinstance(raw, dict):
        raise RequestInvalid([ValidationIssue("", "request must be a mapping (a JSON object)")])
    json_issues = _json_issues(raw)
    if json_issues:
        raise RequestInvalid(json_issues)
    if not isinstance(data, str | bytes) and len(canonical_json(raw)) > MAX_REQUEST_BYTES:
        raise RequestInvalid([ValidationIssue("", "request is larger than 16 MiB")])
    defaulted = apply_defaults(raw)
    try:
        req = Request.model_validate(defaulted)
    except ValidationError as exc:
        issues = _pydantic_issues(exc)
        # A type error elsewhere (say in policy) should not hide graph errors in a launch that
        # is itself well-typed: check the launch on its own and report both.
        try:
            launch = Launch.model_validate(defaulted.get("launch"))
        except ValidationError:
            pass
        else:
            issues.extend(launch_issues(launch))
        raise RequestInvalid(issues) from None
    issues = request_issues(req, expected_operation=expected_operation)
    if issues:
        raise RequestInvalid(issues)
    return req


def load_request(path: Path, *, expected_operation: str | None = None) -> Request:
    try:
        with path.open("rb") as handle:
            blob = handle.read(MAX_REQUEST_BYTES + 1)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise RequestInvalid([ValidationIssue("", f"cannot read {path}: {reason}")]) from None
    if len(blob) > MAX_REQUEST_BYTES:
        raise RequestInvalid([ValidationIssue("", f"{path} is larger than 16 MiB")])
    suffix = path.suffix.lower()
    encoding: Literal["json", "yaml"] | None = None
    if suffix == ".json":
        encoding = "json"
    elif suffix in (".yaml", ".yml"):
        encoding = "yaml"
    return parse_request(blob, expected_operation=expected_operation, encoding=encoding)


# ---------------------------------------------------------------------------------------------
# second pass: rules between fields


class _Issues(list[ValidationIssue]):
    def add(self, path: str, message: str) -> None:
        self.append(ValidationIssue(path, message))


def _first_positions(ids: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i, value in enumerate(ids):
        out.setdefault(value, i)
    return out


def _unique_ids(issues: _Issues, base: str, ids: list[str], what: str) -> None:
    first: dict[str, int] = {}
    for i, value in enumerate(ids):
        if value in first:
            issues.add(f"{base}[{i}].id", f"duplicate {what} id '{value}' "
                                          f"(first at {base}[{first[value]}])")
        else:
            first[value] = i


def _image_issue(unit: Unit) -> str | None:
    image, pinned = unit.image, unit.image_digest
    if not image or any(c.isspace() for c in image):
        return "must be a non-empty image reference without whitespace"
    if image == pinned:
        return None
    if "@" in image:
        repo, _, ref = image.rpartition("@")
        if ref != pinned:
            return f"pins digest '{ref}' but image_digest is '{pinned}'"
        if not repo:
            return "has an empty repository before '@'"
        return None
    return (f"'{image}' is not pinned by digest (a mutable tag is refused); "
            f"write it as REPOSITORY@{pinned}")


def launch_issues(launch: Launch, base: str = "launch") -> list[ValidationIssue]:
    """Every rule of the execution graph: units, devices, workers, groups, services, adapter."""
    issues = _Issues()
    units = launch.units
    execution = launch.execution
    ex = f"{base}.execution"

    _unique_ids(issues, f"{base}.units", [u.id for u in units], "unit")
    unit_at = _first_positions([u.id for u in units])
    device_owner: dict[tuple[str, str], str] = {}
    for i, unit in enumerate(units):
        up = f"{base}.units[{i}]"
        if unit.index != i:
            issues.add(f"{up}.index", f"must equal the unit's position {i}, got {unit.index}")
        first_in_unit: dict[str, int] = {}
        for j, device in enumerate(unit.devices):
            if device in first_in_unit:
                issues.add(f"{up}.devices[{j}]", f"device '{device}' is listed twice in this unit "
                                                 f"(also devices[{first_in_unit[device]}])")
                continue
            first_in_unit[device] = j
            other = device_owner.get((unit.host, device))
            if other is not None:
                issues.add(f"{up}.devices[{j}]",
                           f"device '{device}' on host '{unit.host}' is already used by {other}")
            else:
                device_owner[(unit.host, device)] = f"{up}.devices[{j}]"
        image_problem = _image_issue(unit)
        if image_problem:
            issues.add(f"{up}.image", image_problem)
        targets: dict[str, int] = {}
        for j, mount in enumerate(unit.mounts):
            if mount.target in targets:
                issues.add(f"{up}.mounts[{j}].target", f"mount target '{mount.target}' repeats "
                                                       f"mounts[{targets[mount.target]}]")
            else:
                targets[mount.target] = j

    workers = execution.workers
    services = execution.services
    groups = execution.groups
    _unique_ids(issues, f"{ex}.workers", [w.id for w in workers], "worker")
    _unique_ids(issues, f"{ex}.services", [s.id for s in services], "service")
    _unique_ids(issues, f"{ex}.groups", [g.id for g in groups], "group")
    worker_at = _first_positions([w.id for w in workers])
    service_ids = {s.id for s in services}

    process_slots: dict[tuple[str, int], int] = {}
    device_slots: dict[tuple[str, int], int] = {}
    owning_units: set[str] = set()
    for i, worker in enumerate(workers):
        wp = f"{ex}.workers[{i}]"
        if worker.service not in service_ids:
            issues.add(f"{wp}.service", f"unknown service '{worker.service}'")
        if worker.unit not in unit_at:
            issues.add(f"{wp}.unit", f"unknown unit '{worker.unit}'")
            continue
        owning_units.add(worker.unit)
        unit = units[unit_at[worker.unit]]
        key = (worker.unit, worker.process_slot)
        if key in process_slots:
            issues.add(f"{wp}.process_slot",
                       f"process slot {worker.process_slot} of unit '{worker.unit}' is already "
                       f"taken by {ex}.workers[{process_slots[key]}]")
        else:
            process_slots[key] = i
        seen: set[int] = set()
        for j, slot in enumerate(worker.device_slots):
            sp = f"{wp}.device_slots[{j}]"
            if slot >= len(unit.devices):
                issues.add(sp, f"slot {slot} is out of range: unit '{unit.id}' has "
                               f"{len(unit.devices)} device(s), slots 0..{len(unit.devices) - 1}")
            elif slot in seen:
                issues.add(sp, f"slot {slot} is repeated")
            elif (worker.unit, slot) in device_slots:
                issues.add(sp, f"slot {slot} of unit '{unit.id}' is already owned by "
                               f"{ex}.workers[{device_slots[(worker.unit, slot)]}]")
            else:
                device_slots[(worker.unit, slot)] = i
            seen.add(slot)
    for i, unit in enumerate(units):
        if unit_at[unit.id] == i and unit.id not in owning_units:
            issues.add(f"{base}.units[{i}]", f"unit '{unit.id}' owns no worker; every unit needs "
                                             f"at least one")

    service_of = {w.id: w.service for w in workers}
    for i, service in enumerate(services):
        sp = f"{ex}.services[{i}]"
        listed: set[str] = set()
        for j, wid in enumerate(service.workers):
            if wid in listed:
                issues.add(f"{sp}.workers[{j}]", f"worker '{wid}' is repeated")
                continue
            listed.add(wid)
            if wid not in worker_at:
                issues.add(f"{sp}.workers[{j}]", f"unknown worker '{wid}'")
            elif service_of[wid] != service.id:
                issues.add(f"{sp}.workers[{j}]",
                           f"worker '{wid}' belongs to service '{service_of[wid]}' "
                           f"({ex}.workers[{worker_at[wid]}].service)")
        missing = [w.id for w in workers if w.service == service.id and w.id not in listed]
        if missing:
            issues.add(f"{sp}.workers", "missing worker(s) whose service is "
                                        f"'{service.id}': {', '.join(missing)}")

    in_groups: dict[str, int] = defaultdict(int)
    world_groups: dict[str, list[int]] = defaultdict(list)
    for i, group in enumerate(groups):
        gp = f"{ex}.groups[{i}]"
        if group.service not in service_ids:
            issues.add(f"{gp}.service", f"unknown service '{group.service}'")
        members: set[str] = set()
        for j, wid in enumerate(group.members):
            mp = f"{gp}.members[{j}]"
            if wid in members:
                issues.add(mp, f"worker '{wid}' is repeated (a position is a rank)")
                continue
            members.add(wid)
            if wid not in worker_at:
                issues.add(mp, f"unknown worker '{wid}'")
                continue
            if service_of[wid] != group.service:
                issues.add(mp, f"worker '{wid}' belongs to service '{service_of[wid]}', not "
                               f"'{group.service}'; a group never spans services")
            in_groups[wid] += 1
            if group.is_world:
                world_groups[wid].append(i)
    for i, worker in enumerate(workers):
        if worker_at[worker.id] != i:
            continue
        wp = f"{ex}.workers[{i}]"
        worlds = world_groups.get(worker.id, [])
        if in_groups[worker.id] == 0:
            issues.add(wp, f"worker '{worker.id}' is in no group")
        elif not worlds:
            issues.add(wp, f"worker '{worker.id}' is in no group whose kind is '*:world'")
        if len(worlds) > 1:
            where = ", ".join(f"{ex}.groups[{g}]" for g in worlds)
            issues.add(wp, f"worker '{worker.id}' is in {len(worlds)} world groups ({where}); "
                           "exactly one is allowed")

    adapter = execution.adapter
    try:
        actual = digest(adapter.payload)
    except (TypeError, ValueError):
        issues.add(f"{ex}.adapter.payload", "is not a JSON object")
    else:
        if actual != adapter.digest:
            issues.add(f"{ex}.adapter.digest",
                       f"does not match the canonical digest of payload ({actual})")
    return list(issues)


def _inside(path: str, root: str) -> bool:
    """True when `path` equals `root` or lies below it (both clean and absolute)."""
    return path == root or root == "/" or path.startswith(root + "/")


# Where an operation's artifact is: capture writes it to `output`, restore reads it from
# `artifact`. (operation: the field it needs, what that field holds, the field it refuses, why)
_ARTIFACT_FIELDS = {
    "capture": ("output", "the path the artifact file is written to",
                "artifact", "is for restore; a capture names its destination in 'output'"),
    "restore": ("artifact", "the artifact file's path, a capture id or a digest prefix",
                "output", "is for capture; a restore names its source in 'artifact'"),
}


def request_issues(req: Request, *, expected_operation: str | None = None) -> list[ValidationIssue]:
    issues = _Issues()
    if expected_operation is not None and req.operation != expected_operation:
        issues.add("operation", f"is '{req.operation}' but the command is '{expected_operation}'")
    if req.operation in _ARTIFACT_FIELDS:
        needed, meaning, refused, why = _ARTIFACT_FIELDS[req.operation]
        if getattr(req, needed) is None:
            issues.add(needed, f"is required for {req.operation}: {meaning}")
        if getattr(req, refused) is not None:
            issues.add(refused, why)
    if req.operation in LIFECYCLE_OPERATIONS:
        _lifecycle_issues(issues, req)

    if req.workload is not None:
        given = req.workload.model_dump(exclude_none=True)
        if given:
            for name in ("cluster_id", "intent_id", "recipe", "runtime", "model"):
                if name not in given:
                    issues.add(f"workload.{name}", "is required once any workload field is set")

    if (req.lifecycle is not None and req.lifecycle.activation_state == "warm"
            and (req.operation != "restore" or req.snapshot_driver.id != "n610")):
        issues.add("lifecycle.activation_state", "'warm' is only for a restore with driver n610")

    graph_issues = launch_issues(req.launch)
    issues.extend(graph_issues)
    if not graph_issues:
        _rank_issues(issues, req.launch)

    process = req.policy.process
    if process.async_graphs:
        if not process.graph_policy:
            issues.add("policy.process.graph_policy", "must be set when async_graphs is true")
        for i, unit in enumerate(req.launch.units):
            for j, arg in enumerate(unit.command):
                if "--enforce-eager" in arg:
                    issues.add(f"launch.units[{i}].command[{j}]",
                               "--enforce-eager is refused while policy.process.async_graphs "
                               "is true (eager mode has no CUDA graphs to capture)")
    else:
        if process.graph_policy:
            issues.add("policy.process.graph_policy", "must be empty when async_graphs is false")
        if process.shape_calibration == "enabled":
            issues.add("policy.process.shape_calibration", "'enabled' needs async_graphs")

    weights = req.policy.weights
    if weights.mode != "native" and not weights.recovery.enabled:
        issues.add("policy.weights.recovery.enabled",
                   f"must be true for weights mode '{weights.mode}' (only 'native' may "
                   "disable recovery)")
    worker_ids = {w.id for w in req.launch.execution.workers}
    native = weights.native
    if native is not None:
        for wid in (native.files_by_worker or {}):
            if wid not in worker_ids:
                issues.add(join("policy.weights.native.files_by_worker", wid),
                           f"unknown worker '{wid}'")
        for i, staged in enumerate(native.staged or []):
            if staged.worker not in worker_ids:
                issues.add(f"policy.weights.native.staged[{i}].worker",
                           f"unknown worker '{staged.worker}'")

    _cache_issues(issues, req)
    return list(issues)


def _lifecycle_issues(issues: _Issues, req: Request) -> None:
    """sleep, wake and status act on a running workload: which artifact it was restored from,
    and its cluster id, by which its containers are found."""
    op = req.operation
    if req.artifact is None:
        issues.add("artifact", f"is required for {op}: the artifact the workload was restored "
                               "from")
    if req.output is not None:
        issues.add("output", f"is for capture; {op} names its artifact in 'artifact'")
    given = req.workload.model_dump(exclude_none=True) if req.workload is not None else {}
    # With other workload fields set, the workload rule already names a missing cluster_id.
    if not given:
        issues.add("workload.cluster_id", f"is required for {op}: the workload's containers "
                                          "are found by it")


def _rank_issues(issues: _Issues, launch: Launch) -> None:
    """A `RANK` given in a unit's environment must be the world rank of the unit's worker.

    One environment is shared by every process of the unit, so it can agree with the graph
    only when the unit runs a single worker. `LOCAL_RANK` is a process slot, never checked
    against global identity.
    """
    rank_of: dict[str, int] = {}
    for group in launch.execution.groups:
        if group.is_world:
            rank_of.update({member: i for i, member in enumerate(group.members)})
    for i, unit in enumerate(launch.units):
        value = unit.environment.get("RANK")
        if value is None:
            continue
        path = f"launch.units[{i}].environment.RANK"
        workers = [w.id for w in launch.execution.workers if w.unit == unit.id]
        if len(workers) != 1:
            issues.add(path, f"unit '{unit.id}' runs {len(workers)} workers; one RANK cannot "
                             "agree with all their world ranks (leave RANK to the engine)")
        elif value != str(rank_of[workers[0]]):
            issues.add(path, f"is {value!r} but worker '{workers[0]}' has world rank "
                             f"{rank_of[workers[0]]}")


def _cache_issues(issues: _Issues, req: Request) -> None:
    cache = req.policy.cache
    base = "policy.cache"
    if not cache.seed:
        if cache.paths:
            issues.add(f"{base}.paths", "must be empty when seed is false")
        if cache.staged:
            issues.add(f"{base}.staged", "must be empty when seed is false")
    seen: dict[str, int] = {}
    for i, path in enumerate(cache.paths):
        pp = f"{base}.paths[{i}]"
        if path in seen:
            issues.add(pp, f"repeats paths[{seen[path]}]")
            continue
        seen[path] = i
        if not any(_inside(path, root) for root in CACHE_ROOTS):
            issues.add(pp, "is not under a known compiler-cache root (" + ", ".join(CACHE_ROOTS)
                       + ")")
    # Nesting through each path's ancestors and a lookup table: linear in the paths times
    # their depth, where comparing every pair took seconds for a few thousand paths.
    first = {p: i for i, p in reversed(list(enumerate(cache.paths)))}
    for i, path in enumerate(cache.paths):
        parent = posixpath.dirname(path)
        while parent != path:
            j = first.get(parent)
            if j is not None:
                issues.add(f"{base}.paths[{i}]", f"is nested inside paths[{j}] ('{parent}')")
            path, parent = parent, posixpath.dirname(parent)

    if cache.staged:
        if req.operation != "capture":
            issues.add(f"{base}.staged", "is only for capture")
        unit_ids = [u.id for u in req.launch.units]
        counted: dict[str, int] = {}
        for i, entry in enumerate(cache.staged):
            if entry.unit not in unit_ids:
                issues.add(f"{base}.staged[{i}].unit", f"unknown unit '{entry.unit}'")
            elif entry.unit in counted:
                issues.add(f"{base}.staged[{i}].unit", f"unit '{entry.unit}' already has "
                                                       f"staged[{counted[entry.unit]}]")
            else:
                counted[entry.unit] = i
        missing = [u for u in unit_ids if u not in counted]
        if missing and req.operation == "capture":
            issues.add(f"{base}.staged", "needs exactly one entry per unit; missing: "
                                         + ", ".join(missing))

    for i, unit in enumerate(req.launch.units):
        for j, mount in enumerate(unit.mounts):
            for k, path in enumerate(cache.paths):
                if _inside(mount.target, path) or _inside(path, mount.target):
                    issues.add(f"launch.units[{i}].mounts[{j}].target",
                               f"'{mount.target}' overlaps the runtime cache path "
                               f"policy.cache.paths[{k}] ('{path}')")
