"""The second validation pass: rules between fields of a well-typed request.

`request_issues` runs every rule and returns all problems found: the operation's own fields
(artifact, output, workload, activation state) here, the execution graph in `launch_rules`,
the policy in `policy_rules`.
"""

from __future__ import annotations

from coldsnap.formats.errors import Issues, ValidationIssue
from coldsnap.formats.fields import check_abs_path
from coldsnap.formats.request.launch_rules import launch_issues, rank_issues
from coldsnap.formats.request.models import LIFECYCLE_OPERATIONS, PUBLISH_OPERATIONS, Request
from coldsnap.formats.request.policy_rules import policy_issues

# Where an operation's artifact is: capture writes it to `output`, restore reads it from
# `artifact`. (operation: the field it needs, what that field holds, the field it refuses, why)
_ARTIFACT_FIELDS = {
    "capture": ("output", "the path the artifact file is written to",
                "artifact", "is for restore; a capture names its destination in 'output'"),
    "restore": ("artifact", "the artifact file's path, a capture id or a digest prefix",
                "output", "is for capture; a restore names its source in 'artifact'"),
}
_PUBLISH_ARTIFACT = "the artifact to publish: its file's path, a capture id or a digest prefix"
_PUBLISH_OUTPUT = "the target REGISTRY/REPOSITORY[:TAG] (e.g. 198.18.0.254:5000/coldsnap/a:v1)"

# Once a workload is described at all, these fields identify it.
_WORKLOAD_REQUIRED = ("cluster_id", "intent_id", "recipe", "runtime", "model")


def request_issues(req: Request, *, expected_operation: str | None = None) -> list[ValidationIssue]:
    issues = Issues()
    _operation_issues(issues, req, expected_operation)
    _workload_issues(issues, req)
    _activation_issues(issues, req)
    graph_issues = launch_issues(req.launch)
    issues.extend(graph_issues)
    if not graph_issues:
        rank_issues(issues, req.launch)
    policy_issues(issues, req)
    return list(issues)


def _operation_issues(issues: Issues, req: Request, expected_operation: str | None) -> None:
    if expected_operation is not None and req.operation != expected_operation:
        issues.add("operation", f"is '{req.operation}' but the command is '{expected_operation}'")
    if req.operation in _ARTIFACT_FIELDS:
        needed, meaning, refused, why = _ARTIFACT_FIELDS[req.operation]
        if getattr(req, needed) is None:
            issues.add(needed, f"is required for {req.operation}: {meaning}")
        if getattr(req, refused) is not None:
            issues.add(refused, why)
    if req.operation == "capture" and req.output is not None:
        try:
            check_abs_path(req.output)
        except ValueError as exc:
            issues.add("output", str(exc))
    if req.operation in PUBLISH_OPERATIONS:
        _publish_issues(issues, req)
    if req.operation in LIFECYCLE_OPERATIONS:
        _lifecycle_issues(issues, req)


def _publish_issues(issues: Issues, req: Request) -> None:
    """The registry reference itself is parsed by the command (coldsnap.hosts.registry): here
    only what tells it from a file path."""
    op = req.operation
    if req.artifact is None:
        issues.add("artifact", f"is required for {op}: {_PUBLISH_ARTIFACT}")
    if req.output is None:
        issues.add("output", f"is required for {op}: {_PUBLISH_OUTPUT}")
    elif req.output.startswith("/") or "/" not in req.output or "://" in req.output:
        issues.add("output", f"must be {_PUBLISH_OUTPUT}, with no scheme; not a file path")


def _lifecycle_issues(issues: Issues, req: Request) -> None:
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


def _workload_issues(issues: Issues, req: Request) -> None:
    if req.workload is None:
        return
    given = req.workload.model_dump(exclude_none=True)
    if given:
        for name in _WORKLOAD_REQUIRED:
            if name not in given:
                issues.add(f"workload.{name}", "is required once any workload field is set")


def _activation_issues(issues: Issues, req: Request) -> None:
    if (req.lifecycle is not None and req.lifecycle.activation_state == "warm"
            and (req.operation != "restore" or req.snapshot_driver.id != "n610")):
        issues.add("lifecycle.activation_state", "'warm' is only for a restore with driver n610")
