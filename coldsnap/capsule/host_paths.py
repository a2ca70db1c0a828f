"""The host paths a unit's container binds, held to the service's policy where they really lie.

The service checks each mount source and the log path as the request spells them
(coldsnap.formats.service_policy); a symlink on the host can still lead elsewhere
(`/srv/models/x -> /`). Before a container is created, each path is resolved on its host with
`realpath -m` (missing components allowed: the log file may not exist yet), and a path whose
resolution leaves the roots (`UnitSpec.mount_roots`, `UnitSpec.log_roots`; None: unrestricted)
is refused before anything is created or bound. The roots are resolved there too.

Docker resolves a bind's source again when it starts the container, which for a restore is
after staging: a checked directory swapped meanwhile for a symlink to `/` (by an engine with a
read-write mount of its parent) would be bound instead. So the check is verified where it is
used (`checked_binds`, `verify_binds`): when the container is created, every bind's source is
resolved once more (`realpath -e`; it must resolve where the check resolved it) and the
identity (st_dev, st_ino) of that real path is taken with `stat` (no symlink followed); once the
container runs and before anything else is exec'd in it, the real path's identity is taken again
on the host (no symlink followed) and each bind's target is stat'ed inside the container by an
exec of coldsnapd's (`python3 -I -S`, its trusted environment). A bind mount shows the inode of
what it binds, on the same device, so all three must be equal; a mismatch refuses the unit by
its field, and the container is removed before the engine ever runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.handle import CheckedBind, fail
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import ENGINE_LOG, PYTHON, UnitSpec
from coldsnap.formats.request import Mount
from coldsnap.formats.service_policy import within

# Each argument's real path (`realpath -e`: it must exist, Docker binds nothing missing) and the
# identity of that path itself (`stat` follows no symlink), NUL-separated; two empty fields for
# one that cannot be resolved or stat'ed.
_IDENTITIES = ('for p; do\n'
               '  if r=$(realpath -e -- "$p") && i=$(stat -c %d:%i -- "$r"); then\n'
               '    printf "%s\\0%s\\0" "$r" "$i"\n'
               '  else printf "\\0\\0"; fi\n'
               'done')
# Inside the container, run by coldsnapd before the engine: the identity of each bind target,
# one JSON list. Isolated Python without site: nothing the image's environment or a user site
# can change; the paths are arguments, never part of the program's text.
_TARGETS = ("import json, os, sys\n"
            "out = []\n"
            "for t in sys.argv[1:]:\n"
            "    try:\n"
            "        st = os.stat(t)\n"
            "        out.append('%d:%d' % (st.st_dev, st.st_ino))\n"
            "    except OSError as e:\n"
            "        out.append('error: ' + str(e))\n"
            "print(json.dumps(out))\n")
# A test seam (tests/integration/test_host_path_swap.py): with this variable naming a directory
# in coldsnapd's own environment, each unit's container creation, right after its binds are
# checked and identified (before Docker creates the container), writes `<dir>/<unit>.checked`
# and waits for `<dir>/<unit>.go` (at most HOLD_LIMIT_S), so that a test can swap a checked
# path at the moment an engine could.
HOLD_ENV = "COLDSNAP_TEST_HOLD_AFTER_PATH_CHECK"
HOLD_LIMIT_S = 120.0



async def host_realpaths(s: CapsuleSession, paths: list[str]) -> list[str | None]:
    """Each of `paths` with every symlink on the host resolved (None: it cannot be)."""
    if not paths:
        return []
    # -z: one NUL after each, so a path with a newline in it cannot shift the others.
    res = await s.target.host.run(["realpath", "-m", "-z", "--", *paths], check=False,
                                  timeout=30)
    lines = res.stdout.decode(errors="replace").split("\0")
    if res.exit_status != 0 or len(lines) < len(paths):
        return [None] * len(paths)
    return [line if line.startswith("/") else None for line in lines[:len(paths)]]


async def check_host_paths(s: CapsuleSession, spec: UnitSpec, step: str,
                           error: type[CapsuleError]) -> dict[str, str]:
    """Raise `error` naming the field when a mount source or the log path of `spec` resolves,
    on this host, outside the roots the policy allows; else each checked field's real path."""
    checks: list[tuple[str, str, tuple[str, ...], str]] = []
    if spec.mount_roots is not None:
        checks += [(f"mounts[{j}].source", m.source, spec.mount_roots, "mounts.allow")
                   for j, m in enumerate(spec.mounts)]
    if spec.mount_roots is not None and spec.cache_seed is not None:
        # A staged cache is read from the host like a mount source: held to the same roots.
        checks.append((f"{spec.cache_seed[0]}.path", spec.cache_seed[1], spec.mount_roots,
                       "mounts.allow"))
    if spec.log_roots is not None and spec.log_path is not None:
        checks.append(("workload.log_path", spec.log_path, spec.log_roots, "log_paths.allow"))
    # The roots are resolved on the host too: a root that is itself a symlink (/srv/models ->
    # /mnt/models) allows what lies beneath its target.
    all_roots = sorted({r for _, _, roots, _ in checks for r in roots})
    resolved_paths = await host_realpaths(s, [path for _, path, _, _ in checks] + all_roots)
    real_root = dict(zip(all_roots, resolved_paths[len(checks):], strict=True))
    for (field, path, roots, rule), resolved in zip(checks, resolved_paths[:len(checks)],
                                                    strict=True):
        real_roots = [r for r in (real_root[x] for x in roots) if r is not None]
        if resolved is None or not within(resolved, real_roots):
            where = f"resolves to {resolved}" if resolved else "cannot be resolved"
            raise fail(s, spec.unit_id, step,
                       f"{field}: {path} {where} on the host, outside {rule} "
                       f"({', '.join(roots) or 'nothing allowed'})", error)
    return {field: resolved or "" for (field, _, _, _), resolved
            in zip(checks, resolved_paths[:len(checks)], strict=True)}


