"""Field types shared by every format: the strict base model and checked string types.

Public API:
- `StrictModel`: strict types, unknown fields refused, absent optional fields omitted on output.
- Annotated field types: `Id`, `QualifiedName` (`NAMESPACE:NAME`), `Digest` (`sha256:<hex>`),
  `NonEmpty`, `AbsPath`, `RelPath`, `EnvName`, `HostName`, `NonNegative`.
- `invalid(message)`: the error a field check raises, so pydantic reports it at its path.
- `is_id(value)`, `is_clean_absolute(value)`, `ID_PATTERN`.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)
from pydantic_core import PydanticCustomError

from coldsnap.digests import is_digest

# The one id pattern: request, operation, unit, worker, service and group ids, capture ids
# (a capture's id is its request's), job ids. ID_CORE is embedded in larger patterns.
ID_CORE = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
ID_PATTERN = rf"^{ID_CORE}$"
_ID = re.compile(ID_CORE)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("coldsnap", message)


def is_id(value: str) -> bool:
    return _ID.fullmatch(value) is not None


def is_registry_reference(text: str) -> bool:
    """Whether an artifact reference names a published artifact, `REGISTRY/REPOSITORY@DIGEST`
    (a file path starts with `/`; capture ids and digest prefixes hold no `/`)."""
    return not text.startswith("/") and "/" in text and "@sha256:" in text


def is_relative_artifact_path(text: str) -> bool:
    """An artifact reference that is a file path relative to its writer's working directory:
    it holds a '/', and is neither absolute, a URL, nor a registry reference."""
    return ("/" in text and not text.startswith("/") and "://" not in text
            and not is_registry_reference(text))


def is_clean_absolute(value: str) -> bool:
    # normpath keeps a leading '//' (POSIX allows it a meaning), so refuse it explicitly.
    return (
        value.startswith("/")
        and not value.startswith("//")
        and "\0" not in value
        and posixpath.normpath(value) == value
    )


def check_abs_path(value: str) -> str:
    if not is_clean_absolute(value):
        raise invalid(_ABS_PATH)
    return value


def _is_qualified(value: str) -> bool:
    parts = value.split(":")
    return len(parts) == 2 and all(is_id(p) for p in parts)


def _is_clean_relative(value: str) -> bool:
    return not (
        not value
        or value.startswith("/")
        or "\0" in value
        or posixpath.normpath(value) != value
        or value == "."
        or value.split("/")[0] == ".."
    )


def _is_host_name(value: str) -> bool:
    return bool(value) and not any(c.isspace() for c in value)


def text_rule(holds: Callable[[str], object], message: str,
              refusal: Callable[[str], Exception] = invalid) -> AfterValidator:
    """A text field that `holds` must accept; else `refusal(message)` at the field's path:
    this module's own error (its message as written), or ValueError (pydantic prefixes
    "Value error, ")."""

    def check(value: str) -> str:
        if not holds(value):
            raise refusal(message)
        return value

    return AfterValidator(check)


_ABS_PATH = "must be an absolute, clean path (no '.', '..', '//' or trailing '/')"
Id = Annotated[str, text_rule(is_id, f"must match {ID_PATTERN}")]
QualifiedName = Annotated[str, text_rule(
    _is_qualified, "must be NAMESPACE:NAME, exactly one ':' with an id on each side")]
Digest = Annotated[str, text_rule(is_digest, "must be sha256: followed by 64 lowercase hex digits")]
NonEmpty = Annotated[str, text_rule(bool, "must not be empty")]
AbsPath = Annotated[str, text_rule(is_clean_absolute, _ABS_PATH)]
RelPath = Annotated[str, text_rule(
    _is_clean_relative, "must be a clean relative path that stays inside its root")]
EnvName = Annotated[str, text_rule(
    _ENV_NAME.fullmatch, "is not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)")]
HostName = Annotated[str, text_rule(
    _is_host_name, "must be a non-empty host name without whitespace")]
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
