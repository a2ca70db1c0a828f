"""Restore identity: is a restore request's launch the same execution as the captured one?

Pure. Implements FORMATS.md "Restore identity in detail": identity must match, placement may
change (hosts, device selector values, mount sources, transport variables, and the image where
the capsule pins the captured one). A value the captured launch withholds (an artifact
imported from a registry publication, coldsnap.formats.publication) is the restore's to give:
any value matches it, as long as the restore gives one.

Public API:
- `compare_restore_identity(captured, restore, *, capsule_pins_image=True)
  -> list[ValidationIssue]`: empty when the restore may proceed; otherwise one issue per
  differing field, its path in the restore request (`launch.units[0].command[5]`, ...).
- `is_transport_variable(name) -> bool`.
- `normalize_command(argv) -> list[str]`: placement values replaced by `PLACEMENT`.
- `flag_value(argv, flags) -> str | None`: the value a command gives a flag, either spelling.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from coldsnap.formats.errors import ValidationIssue, join
from coldsnap.formats.publication import is_withheld
from coldsnap.formats.redaction import REDACTED
from coldsnap.formats.request import Launch, Unit

TRANSPORT_VARIABLES = frozenset({
    "GLOO_SOCKET_IFNAME", "MN_IF_NAME", "NODE_IP", "TP_SOCKET_IFNAME", "UCX_NET_DEVICES",
    "VLLM_HOST_IP",
})
TRANSPORT_PREFIXES = ("NCCL_", "OMPI_MCA_", "UCX_")
PLACEMENT_FLAGS = ("--master-address", "--master-addr", "--master-port", "--dist-init-addr",
                   "--port")
PLACEMENT = "<placement>"

# Inside one argument (a shell string, or `--port=8000`): the flag must stand alone, so
# `--portal` or `--port-range` are not placement; the separator is kept, so switching between
# `--port=1` and `--port 1` still shows up as a difference.
_INLINE = re.compile(
    r"(?<!\S)(" + "|".join(re.escape(f) for f in PLACEMENT_FLAGS) + r")(=|\s+)(\S+)"
)


def is_transport_variable(name: str) -> bool:
    return name in TRANSPORT_VARIABLES or name.startswith(TRANSPORT_PREFIXES)


def normalize_command(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    replace_next = False
    for arg in argv:
        if replace_next:
            out.append(PLACEMENT)
            replace_next = False
            continue
        if arg in PLACEMENT_FLAGS:
            out.append(arg)
            replace_next = True
            continue
        out.append(_INLINE.sub(lambda m: f"{m.group(1)}{m.group(2)}{PLACEMENT}", arg))
    return out


def flag_value(argv: Sequence[str], flags: Sequence[str]) -> str | None:
    """The value a command gives one of `flags` (`FLAG VALUE` as two arguments, or
    `FLAG=VALUE` / `FLAG VALUE` inside one argument); the last one wins, as in argparse."""
    found: str | None = None
    for i, arg in enumerate(argv):
        if arg in flags:
            if i + 1 < len(argv):
                found = argv[i + 1]
            continue
        for m in re.finditer(r"(?<!\S)(--[A-Za-z0-9-]+)(=|\s+)(\S+)", arg):
            if m.group(1) in flags:
                found = m.group(3)
    return found


def _gives_withheld(captured: str, restore: str) -> bool:
    """Whether `restore` gives the value that the captured `captured` withholds: any value
    for a withheld one, the same flag with any value for a withheld `--flag=value`."""
    if not is_withheld(captured) or is_withheld(restore):
        return False
    if captured == REDACTED:
        return True
    flag = captured[:-len(REDACTED)]
    return restore.startswith(flag)


def _same(issues: list[ValidationIssue], path: str, captured: Any, restore: Any) -> None:
    if captured != restore:
        issues.append(ValidationIssue(path, f"is {restore!r} but the capture has {captured!r}"))


def _compare_records(issues: list[ValidationIssue], path: str, captured: list[dict[str, Any]],
                     restore: list[dict[str, Any]], what: str) -> None:
    if len(captured) != len(restore):
        issues.append(ValidationIssue(path, f"{len(restore)} {what} but the capture has "
                                            f"{len(captured)}"))
    for i, (old, new) in enumerate(zip(captured, restore, strict=False)):
        for key in sorted(set(old) | set(new)):
            _same(issues, f"{path}[{i}].{key}", old.get(key), new.get(key))


def _compare_unit(issues: list[ValidationIssue], path: str, old: Unit, new: Unit,
                  capsule_pins_image: bool) -> None:
    _same(issues, f"{path}.id", old.id, new.id)
    _same(issues, f"{path}.index", old.index, new.index)
    if len(old.devices) != len(new.devices):
        issues.append(ValidationIssue(f"{path}.devices", f"{len(new.devices)} device(s) but the "
                                      f"capture has {len(old.devices)}; the device-slot shape "
                                      "is identity"))
    if not capsule_pins_image:
        _same(issues, f"{path}.image", old.image, new.image)
        _same(issues, f"{path}.image_digest", old.image_digest, new.image_digest)

    old_cmd, new_cmd = normalize_command(old.command), normalize_command(new.command)
    if len(old_cmd) != len(new_cmd):
        issues.append(ValidationIssue(f"{path}.command", f"has {len(new_cmd)} arguments but the "
                                      f"capture has {len(old_cmd)}"))
    else:
        for j, (a, b) in enumerate(zip(old_cmd, new_cmd, strict=True)):
            if a != b and not _gives_withheld(a, b):
                issues.append(ValidationIssue(f"{path}.command[{j}]",
                                              f"is {new.command[j]!r} but the capture has "
                                              f"{old.command[j]!r}"))

    old_env = {k: v for k, v in old.environment.items() if not is_transport_variable(k)}
    new_env = {k: v for k, v in new.environment.items() if not is_transport_variable(k)}
    for name in sorted(set(old_env) | set(new_env)):
        where = join(f"{path}.environment", name)
        if name not in new_env:
            issues.append(ValidationIssue(where, "is missing but the capture sets it"))
        elif name not in old_env:
            issues.append(ValidationIssue(where, "is set but the capture does not set it"))
        elif not _gives_withheld(old_env[name], new_env[name]):
            _same(issues, where, old_env[name], new_env[name])

    old_mounts = {m.target: m.read_only for m in old.mounts}
    new_mounts = {m.target: (j, m.read_only) for j, m in enumerate(new.mounts)}
    for target in old_mounts:
        if target not in new_mounts:
            issues.append(ValidationIssue(f"{path}.mounts", f"lacks the captured mount target "
                                                            f"'{target}'"))
    for target, (j, read_only) in new_mounts.items():
        if target not in old_mounts:
            issues.append(ValidationIssue(f"{path}.mounts[{j}].target",
                                          f"'{target}' is not a captured mount target"))
        elif old_mounts[target] != read_only:
            _same(issues, f"{path}.mounts[{j}].read_only", old_mounts[target], read_only)


def compare_restore_identity(captured: Launch, restore: Launch, *,
                             capsule_pins_image: bool = True,
                             base: str = "launch") -> list[ValidationIssue]:
    issues: list[ValidationIssue] = []
    _same(issues, f"{base}.engine", captured.engine, restore.engine)
    for field in ("id", "revision", "source"):
        _same(issues, f"{base}.model.{field}", getattr(captured.model, field),
              getattr(restore.model, field))
    if len(captured.units) != len(restore.units):
        issues.append(ValidationIssue(f"{base}.units", f"{len(restore.units)} unit(s) but the "
                                                       f"capture has {len(captured.units)}"))
    for i, (old, new) in enumerate(zip(captured.units, restore.units, strict=False)):
        _compare_unit(issues, f"{base}.units[{i}]", old, new, capsule_pins_image)

    ex = f"{base}.execution"
    old_ex, new_ex = captured.execution, restore.execution
    _same(issues, f"{ex}.adapter.schema", old_ex.adapter.schema_, new_ex.adapter.schema_)
    _same(issues, f"{ex}.adapter.digest", old_ex.adapter.digest, new_ex.adapter.digest)
    _compare_records(issues, f"{ex}.workers", [w.to_json() for w in old_ex.workers],
                     [w.to_json() for w in new_ex.workers], "worker(s)")
    _compare_records(issues, f"{ex}.groups", [g.to_json() for g in old_ex.groups],
                     [g.to_json() for g in new_ex.groups], "group(s)")
    _compare_records(issues, f"{ex}.services", [s.to_json() for s in old_ex.services],
                     [s.to_json() for s in new_ex.services], "service(s)")
    return issues
