"""What a publication carries of an artifact: its documents with the secrets withheld.

A registry is read by whoever its access control lets in, usually more people than the
capture's submitter, so no environment value and no secret-looking command value leaves
the control node through it. The rule is the one the service follows when it shows a request
(`coldsnap.formats.redaction`), applied to every document a publication carries:

- the artifact document's `launch`: every value of each unit's `environment` and, in each
  unit's `command`, the value of a flag whose name holds `token`, `key`, `secret` or
  `password` (`--api-key X`, `--hf-token=X`) become `REDACTED`; the keys and flags stay, so a
  restore knows what it must be given;
- the capture request (role `capture-request`): `redact` of the whole request, except the
  adapter's payload (`launch.execution.adapter`: its digest is part of the capture identity);
- each replay plan and each capsule manifest: `redact` of the whole document.

Every environment value is withheld, not only those whose key looks secret: a value's name says
nothing reliable about it (`HF_TOKEN` and `MY_CREDS` alike), and a fixed marker, never a digest,
takes its place (a digest of a short secret is as good as the secret to a guesser).

The redacted documents are new objects (new digests), so the published artifact document is a
different document from the stored one: `published_form` builds it and the bytes of the
objects it names. A store that holds the full artifact recognises its own publication by
building the same form. A restore of a published artifact takes the withheld values from the
restore request (`withheld` names them); without them it is refused.

Public API: `published_form(artifact, read) -> PublishedForm`, `redact_launch(launch_json)`,
`withheld(launch) -> list[str]`, `not_given(captured, restore)`,
`is_withheld(value)`, `REDACTED_ROLES`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from coldsnap.formats.artifact import (
    ROLE_CAPSULE_MANIFEST,
    ROLE_CAPTURE_REQUEST,
    ROLE_REPLAY_PLAN,
    Artifact,
    parse_artifact,
)
from coldsnap.formats.canonical import canonical_json, digest_bytes
from coldsnap.formats.errors import join
from coldsnap.formats.redaction import REDACTED, redact, redact_argv
from coldsnap.formats.request import Launch

# The artifact's objects that are documents and may name a secret: published redacted.
REDACTED_ROLES: Final = frozenset({ROLE_CAPTURE_REQUEST, ROLE_REPLAY_PLAN,
                                   ROLE_CAPSULE_MANIFEST})


@dataclass(frozen=True)
class PublishedForm:
    """The artifact as published (its document names the redacted objects) and the bytes of
    each redacted object by its new digest."""

    artifact: Artifact
    documents: dict[str, bytes]

    @property
    def document(self) -> bytes:
        return canonical_json(self.artifact.to_json())


def is_withheld(value: str) -> bool:
    """Whether a launch value is one a publication withheld (the whole value or a flag's)."""
    return value == REDACTED or value.endswith("=" + REDACTED)


def redact_launch(launch: dict[str, Any]) -> dict[str, Any]:
    """A launch's JSON with its units' environment values and secret flag values withheld."""
    out = dict(launch)
    units = []
    for unit in launch.get("units", []):
        unit = dict(unit)
        unit["environment"] = {k: REDACTED for k in unit.get("environment", {})}
        unit["command"] = redact_argv(list(unit.get("command", [])))
        units.append(unit)
    out["units"] = units
    return out


def _redact_object(role: str, data: bytes) -> bytes:
    """The document redacted; its own bytes when there was nothing to withhold (its digest
    then stays, and so does every publication that carries it)."""
    doc: Any = json.loads(data)
    original = json.loads(data)
    if role == ROLE_CAPTURE_REQUEST and isinstance(doc, dict) \
            and isinstance(doc.get("launch"), dict):
        launch = doc["launch"]
        adapter = (launch.get("execution") or {}).get("adapter")
        doc = redact(doc)
        doc["launch"] = redact_launch(doc["launch"])
        if adapter is not None:
            doc["launch"]["execution"]["adapter"] = adapter
    else:
        doc = redact(doc)
    return data if doc == original else canonical_json(doc)


def published_form(artifact: Artifact, read: Callable[[str], bytes]) -> PublishedForm:
    """`artifact` as a publication carries it; `read(sha256)` gives an object's bytes (the
    store's). Deterministic: the same artifact always gives the same form."""
    documents: dict[str, bytes] = {}
    renamed: dict[str, tuple[str, int]] = {}
    for obj in artifact.objects:
        if obj.role not in REDACTED_ROLES or obj.sha256 in renamed:
            continue
        data = _redact_object(obj.role, read(obj.sha256))
        digest = digest_bytes(data)
        documents[digest] = data
        renamed[obj.sha256] = (digest, len(data))
    doc = artifact.to_json()
    doc["launch"] = redact_launch(doc["launch"])
    for entry in doc["objects"]:
        if entry["role"] in REDACTED_ROLES:
            entry["sha256"], entry["bytes"] = renamed[entry["sha256"]]
    return PublishedForm(parse_artifact(doc), documents)


def withheld(launch: Launch, base: str = "launch") -> list[str]:
    """The paths of the values a publication withheld from `launch` (empty for a launch
    captured here): `launch.units[0].environment.HF_TOKEN`, `launch.units[0].command[5]`."""
    paths = []
    for i, unit in enumerate(launch.units):
        where = f"{base}.units[{i}]"
        paths += [join(f"{where}.environment", k) for k, v in unit.environment.items()
                  if is_withheld(v)]
        paths += [f"{where}.command[{j}]" for j, arg in enumerate(unit.command)
                  if is_withheld(arg)]
    return paths


def not_given(captured: Launch, restore: Launch | None) -> list[str]:
    """The paths of the values `captured` withholds that `restore` does not give (all of
    them without a restore launch; a value it withholds too is not given)."""
    missing = withheld(captured)
    if restore is None or not missing:
        return missing
    given = _paths(restore) - set(withheld(restore))
    return [p for p in missing if p not in given]


def _paths(launch: Launch, base: str = "launch") -> set[str]:
    """Every environment and command path of `launch`, as `withheld` names them."""
    out: set[str] = set()
    for i, unit in enumerate(launch.units):
        out |= {join(f"{base}.units[{i}].environment", k) for k in unit.environment}
        out |= {f"{base}.units[{i}].command[{j}]" for j in range(len(unit.command))}
    return out


__all__ = [
    "REDACTED_ROLES",
    "PublishedForm",
    "is_withheld",
    "not_given",
    "published_form",
    "redact_launch",
    "withheld",
]
