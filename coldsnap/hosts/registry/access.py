"""How to reach one registry: its transport, its CA and its credentials, read from the files the
inventory names (`registries:` in `coldsnap.hosts.inventory`).

A `RegistryAccess` carries secrets: its `repr` hides them, and it crosses to a host only on the
helper's stdin (`to_helper`), never in argv, logs or receipts.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coldsnap.hosts.inventory import Inventory, RegistrySettings

# A credentials file or CA bundle larger than this is not one.
_MAX_FILE = 1024 * 1024


class RegistryAccessError(ValueError):
    """A credentials or CA file the inventory names is missing or malformed (the message names
    the file and the registry, never a secret)."""


@dataclass(frozen=True)
class RegistryAccess:
    registry: str  # HOST[:PORT]
    insecure: bool = False  # plain HTTP
    ca_pem: str | None = None  # PEM bundle to verify the registry's TLS with
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def scheme(self) -> str:
        return "http" if self.insecure else "https"

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.registry}"

    def to_helper(self) -> dict[str, Any]:
        """What the host helper reads on stdin to reach the registry (secrets included)."""
        return {"registry": self.registry, "insecure": self.insecure, "ca_pem": self.ca_pem,
                "username": self.username, "password": self.password}


def _read(path: Path, what: str, registry: str) -> str:
    try:
        with path.open("rb") as f:
            data = f.read(_MAX_FILE + 1)
    except OSError as exc:
        raise RegistryAccessError(f"registries.{registry}.{what}: cannot read {path}: "
                                  f"{exc.strerror or exc}") from None
    if len(data) > _MAX_FILE:
        raise RegistryAccessError(f"registries.{registry}.{what}: {path} is over 1 MiB")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise RegistryAccessError(f"registries.{registry}.{what}: {path} is not UTF-8 "
                                  "text") from None


def _credentials(path: Path, registry: str) -> tuple[str, str] | None:
    """The `auths` entry of a docker-style config.json for `registry` (keyed as Docker keys it:
    HOST[:PORT], with or without a scheme); None when the file has none."""
    where = f"registries.{registry}.credentials"
    try:
        doc = json.loads(_read(path, "credentials", registry))
    except json.JSONDecodeError as exc:
        raise RegistryAccessError(f"{where}: {path} is not JSON (line {exc.lineno})") from None
    auths = doc.get("auths") if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        raise RegistryAccessError(f"{where}: {path} has no `auths` mapping")
    entry = None
    for key, value in auths.items():
        if isinstance(key, str) and key.split("://", 1)[-1].rstrip("/") == registry:
            entry = value
            break
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise RegistryAccessError(f"{where}: {path}: auths.{registry} is not a mapping")
    if isinstance(entry.get("auth"), str):
        try:
            user, sep, password = base64.b64decode(entry["auth"], validate=True).decode() \
                .partition(":")
        except (binascii.Error, UnicodeDecodeError):
            sep, user, password = "", "", ""
        if not sep or not user:
            raise RegistryAccessError(f"{where}: {path}: auths.{registry}.auth is not "
                                      "base64 of USER:PASSWORD")
        return user, password
    name, secret = entry.get("username"), entry.get("password")
    if isinstance(name, str) and name and isinstance(secret, str):
        return name, secret
    raise RegistryAccessError(f"{where}: {path}: auths.{registry} has neither `auth` nor "
                              "`username` and `password`")


def access_from(registry: str, settings: RegistrySettings) -> RegistryAccess:
    ca = _read(settings.ca_file, "ca_file", registry) if settings.ca_file else None
    creds = _credentials(settings.credentials, registry) if settings.credentials else None
    user, password = creds if creds else (None, None)
    return RegistryAccess(registry, settings.insecure, ca, user, password)


def access_for(inventory: Inventory, registry: str) -> RegistryAccess:
    """How to reach `registry`, from the inventory's `registries` entry (none: HTTPS with the
    system CAs, anonymous)."""
    return access_from(registry, inventory.registry_settings(registry))


__all__ = ["RegistryAccess", "RegistryAccessError", "access_for", "access_from"]