def bind_field(spec: UnitSpec, j: int, mount: Mount) -> str:
    """The field a refusal of the container's `j`-th bind names."""
    if j < len(spec.mounts):
        return f"mounts[{j}].source"
    if spec.log_path is not None and mount.target == ENGINE_LOG:
        return "workload.log_path"
    return f"coldsnapd's own bind at {mount.target}"


async def _identities(s: CapsuleSession, paths: Sequence[str]) -> list[tuple[str, str] | None]:
    """(real path, st_dev:st_ino) of each of `paths` on the host (None: it cannot be)."""
    if not paths:
        return []
    res = await s.target.host.run(["sh", "-c", _IDENTITIES, "identities", *paths],
                                  check=False, timeout=30)
    fields = res.stdout.decode(errors="replace").split("\0")
    out: list[tuple[str, str] | None] = []
    for k in range(len(paths)):
        real, ident = (fields[2 * k], fields[2 * k + 1]) if 2 * k + 1 < len(fields) \
            else ("", "")
        out.append((real, ident) if real.startswith("/") and ident else None)
    return out


async def hold_for_test(unit: str) -> None:
    """The test seam HOLD_ENV describes; nothing without it."""
    where = os.environ.get(HOLD_ENV)
    if where:
        await asyncio.to_thread(_hold, where, unit)


def _hold(where: str, unit: str) -> None:
    Path(where, f"{unit}.checked").touch()
    go = Path(where, f"{unit}.go")
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


async def checked_binds(s: CapsuleSession, spec: UnitSpec, mounts: Sequence[Mount],
                        checked: Mapping[str, str], step: str,
                        error: type[CapsuleError]) -> tuple[CheckedBind, ...]:
    """Every bind of the container about to be created, resolved and identified on the host.
    A source that no longer resolves where `check_host_paths` resolved it (`checked`) is
    refused: the identity is taken of the path that was checked, or of nothing."""
    found = await _identities(s, [m.source for m in mounts])
    binds = []
    for j, (m, got) in enumerate(zip(mounts, found, strict=True)):
        field = bind_field(spec, j, m)
        if got is None:
            raise fail(s, spec.unit_id, step, f"{field}: {m.source} cannot be resolved or "
                       "stat'ed on the host", error)
        if field in checked and checked[field] != got[0]:
            raise fail(s, spec.unit_id, step, f"{field}: {m.source} resolved to "
                       f"{checked[field]} when it was checked and to {got[0]} just after: "
                       "it changed on the host while it was checked", error)
        binds.append(CheckedBind(field, m.source, m.target, got[0], got[1]))
    return tuple(binds)


def binds_label(binds: Sequence[CheckedBind]) -> str:
    """The binds as the container's label LABEL_BINDS keeps them: Docker binds the sources
    anew at every start, so a container stopped and started again (a restore's revive) is
    verified against what was checked when it was created."""
    return json.dumps([[b.field_name, b.source, b.target, b.real, b.identity] for b in binds])


def binds_from_label(text: str | None) -> tuple[CheckedBind, ...] | None:
    """`binds_label`'s binds back; None: no label (a container made before it), or not ours."""
    try:
        rows = json.loads(text) if text else None
        return None if rows is None else tuple(CheckedBind(*(str(x) for x in r)) for r in rows)
    except (ValueError, TypeError):
        return None


async def verify_binds(s: CapsuleSession, container: Any, unit: str,
                       binds: Sequence[CheckedBind], step: str,
                       error: type[CapsuleError] = CapsuleError) -> None:
    """Raise `error` naming the field when a bind of the running `container` is not the
    directory or file that was checked: its target's identity inside the container, and its
    real path's on the host now, must both be the one taken at creation."""
    if not binds:
        return
    res = await s.target.host.run(["stat", "-c", "%d:%i", "--", *[b.real for b in binds]],
                                  check=False, timeout=30)
    now = res.stdout.decode(errors="replace").split("\n")
    out = await s.exec(container, [*PYTHON, "-S", "-c", _TARGETS,
                                   *[b.target for b in binds]], timeout_s=60)
    try:
        inside = [str(x) for x in json.loads(out.stdout)] if out.ok else []
    except ValueError:
        inside = []
    if len(inside) != len(binds):
        raise fail(s, unit, step, "cannot stat the bind mounts inside the container: "
                   f"{out.tail()}", error)
    for k, b in enumerate(binds):
        host_now = now[k] if res.exit_status == 0 and k < len(now) else "gone"
        if inside[k] != b.identity or host_now != b.identity:
            raise fail(s, unit, step,
                       f"{b.field_name}: {b.source} is not what was checked: it resolved to "
                       f"{b.real} (inode {b.identity}), which is now {host_now} on the host, "
                       f"and the container's {b.target} is {inside[k]}; a path swapped (for a "
                       "symlink?) after the check is refused", error)
