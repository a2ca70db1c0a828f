"""Strict decoding of the documents coldsnapd reads: requests and host inventories.

One decoder for YAML and JSON, so every document gets the same guarantees:
- a repeated mapping key is refused (PyYAML's `safe_load` keeps the last one silently);
- YAML timestamps stay strings, so the YAML and JSON spellings of a document are equal;
- JSON's `NaN`/`Infinity` are refused, and `value_issues` names every value JSON cannot
  carry (a non-string key, a non-finite float, YAML's binary or set types);
- alias expansion is bounded: a document never needs more than `MAX_NODES` values.

Public API: `decode_document(data, what=..., encoding=...)`, `read_document(path, limit=...)`,
`encoding_of(path)`, `value_issues(root, what=...)`, `DocumentUnreadable` (its message is meant for
the user: it says what was read and why it failed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import yaml

from coldsnap.formats.errors import ValidationIssue, format_path

# Alias expansion in YAML can turn a small file into a huge tree; a document never needs this many.
MAX_NODES = 4_000_000
# Enough to name what is wrong with a broken document without flooding a terminal.
MAX_VALUE_ISSUES = 1000

Encoding = Literal["json", "yaml"]


class DocumentUnreadable(ValueError):
    """The bytes are not a document at all (not UTF-8, not YAML or JSON, unreadable file).

    `str()` names the file where one was read; `reason` does not, for callers whose own
    message already starts with the file's name.
    """

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and keeps timestamps as strings.

    A YAML date would otherwise become a Python date, which JSON cannot carry; keeping it a
    string gives the YAML and JSON spellings of one document the same digest.
    """


_StrictLoader.yaml_implicit_resolvers = {
    key: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
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


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def decode_document(data: bytes, *, what: str, encoding: Encoding | None = None) -> Any:
    """Decode YAML or JSON (`encoding` None: JSON when the text starts with '{').

    `what` names the document in messages ("request", "inventory").
    """
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentUnreadable(f"{what} is not UTF-8: {exc.reason}") from None
    use_json = encoding == "json" or (encoding is None and text.lstrip().startswith("{"))
    json_error: str | None = None
    if use_json:
        try:
            return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
        except (ValueError, RecursionError) as exc:
            json_error = f"{what} is not valid JSON: {exc}"
            if encoding == "json":
                raise DocumentUnreadable(json_error) from None
            # A YAML flow mapping also starts with '{'; let the YAML parser have its say.
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        # Text that looked like JSON is reported as JSON: that is what its author wrote.
        message = json_error or f"{what} is not valid YAML: " + " ".join(str(exc).split())
        raise DocumentUnreadable(message) from None
    except RecursionError:
        raise DocumentUnreadable(f"{what} is nested too deeply") from None


def encoding_of(path: Path) -> Encoding | None:
    """The encoding a file's suffix promises; None (sniffed) for any other suffix."""
    suffix = path.suffix.lower()
    if suffix == ".json":
        return "json"
    if suffix in (".yaml", ".yml"):
        return "yaml"
    return None


def read_document(path: Path, *, limit: int) -> bytes:
    """The file's bytes, refusing one larger than `limit` without reading all of it."""
    try:
        with path.open("rb") as handle:
            blob = handle.read(limit + 1)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise DocumentUnreadable(f"cannot read {path}: {reason}",
                                 f"cannot read: {reason}") from None
    if len(blob) > limit:
        raise DocumentUnreadable(f"{path} is larger than {_size(limit)}",
                                 f"larger than {_size(limit)}")
    return blob


def _size(limit: int) -> str:
    mib = limit / (1024 * 1024)
    return f"{mib:g} MiB" if mib >= 1 else f"{limit} bytes"


def value_issues(root: Any, *, what: str) -> list[ValidationIssue]:
    """Every value canonical JSON cannot carry, so that hashing a valid document cannot fail."""
    issues: list[ValidationIssue] = []
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), root)]
    count = 0
    while stack:
        loc, value = stack.pop()
        count += 1
        if count > MAX_NODES:
            return [ValidationIssue("", f"{what} has more than {MAX_NODES} values")]
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
        if len(issues) >= MAX_VALUE_ISSUES:
            break
    return issues
