"""From bytes, text or a mapping to a valid `Request`: decode, apply the context-dependent
defaults, type-check every field (first pass), then check the rules between fields (second)."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from coldsnap.formats.canonical import canonical_json
from coldsnap.formats.documents import (
    DocumentUnreadable,
    Encoding,
    decode_document,
    encoding_of,
    read_document,
    value_issues,
)
from coldsnap.formats.errors import RequestInvalid, ValidationIssue, format_path
from coldsnap.formats.fields import is_relative_artifact_path
from coldsnap.formats.request.launch import Launch
from coldsnap.formats.request.launch_rules import launch_issues
from coldsnap.formats.request.models import Request
from coldsnap.formats.request.policy import apply_defaults
from coldsnap.formats.request.rules import request_issues

MAX_REQUEST_BYTES = 16 * 1024 * 1024

_MESSAGES = {
    "missing": "required field is missing",
    "extra_forbidden": "unknown field",
    "too_short": "must not be empty",
}


def _unreadable(exc: DocumentUnreadable) -> RequestInvalid:
    return RequestInvalid([ValidationIssue("", str(exc))])


def pydantic_issues(error: ValidationError) -> list[ValidationIssue]:
    """pydantic's errors as issues at FORMATS.md paths, in this project's wording."""
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


def _decoded(data: bytes | str, encoding: Encoding | None) -> Any:
    blob = data.encode("utf-8") if isinstance(data, str) else data
    if len(blob) > MAX_REQUEST_BYTES:
        raise RequestInvalid([ValidationIssue("", f"request is larger than 16 MiB "
                                                  f"({len(blob)} bytes)")])
    try:
        return decode_document(blob, what="request", encoding=encoding)
    except DocumentUnreadable as exc:
        raise _unreadable(exc) from None


def user_path(path: str, cwd: str) -> str:
    """`path` as the user who wrote it means it: a relative one is taken against their
    working directory (`cwd`, absolute), as any command-line path is. A trailing '/' is kept,
    so that a directory is still refused where a file is wanted."""
    if path.startswith("/") or path == "-":
        return path
    joined = posixpath.normpath(posixpath.join(cwd, path))
    return joined + "/" if path.endswith("/") and joined != "/" else joined


def resolve_user_paths(raw: dict[str, Any], cwd: str) -> dict[str, Any]:
    """The request with a capture's relative `output` and a relative artifact path (a
    reference with '/' in it) taken against `cwd`: what the CLI does, since it reads and
    writes those files as its user; the service only ever sees absolute ones. A publish's
    `output` is a registry reference and stays as written."""
    out = dict(raw)
    output, artifact = out.get("output"), out.get("artifact")
    if out.get("operation") == "capture" and isinstance(output, str) and output:
        out["output"] = user_path(output, cwd)
    if isinstance(artifact, str) and is_relative_artifact_path(artifact):
        out["artifact"] = user_path(artifact, cwd)
    return out


def parse_request(
    data: bytes | str | Mapping[str, Any],
    *,
    expected_operation: str | None = None,
    encoding: Encoding | None = None,
    cwd: str | None = None,
) -> Request:
    """The validated request. With `cwd` (the CLI's working directory), relative user paths
    are resolved against it first (`resolve_user_paths`)."""
    raw = _decoded(data, encoding) if isinstance(data, str | bytes) else data
    if not isinstance(raw, dict):
        raise RequestInvalid([ValidationIssue("", "request must be a mapping (a JSON object)")])
    if cwd is not None:
        raw = resolve_user_paths(raw, cwd)
    json_issues = value_issues(raw, what="request")
    if json_issues:
        raise RequestInvalid(json_issues)
    if not isinstance(data, str | bytes) and len(canonical_json(raw)) > MAX_REQUEST_BYTES:
        raise RequestInvalid([ValidationIssue("", "request is larger than 16 MiB")])
    defaulted = apply_defaults(raw)
    try:
        req = Request.model_validate(defaulted)
    except ValidationError as exc:
        issues = pydantic_issues(exc)
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


def load_request(path: Path, *, expected_operation: str | None = None,
                 cwd: str | None = None) -> Request:
    try:
        blob = read_document(path, limit=MAX_REQUEST_BYTES)
    except DocumentUnreadable as exc:
        raise _unreadable(exc) from None
    return parse_request(blob, expected_operation=expected_operation,
                         encoding=encoding_of(path), cwd=cwd)
