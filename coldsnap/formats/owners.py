"""Typed owners: which unit, worker, service or group an artifact object belongs to.

Written `unit/<id>`, `worker/<id>`, `service/<id>` or `group/<id>` in artifacts (format 9).
Build one with `Owner(kind, id)` (the kind is checked against `OwnerKind`) and write it with
`str(owner)`; read one with `Owner.parse(text)`. `OwnerText` is the checked string field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal

from coldsnap.formats.fields import ID_CORE, text_rule

OwnerKind = Literal["unit", "worker", "service", "group"]

# The kind, then the id of the unit, worker, service or group (an id as requests define it).
_OWNER = re.compile(rf"(unit|worker|service|group)/({ID_CORE})")


@dataclass(frozen=True, slots=True)
class Owner:
    kind: OwnerKind
    id: str

    def __str__(self) -> str:
        return f"{self.kind}/{self.id}"

    @classmethod
    def parse(cls, text: str) -> Owner:
        match = _OWNER.fullmatch(text)
        if match is None:
            raise ValueError(f"not a typed owner (unit/, worker/, service/, group/ + id): {text!r}")
        kind: OwnerKind = match.group(1)  # type: ignore[assignment]
        return cls(kind, match.group(2))


OwnerText = Annotated[str, text_rule(
    _OWNER.fullmatch, "must be a typed owner: unit/<id>, worker/<id>, service/<id> or group/<id>",
    ValueError)]
