"""The host inventory: which hosts exist and how to reach them (YAML, strict schema).

    hosts:
      - name: host-0                      # unique; what requests and receipts call the host
        address: 127.0.0.2                # DNS name or IP that sshd listens on
        port: 22                          # default 22
        user: root                        # default root
        identity_file: ~/.ssh/id_ed25519  # optional; else ssh-agent / ~/.ssh defaults
        known_hosts: ~/.ssh/known_hosts   # default ~/.ssh/known_hosts
        host_key_policy: strict           # strict (default) | accept-new
        proxy_jump: bastion               # optional; another inventory host or [user@]host[:port]
        data_dir: /var/lib/coldsnap       # staged objects and unit state on that host
        cache_budget: {size: 200GiB, high_percent: 85, low_percent: 80}   # optional
        docker_socket: /var/run/docker.sock   # or null when the host runs no Docker
        simulated: false                  # true only for dev/test hosts without real GPUs
        driver_version: "610.43.02"       # simulated hosts only
        simulated_gpus:                   # simulated hosts only
          - {uuid: GPU-..., name: NVIDIA GB10, compute_capability: "12.1",
             memory_bytes: 137438953472}

    registry: 198.18.0.254:5000           # optional, top level: an OCI registry every host's
                                          # Docker can push to and pull from (HOST[:PORT])
    artifact_repository: 198.18.0.254:5000/coldsnap/artifacts
                                          # optional: captures publish here, each host pushing
                                          # its own objects (REGISTRY/REPOSITORY, no tag)
    registries:                           # optional: how coldsnapd and the hosts reach each
      "198.18.0.254:5000": {insecure: true}     # registry (plain HTTP when insecure; else HTTPS
      "registry.example:443":                   # with the system CAs or `ca_file`)
        credentials: registry-auth.json   # docker-style config.json (`auths`), never logged
        ca_file: registry-ca.pem

Relative `identity_file` / `known_hosts` paths, and a registry's `credentials` / `ca_file`, are
taken relative to the inventory file.
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from coldsnap.formats.budget import CacheBudget
from coldsnap.formats.documents import (
    DocumentUnreadable,
    decode_document,
    encoding_of,
    read_document,
    value_issues,
)
from coldsnap.formats.fields import text_rule

# A few thousand hosts fit in far less; the bound only stops a wrong file from being read whole.
MAX_INVENTORY_BYTES = 16 * 1024 * 1024


class InventoryError(ValueError):
    """The inventory file is missing, not YAML, or breaks the schema. The message names the
    offending field (e.g. `hosts[1].simulated_gpus`)."""

    def __init__(self, path: Path | str, problems: list[str]) -> None:
        self.path = str(path)
        self.problems = problems
        super().__init__(f"{path}: " + "; ".join(problems))


_GPU_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")
_CC = re.compile(r"^\d+\.\d+$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class SimulatedGpu(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    uuid: Annotated[str, text_rule(
        _GPU_UUID.match, "must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", ValueError)]
    name: str = Field(min_length=1)
    compute_capability: Annotated[str, text_rule(
        _CC.match, 'must be "MAJOR.MINOR", e.g. "12.1"', ValueError)]
    memory_bytes: int = Field(gt=0)


class HostEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: Annotated[str, text_rule(
        _NAME.match, "must be 1-63 characters of letters, digits, '.', '_', '-'", ValueError)]
    address: str = Field(min_length=1)
    port: int = Field(default=22, ge=1, le=65535)
    user: str = Field(default="root", min_length=1)
    identity_file: Path | None = None
    known_hosts: Path = Path("~/.ssh/known_hosts")
    host_key_policy: Literal["strict", "accept-new"] = "strict"
    proxy_jump: str | None = None
    data_dir: str
    # What data_dir may fill before a restore or capture evicts (coldsnap.store.eviction).
    cache_budget: CacheBudget | None = None
    docker_socket: str | None = "/var/run/docker.sock"
    simulated: bool = False
    driver_version: str | None = None
    simulated_gpus: list[SimulatedGpu] | None = None

    @field_validator("data_dir", "docker_socket")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError("must be an absolute path on the host")
        # Clean, so that every path derived from it stays under it (`/x/../..` is `/`).
        if v is not None and (posixpath.normpath(v) != v or v == "/" or "//" in v):
            raise ValueError("must be a clean absolute path (no '..', '.', '//' or trailing "
                             "'/'), other than /")
        return v

    @model_validator(mode="after")
    def _simulation_only_when_simulated(self) -> HostEntry:
        # A real host must never quietly report made-up GPUs: the simulation fields are
        # accepted only where the entry says, in so many words, that it is simulated.
        if not self.simulated:
            if self.simulated_gpus is not None:
                raise ValueError(
                    "simulated_gpus: only a host with `simulated: true` may carry simulated GPUs"
                )
            if self.driver_version is not None:
                raise ValueError(
                    "driver_version: only a host with `simulated: true` may declare a driver "
                    "version (real hosts report theirs through NVML)"
                )
        elif self.simulated_gpus and self.driver_version is None:
            raise ValueError("driver_version: required when simulated_gpus is given")
        return self

    @property
    def ssh_target(self) -> str:
        return f"{self.user}@{self.address}:{self.port}"


# A registry as Docker names it in a reference: a DNS name or IPv4 address, or an IPv6
# address in brackets, and an optional port. No scheme, path, user or whitespace.
_DNS_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_REGISTRY = re.compile(rf"(?:{_DNS_LABEL}(?:\.{_DNS_LABEL})*|\[[0-9A-Fa-f:.]+\])(?::(\d{{1,5}}))?")


def check_registry(v: str) -> str:
    match = _REGISTRY.fullmatch(v)
    if match is None or len(v) > 255:
        raise ValueError("must be HOST or HOST:PORT (a DNS name, an IPv4 address or a "
                         "bracketed IPv6 address; no scheme, path or spaces), e.g. "
                         "198.18.0.1:5000")
    if match.group(1) is not None and not 1 <= int(match.group(1)) <= 65535:
        raise ValueError("port must be 1-65535")
    return v


# A repository path as the distribution spec allows it: lowercase components joined by `/`.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")


def check_repository_path(v: str) -> str:
    if _REPOSITORY.fullmatch(v) is None or len(v) > 255:
        raise ValueError(f"repository {v!r} must be lowercase path components "
                         "([a-z0-9] with . _ - inside) joined by /")
    return v


class RegistrySettings(BaseModel):
    """How to reach one registry: its transport and where its credentials are."""
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # Plain HTTP; without it HTTPS, verified against the system CAs or `ca_file`.
    insecure: bool = False
    ca_file: Path | None = None
    # A docker-style config.json; its `auths` entry for this registry (`auth`, or
    # `username` and `password`) authenticates, as basic or bearer-token auth asks.
    credentials: Path | None = None

    @model_validator(mode="after")
    def _tls_or_not(self) -> RegistrySettings:
        if self.insecure and self.ca_file is not None:
            raise ValueError("ca_file: an insecure (plain HTTP) registry has no TLS to verify")
        return self


class Inventory(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    hosts: list[HostEntry] = Field(min_length=1)
    # Where capture pushes each unit's capsule and restore hosts pull it, both by digest.
    registry: str | None = None
    # Where a capture publishes its artifact, each host pushing its own objects there.
    artifact_repository: str | None = None
    registries: dict[str, RegistrySettings] = Field(default_factory=dict)

    @field_validator("registry")
    @classmethod
    def _registry_shape(cls, v: str | None) -> str | None:
        return v if v is None else check_registry(v)

    @field_validator("artifact_repository")
    @classmethod
    def _artifact_repository_shape(cls, v: str | None) -> str | None:
        if v is None:
            return v
        registry, slash, path = v.partition("/")
        if not slash:
            raise ValueError("must be REGISTRY/REPOSITORY, e.g. "
                             "198.18.0.254:5000/coldsnap/artifacts")
        check_registry(registry)
        check_repository_path(path)
        return v

    @field_validator("registries")
    @classmethod
    def _registry_keys(cls, v: dict[str, RegistrySettings]) -> dict[str, RegistrySettings]:
        for key in v:
            try:
                check_registry(key)
            except ValueError as exc:
                raise ValueError(f"key {key!r} {exc}") from None
        return v

    def registry_settings(self, registry: str) -> RegistrySettings:
        """How to reach `registry`: its entry, else HTTPS with the system CAs, anonymous."""
        return self.registries.get(registry, RegistrySettings())

    @model_validator(mode="after")
    def _unique_and_resolvable(self) -> Inventory:
        seen: set[str] = set()
        for i, h in enumerate(self.hosts):
            if h.name in seen:
                raise ValueError(f"hosts[{i}].name: duplicate host name {h.name!r}")
            seen.add(h.name)
        for i, h in enumerate(self.hosts):
            if h.proxy_jump == h.name:
                raise ValueError(f"hosts[{i}].proxy_jump: a host cannot jump through itself")
        return self

    def get(self, name: str) -> HostEntry:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host named {name!r} in the inventory")

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


_FIELD_PREFIX = re.compile(r"^[a-z_]+(\[\d+\])?(\.[a-z_]+)*: ")


def _format_errors(exc: ValidationError) -> list[str]:
    problems = []
    for err in exc.errors():
        where = _loc(tuple(err["loc"]))
        msg = str(err["msg"]).removeprefix("Value error, ")
        if _FIELD_PREFIX.match(msg):
            # Cross-field checks name their own field; prefix the entry they belong to.
            problems.append(f"{where}.{msg}" if where else msg)
        else:
            problems.append(f"{where}: {msg}" if where else msg)
    return problems


def _resolve_paths(entry: dict[str, Any], base: Path) -> None:
    for key in ("identity_file", "known_hosts"):
        value = entry.get(key)
        if isinstance(value, str):
            p = Path(value).expanduser()
            entry[key] = p if p.is_absolute() else (base / p)


def parse_inventory(data: Any, *, source: Path | str = "<inventory>") -> Inventory:
    base = Path(source).parent if str(source) != "<inventory>" else Path.cwd()
    if not isinstance(data, dict):
        raise InventoryError(source, ["top level: must be a mapping with a `hosts` list"])
    registries = data.get("registries")
    if isinstance(registries, dict):
        data = dict(data)
        data["registries"] = {k: dict(v) if isinstance(v, dict) else v
                              for k, v in registries.items()}
        for v in data["registries"].values():
            if isinstance(v, dict):
                for key in ("credentials", "ca_file"):
                    if isinstance(v.get(key), str):
                        p = Path(v[key]).expanduser()
                        v[key] = p if p.is_absolute() else (base / p)
    hosts = data.get("hosts")
    if isinstance(hosts, list):
        data = dict(data)
        data["hosts"] = [dict(h) if isinstance(h, dict) else h for h in hosts]
        for h in data["hosts"]:
            if isinstance(h, dict):
                _resolve_paths(h, base)
    try:
        inv = Inventory.model_validate(data)
    except ValidationError as exc:
        raise InventoryError(source, _format_errors(exc)) from None
    return inv.model_copy(
        update={
            "hosts": [
                h.model_copy(update={"known_hosts": h.known_hosts.expanduser()}) for h in inv.hosts
            ]
        }
    )


DEFAULT_INVENTORY = "/etc/coldsnap/inventory.yaml"


def inventory_path(given: Path | None = None) -> Path:
    """`given` (a command's `--inventory`), else `$COLDSNAP_INVENTORY`, else the default."""
    return given or Path(os.environ.get("COLDSNAP_INVENTORY", DEFAULT_INVENTORY))


def load_inventory(path: Path | str) -> Inventory:
    """Read and validate an inventory file; raise InventoryError naming the bad field.

    Decoded like a request: a repeated key is refused (it would otherwise silently replace an
    earlier one, say a host's address), and so is any value JSON cannot carry.
    """
    p = Path(path)
    try:
        data = decode_document(read_document(p, limit=MAX_INVENTORY_BYTES), what="inventory",
                               encoding=encoding_of(p))
    except DocumentUnreadable as exc:
        raise InventoryError(p, [exc.reason]) from None
    problems = value_issues(data, what="inventory")
    if problems:
        raise InventoryError(p, [str(issue) for issue in problems])
    return parse_inventory(data, source=p)
