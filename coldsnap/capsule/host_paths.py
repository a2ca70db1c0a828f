"""The host paths a unit's container binds, held to the service's policy where they really lie.

The service checks each mount source and the log path as the request spells them
(coldsnap.formats.service_policy); a symlink on the host can still lead elsewhere
(`/srv/models/x -> /`). Before a container is created, each path is resolved on its host with
`realpath -m` (missing components allowed: the log file may not exist yet), and a path whose
resolution leaves the roots (`UnitSpec.mount_roots`, `UnitSpec.log_roots`; None: unrestricted)
is refused before anything is created or bound. The roots are resolved there too.
"""

from __future__ import annotations

from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.handle import fail
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import UnitSpec
from coldsnap.formats.service_policy import within


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
                           error: type[CapsuleError]) -> None:
    """Raise `error` naming the field when a mount source or the log path of `spec` resolves,
    on this host, outside the roots the policy allows."""
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
