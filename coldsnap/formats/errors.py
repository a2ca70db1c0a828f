"""Validation issues: every problem found in a document, each naming the path it is at.

Paths use the notation of FORMATS.md: dotted field names and `[i]` list positions, e.g.
`launch.execution.workers[1].device_slots[0]`. A mapping key that is not a plain identifier
(an environment variable name with a dash, say) is written `["KEY"]` so the path stays
unambiguous.

Public API:
- `ValidationIssue(path, message)`; `str(issue)` is `PATH: message` (what the CLI prints).
- `RequestInvalid(issues)`: raised with ALL issues of a document, never just the first.
- `format_path(parts)`: render a location tuple as a path string.
- `Issues`: a list of issues that rules append to with `add(path, message)`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class ValidationIssue:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message}


def format_path(parts: Iterable[str | int]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.fullmatch(part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out


def join(path: str, *parts: str | int) -> str:
    """Extend an already rendered path."""
    rest = format_path(parts)
    if not path:
        return rest
    if rest.startswith("["):
        return path + rest
    return f"{path}.{rest}"


class Issues(list[ValidationIssue]):
    def add(self, path: str, message: str) -> None:
        self.append(ValidationIssue(path, message))


class DocumentInvalid(Exception):
    """A document failed validation; `issues` lists every problem found."""

    def __init__(self, issues: Sequence[ValidationIssue]) -> None:
        self.issues: list[ValidationIssue] = list(issues)
        if not self.issues:
            raise ValueError("an invalid document needs at least one issue")
        first = str(self.issues[0])
        more = len(self.issues) - 1
        super().__init__(first if more == 0 else f"{first} (and {more} more)")


class RequestInvalid(DocumentInvalid):
    """An operation request (format 4) is invalid or unreadable."""


class ArtifactInvalid(DocumentInvalid):
    """An artifact (format 9), receipt or timing document is invalid."""
