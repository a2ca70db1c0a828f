"""Operation request, format 4: strict models, defaults, every validation rule, `request_sha256`.

Public API (everything below is importable from `coldsnap.formats.request`):
- `load_request(path, *, expected_operation=None) -> Request`: read a YAML or JSON file (at most
  16 MiB) and validate it; raises `RequestInvalid` whose `.issues` lists every problem.
- `parse_request(data, *, expected_operation=None, encoding=None) -> Request`: the same from
  bytes, text or an already decoded mapping. `encoding` is `"json"`, `"yaml"` or None (sniffed).
- `Request.request_sha256` / `request_sha256(req)`: digest of the canonical JSON of the request
  after defaults were applied. `Request.canonical()` is that JSON object.
- `launch_issues(launch) -> list[ValidationIssue]`: the execution-graph rules alone (used by
  `coldsnap.topology.resolve` on launches that did not come through `parse_request`).
- `apply_defaults(raw) -> dict`: the context-dependent policy defaults, on a raw mapping.

Modules: `models` (the top level), `launch` and `policy` (their sections), `parse` (decoding
and the two passes), `rules`, `launch_rules` and `policy_rules` (the second pass, by concern).
The field types shared with the other formats live in `coldsnap.formats.fields` (their one home:
imported from there, not re-exported here), the YAML/JSON decoder in `coldsnap.formats.documents`.

Validation runs in two passes. The first (pydantic, strict, unknown fields refused) checks every
field's type, pattern and enum and reports all of them at once. The second checks the rules that
relate fields to each other (references, uniqueness, ranges, cross-field policy); it needs
well-typed input, so it runs in full only when the first pass found nothing; when only fields
outside `launch` are mistyped, the execution-graph rules still run and are reported too.

A field that is absent and has no default is omitted from the canonical form (never written as
`null`), so a request that leaves out `workload` hashes the same as one that never knew of it.
"""

from coldsnap.formats.request.launch import (
    Adapter,
    Execution,
    Group,
    Launch,
    ModelRef,
    Mount,
    Service,
    Unit,
    Worker,
)
from coldsnap.formats.request.launch_rules import launch_issues
from coldsnap.formats.request.models import (
    DEFAULT_EXPECTED,
    DEFAULT_HEALTH_PATH,
    DEFAULT_PROMPT,
    DRIVER_MINIMUM_MAJOR,
    LATER_OPERATIONS,
    LIFECYCLE_OPERATIONS,
    PUBLISH_OPERATIONS,
    SUPPORTED_OPERATIONS,
    Lifecycle,
    Request,
    SnapshotDriver,
    Validation,
    Workload,
    request_sha256,
)
from coldsnap.formats.request.parse import (
    MAX_REQUEST_BYTES,
    load_request,
    parse_request,
    resolve_user_paths,
    user_path,
)
from coldsnap.formats.request.policy import (
    CACHE_ROOTS,
    DEFAULT_CACHE_PATHS,
    DEFAULT_GRAPH_POLICY,
    CachePolicy,
    CacheStaged,
    CapsulePolicy,
    CompatibilityPolicy,
    NativeStagedFile,
    NativeWeights,
    Policy,
    ProcessPolicy,
    Recovery,
    WeightsPolicy,
    apply_defaults,
)
from coldsnap.formats.request.rules import request_issues

__all__ = [
    "CACHE_ROOTS",
    "DEFAULT_CACHE_PATHS",
    "DEFAULT_EXPECTED",
    "DEFAULT_GRAPH_POLICY",
    "DEFAULT_HEALTH_PATH",
    "DEFAULT_PROMPT",
    "DRIVER_MINIMUM_MAJOR",
    "LATER_OPERATIONS",
    "LIFECYCLE_OPERATIONS",
    "MAX_REQUEST_BYTES",
    "PUBLISH_OPERATIONS",
    "SUPPORTED_OPERATIONS",
    "Adapter",
    "CachePolicy",
    "CacheStaged",
    "CapsulePolicy",
    "CompatibilityPolicy",
    "Execution",
    "Group",
    "Launch",
    "Lifecycle",
    "ModelRef",
    "Mount",
    "NativeStagedFile",
    "NativeWeights",
    "Policy",
    "ProcessPolicy",
    "Recovery",
    "Request",
    "Service",
    "SnapshotDriver",
    "Unit",
    "Validation",
    "WeightsPolicy",
    "Worker",
    "Workload",
    "apply_defaults",
    "launch_issues",
    "load_request",
    "parse_request",
    "request_issues",
    "request_sha256",
    "resolve_user_paths",
    "user_path",
]
