"""A job submission, as the API receives it, turned into the operation its command would run.

    {"operation": "restore", "request": {...} | null, "wait": true,
     "options": {"artifact": "REF", "prepare_only": false, "fallback": "none",
                 "stage_from": "auto", "json": false},
     "output_exists": false}

`output_exists`: the client found the capture request's `output` there already (the service
never looks at a user's paths: the client writes `output` itself, from the job's end item).
Such a capture runs only as a retry of its own success, answered with that run's receipt;
otherwise it is refused before its id is claimed.

The request is the canonical JSON of a format-4 request (the CLI parsed and checked it
first; the service parses it again: it never trusts a client). The options are the runner's
`RunOptions` that a client may set (coldsnap.runner.service_api); with the service's inventory
and store they make the options the operation's `prepare` runs with, as in the CLI.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coldsnap.formats.errors import RequestInvalid
from coldsnap.formats.fields import is_registry_reference
from coldsnap.formats.receipt import Operation
from coldsnap.formats.request import Request, parse_request
from coldsnap.formats.service_policy import ServicePolicy, host_roots
from coldsnap.runner.claim import Outputs
from coldsnap.runner.operation_kinds import OPERATIONS
from coldsnap.runner.prepared import ReceiptKey, Refused, RunOptions

# option -> (its type, its default, a check that says what is wrong or None)
_OPTIONS: dict[str, tuple[type, Any, Callable[[Any], str | None]]] = {
    "artifact": (str, None, lambda v: None if 0 < len(v) <= 4096 else "1 to 4096 characters"),
    "prepare_only": (bool, False, lambda v: None),
    "fallback": (str, "none", lambda v: None if v in ("none", "replay") else "none or replay"),
    "stage_from": (str, "auto", lambda v: None if v in ("auto", "store", "registry")
                   else "auto, store or registry"),
    "json": (bool, False, lambda v: None),
    "verbose": (bool, False, lambda v: None),
    "deadline": (float, None, lambda v: None if 0 < v < float("inf") else "a positive number"),
    "validation_timeout": (float, None,
                           lambda v: None if 0 < v < float("inf") else "a positive number"),
    # Where the client writes its receipt and timing events: the service never writes them,
    # it holds them to its policy's outputs.allow (coldsnap.service.submitter_checks).
    "receipt_json": (str, None, lambda v: None if _client_path(v) else _CLIENT_PATH),
    "timing_events": (str, None, lambda v: None if _client_path(v) else _CLIENT_PATH),
}
CLIENT_FILES = ("receipt_json", "timing_events")
_CLIENT_PATH = "'-' or an absolute path of at most 4096 characters"


def _client_path(value: str) -> bool:
    return value == "-" or (value.startswith("/") and len(value) <= 4096 and "\0" not in value)


# A submission's JSON nests a few levels (envelope, request, its sections): far below this. A
# deeper body is refused before it is decoded, so that no decoder or validator recurses on it.
MAX_NESTING = 64

# A JSON string (its brackets are no structure) or one bracket.
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_OPENING = frozenset(b"[{")


def nesting_depth_over(blob: bytes, limit: int) -> bool:
    """Whether the JSON text `blob` nests arrays and objects deeper than `limit`, told
    without decoding it (a malformed text may be over-counted: it is refused anyway)."""
    depth = 0
    for token in _JSON_TOKEN.finditer(blob):
        first = token.group()[0]
        if first in _OPENING:
            depth += 1
            if depth > limit:
                return True
        elif first != ord('"'):
            depth -= 1
    return False


class SubmissionInvalid(Exception):
    """The submission cannot run: each line names the bad field."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


@dataclass(frozen=True)
class Submission:
    operation: Operation
    request: Request | None
    options: dict[str, Any]
    wait: bool
    output_exists: bool = False

    def outputs(self) -> Outputs | None:
        """The client's files as the claim sees them (coldsnap.runner.claim.Outputs)."""
        if self.output_exists and self.request is not None and self.request.output:
            return _TakenOutput(self.request.output)
        return None

    def run_options(self, inventory: Path, store: Path, *, uid: int,
                    policy: ServicePolicy, shares_artifacts: bool = False) -> RunOptions:
        """The options the operation's `prepare` runs with, for the submitter `uid` under the
        service's `policy` (`shares_artifacts`: `uid` is in its artifacts.shared_with); the
        outputs (receipt, timing events) are the client's, never the service's files."""
        mount_roots, log_roots = host_roots(policy, uid)
        given = {k: v for k, v in self.options.items() if k not in CLIENT_FILES}
        return RunOptions(inventory=inventory, store=store, uid=uid, mount_roots=mount_roots,
                          log_roots=log_roots,
                          images_allow=tuple(policy.images.allow) if policy.binds(uid) else None,
                          shares_artifacts=shares_artifacts, **given)


