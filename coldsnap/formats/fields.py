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


def _check_id(value: str) -> str:
    if not is_id(value):
        raise invalid(f"must match {ID_PATTERN}")
    return value


def _check_qualified(value: str) -> str:
    parts = value.split(":")
    if len(parts) != 2 or not all(is_id(p) for p in parts):
        raise invalid("must be NAMESPACE:NAME, exactly one ':' with an id on each side")
    return value


def _check_digest(value: str) -> str:
    if not is_digest(value):
        raise invalid("must be sha256: followed by 64 lowercase hex digits")
    return value


def _check_non_empty(value: str) -> str:
    if not value:
        raise invalid("must not be empty")
    return value


def check_abs_path(value: str) -> str:
    if not is_clean_absolute(value):
        raise invalid("must be an absolute, clean path (no '.', '..', '//' or trailing '/')")
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
        raise invalid("must be a clean relative path that stays inside its root")
    return value


def _check_env_name(value: str) -> str:
    if _ENV_NAME.fullmatch(value) is None:
        raise invalid("is not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
    return value


def _check_host(value: str) -> str:
    if not value or any(c.isspace() for c in value):
        raise invalid("must be a non-empty host name without whitespace")
    return value


def whole_match(pattern: re.Pattern[str], message: str) -> AfterValidator:
    """A text field that `pattern` must match whole; else ValueError(`message`), which
    pydantic reports as "Value error, <message>" at the field's path."""

    def check(value: str) -> str:
        if pattern.fullmatch(value) is None:
            raise ValueError(message)
        return value

    return AfterValidator(check)


Id = Annotated[str, AfterValidator(_check_id)]
QualifiedName = Annotated[str, AfterValidator(_check_qualified)]
Digest = Annotated[str, AfterValidator(_check_digest)]
NonEmpty = Annotated[str, AfterValidator(_check_non_empty)]
AbsPath = Annotated[str, AfterValidator(check_abs_path)]
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
