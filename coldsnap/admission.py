"""Admission at restore: may a destination host take a unit's captured process state?

Pure. The caller gathers the host's facts (through the host probe) and, under the `capability`
kernel policy, runs the capsule-pinned `criu check` itself; this module only decides.

Public API:
- `GpuFact(uuid, name, compute_capability)`, `HostFacts(arch, kernel, driver_version, gpus, boot_id,
  docker, docker_instance, hostname, interfaces)`.
- `check_admission(unit, facts, *, devices, snapshot_driver_min, enforce_captured_driver_floor
  =True, kernel_policy="capability", base="compatibility.units[i]") -> Admission`.
  `devices` are the restore unit's device selectors (slot i -> devices[i]); a selector is a GPU
  UUID or an index into `facts.gpus`.
- `Admission.refusals` (list of `ValidationIssue`, each naming the artifact field it fails),
  `Admission.criu_probe_required`, `Admission.admitted`.
- `select_gpu(selector, gpus)`: a selector is a GPU UUID of the host or an index into its list.
- `parse_driver_version("610.43.02") -> (610, 43, 2)`; `normalize_arch(name)`.
- `criu_inet_refusal(kernel, criu_version)`: the CRIU version floor for TCP-serving engines.
- `port_conflicts(wanted, listening)`: a unit's listen ports already taken on its host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from coldsnap.formats.artifact import CompatibilityUnit
from coldsnap.formats.errors import ValidationIssue
from coldsnap.network_admission import InterfaceFact

# The same machine architecture has several names (uname vs Debian vs OCI); compare meanings.
_ARCH_ALIASES = {"amd64": "x86_64", "x86-64": "x86_64", "x64": "x86_64", "arm64": "aarch64",
                 "armv8": "aarch64"}


@dataclass(frozen=True, slots=True)
class GpuFact:
    uuid: str
    name: str
    compute_capability: str


@dataclass(frozen=True, slots=True)
class HostFacts:
    arch: str
    kernel: str
    driver_version: str
    gpus: Sequence[GpuFact] = ()
    # Not admission inputs: they say which boot of the host and which dockerd instance the
    # facts came from, so that a remembered CRIU probe is only reused on the same ones.
    boot_id: str | None = None
    docker: str | None = None
    docker_instance: str | None = None
    # The network its units see (they share the host's): placement admission
    # (coldsnap.network_admission). None: the probe could not list the interfaces.
    hostname: str | None = None
    interfaces: Sequence[InterfaceFact] | None = None


@dataclass(slots=True)
class Admission:
    refusals: list[ValidationIssue] = field(default_factory=list)
    criu_probe_required: bool = False

    @property
    def admitted(self) -> bool:
        """No refusal found here; with `criu_probe_required`, the probe must also pass."""
        return not self.refusals


def normalize_arch(name: str) -> str:
    lowered = name.strip().lower()
    return _ARCH_ALIASES.get(lowered, lowered)


def parse_driver_version(text: str) -> tuple[int, ...]:
    parts = text.strip().split(".")
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"not an NVIDIA driver version: {text!r}")
    return tuple(int(p) for p in parts)


def select_gpu(selector: str, gpus: Sequence[GpuFact]) -> GpuFact | None:
    for gpu in gpus:
        if gpu.uuid == selector:
            return gpu
    if selector.isdigit() and int(selector) < len(gpus):
        return gpus[int(selector)]
    return None


def check_admission(
    unit: CompatibilityUnit,
    facts: HostFacts,
    *,
    devices: Sequence[str],
    snapshot_driver_min: int,
    enforce_captured_driver_floor: bool = True,
    kernel_policy: Literal["capability", "exact"] = "capability",
    base: str = "compatibility.units[0]",
) -> Admission:
    result = Admission()

    def refuse(path: str, message: str) -> None:
        result.refusals.append(ValidationIssue(f"{base}.{path}", message))

    if normalize_arch(facts.arch) != normalize_arch(unit.architecture):
        refuse("architecture", f"destination is {facts.arch}, the capture is "
                               f"{unit.architecture}")

    try:
        version = parse_driver_version(facts.driver_version)
    except ValueError as exc:
        refuse("nvidia_driver_min", str(exc))
    else:
        minimum = max(snapshot_driver_min, unit.nvidia_driver_min)
        if version[0] < minimum:
            refuse("nvidia_driver_min", f"destination driver {facts.driver_version} is older "
                                        f"than the minimum major {minimum}")
        if enforce_captured_driver_floor:
            try:
                captured = parse_driver_version(unit.nvidia_driver_captured)
            except ValueError as exc:
                refuse("nvidia_driver_captured", str(exc))
            else:
                if version < captured:
                    refuse("nvidia_driver_captured",
                           f"destination driver {facts.driver_version} is older than the "
                           f"captured {unit.nvidia_driver_captured} (policy.compatibility."
                           "enforce_captured_driver_floor is true)")

    if kernel_policy == "exact":
        if facts.kernel != unit.kernel:
            refuse("kernel", f"destination kernel {facts.kernel!r} differs from the captured "
                             f"{unit.kernel!r} (kernel policy 'exact')")
    else:
        result.criu_probe_required = True

    by_slot = {d.slot: (i, d) for i, d in enumerate(unit.devices)}
    if len(devices) != len(unit.devices):
        refuse("devices", f"destination unit has {len(devices)} device(s), the capture has "
                          f"{len(unit.devices)}")
    for slot, selector in enumerate(devices):
        if slot not in by_slot:
            continue
        i, wanted = by_slot[slot]
        gpu = select_gpu(selector, facts.gpus)
        if gpu is None:
            refuse(f"devices[{i}]", f"device selector {selector!r} (slot {slot}) matches no GPU "
                                    "on the destination")
            continue
        if gpu.name != wanted.gpu_name:
            refuse(f"devices[{i}].gpu_name", f"slot {slot} is {gpu.name!r} ({gpu.uuid}), the "
                                             f"capture is {wanted.gpu_name!r}")
        if gpu.compute_capability != wanted.compute_capability:
            refuse(f"devices[{i}].compute_capability",
                   f"slot {slot} has compute capability {gpu.compute_capability}, the capture "
                   f"has {wanted.compute_capability}")
    return result


# Linux 6.16 restricted SO_PASSCRED/SO_PASSSEC to unix and netlink sockets; CRIU before 4.2
# reads them from every socket and so cannot dump any inet socket there (fixed in CRIU 4.2,
# checkpoint-restore/criu pull request 2719). Engines serve on TCP, so this is a hard floor.
CRIU_INET_KERNEL = (6, 16)
CRIU_INET_MINIMUM = (4, 2)


def _version(text: str, parts: int) -> tuple[int, ...] | None:
    digits: list[int] = []
    for piece in text.strip().split("."):
        num = ""
        for ch in piece:
            if not ch.isdigit():
                break
            num += ch
        if not num:
            break
        digits.append(int(num))
        if len(digits) == parts:
            break
    return tuple(digits) if digits else None


def criu_inet_refusal(kernel: str, criu_version: str) -> str | None:
    """Why the capsule's CRIU cannot checkpoint an engine's TCP sockets on this kernel, or
    None when it can (or the versions cannot be read: `criu check` still decides)."""
    k = _version(kernel, 2)
    c = _version(criu_version, 3)
    if k is None or c is None or len(k) < 2:
        return None
    if k >= CRIU_INET_KERNEL and c < CRIU_INET_MINIMUM:
        return (f"the capsule's CRIU {criu_version} cannot dump inet sockets on kernel "
                f"{kernel} (Linux >= 6.16 needs CRIU >= 4.2)")
    return None


def port_conflicts(wanted: Sequence[int], listening: set[int]) -> list[int]:
    """The ports of `wanted` that something on the host already listens on."""
    return sorted({p for p in wanted if p in listening})