def imports_from_registry(sub: Submission) -> bool:
    """Whether preparing `sub` imports a published artifact from a registry (its
    `--artifact` or its request's `artifact` is a REGISTRY/REPOSITORY@sha256 reference)."""
    refs = [sub.options.get("artifact"), sub.request.artifact if sub.request else None]
    return any(isinstance(r, str) and is_registry_reference(r) for r in refs)


def decode_submission(blob: bytes) -> Any:
    """The JSON value of a submission's body; SubmissionInvalid when it is none, or one
    nested deeper than MAX_NESTING."""
    if nesting_depth_over(blob, MAX_NESTING):
        raise SubmissionInvalid([f"the body nests arrays or objects deeper than {MAX_NESTING} "
                                 "levels"])
    try:
        return json.loads(blob)
    except (ValueError, RecursionError) as exc:
        raise SubmissionInvalid([f"the body is not JSON: {exc}"]) from None


def parse_submission(doc: Any) -> Submission:
    if not isinstance(doc, dict):
        raise SubmissionInvalid(["the submission must be a JSON object"])
    unknown = sorted(set(doc) - {"operation", "request", "options", "wait", "output_exists"})
    if unknown:
        raise SubmissionInvalid([f"{k}: unknown field" for k in unknown])
    operation = doc.get("operation")
    if operation not in OPERATIONS:
        raise SubmissionInvalid([f"operation: must be one of {', '.join(OPERATIONS)}"])
    wait = doc.get("wait", True)
    if not isinstance(wait, bool):
        raise SubmissionInvalid(["wait: must be true or false"])
    output_exists = doc.get("output_exists", False)
    if not isinstance(output_exists, bool):
        raise SubmissionInvalid(["output_exists: must be true or false"])
    options = _options(doc.get("options") or {})
    raw = doc.get("request")
    request: Request | None = None
    if raw is None:
        if OPERATIONS[operation].request_required:
            raise SubmissionInvalid([f"request: {operation} needs a request"])
    elif not isinstance(raw, dict):
        raise SubmissionInvalid(["request: must be a JSON object (a format-4 request)"])
    else:
        try:
            request = parse_request(raw, expected_operation=operation)
        except RequestInvalid as exc:
            raise SubmissionInvalid([f"request.{i.path}: {i.message}" if i.path
                                     else f"request: {i.message}" for i in exc.issues]) from None
    return Submission(operation, request, options, wait, output_exists)


class _TakenOutput:
    """A capture whose `output` the client found taken: only the ledger's answer to a retry
    of a success (checked before `create`) lets it through."""

    def __init__(self, output: str) -> None:
        self.output = output

    def check(self, key: ReceiptKey, *, prepare_only: bool) -> None:
        return None

    def create(self) -> None:
        raise Refused(f"output {self.output} already exists; a capture never replaces a file "
                      "(give a new output, and a new id)")

    def discard(self) -> None:
        return None


def _options(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise SubmissionInvalid(["options: must be a JSON object"])
    problems = [f"options.{k}: unknown option" for k in sorted(set(raw) - set(_OPTIONS))]
    out: dict[str, Any] = {}
    for name, (kind, default, check) in _OPTIONS.items():
        value = raw.get(name, default)
        if value is None or value == default:
            out[name] = value
            continue
        # bool is an int; neither is the other here. A whole number of seconds is a float.
        if kind is float and type(value) is int:
            value = float(value)
        if type(value) is not kind:
            problems.append(f"options.{name}: must be a {kind.__name__}")
            continue
        why = check(value)
        if why:
            problems.append(f"options.{name}: must be {why}")
        out[name] = value
    if problems:
        raise SubmissionInvalid(problems)
    return out
