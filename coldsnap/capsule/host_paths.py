"""The host paths a unit's container binds, held to the service's policy where they really lie.

The service checks each mount source and the log path as the request spells them
(coldsnap.formats.service_policy); a symlink on the host can still lead elsewhere
(`/srv/models/x -> /`). Before a container is created, each path is resolved on its host with
`realpath -m` (missing components allowed: the log file may not exist yet), and a path whose
resolution leaves the roots (`UnitSpec.mount_roots`, `UnitSpec.log_roots`; None: unrestricted)
is refused before anything is created or bound.
"""

from __future__ import annotations

from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.handle import fail
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import UnitSpec
from coldsnap.formats.service_policy import within


async def host_realpath(s: CapsuleSession, path: str) -> str | None:
    """`path` with every symlink on the host resolved; None when it cannot be resolved."""
    res = await s.target.host.run(["realpath", "-m", "--", path], check=False, timeout=30)
    if res.exit_status != 0:
        return None
    resolved = res.stdout.decode(errors="replace").rstrip("\n")
    return resolved if resolved.startswith("/") else None


async def check_host_paths(s: CapsuleSession, spec: UnitSpec, step: str,
                           error: type[CapsuleError]) -> None:
    """Raise `error` naming the field when a mount source or the log path of `spec` resolves,
    on this host, outside the roots the policy allows."""
    checks: list[tuple[str, str, tuple[str, ...], str]] = []
    if spec.mount_roots is not None:
        checks += [(f"mounts[{j}].source", m.source, spec.mount_roots, "mounts.allow")
                   for j, m in enumerate(spec.mounts)]
    if spec.log_roots is not None and spec.log_path is not None:
        checks.append(("workload.log_path", spec.log_path, spec.log_roots, "log_paths.allow"))
    for field, path, roots, rule in checks:
        resolved = await host_realpath(s, path)
        if resolved is None or not within(resolved, roots):
            where = f"resolves to {resolved}" if resolved else "cannot be resolved"
            raise fail(s, spec.unit_id, step,
                       f"{field}: {path} {where} on the host, outside {rule} "
                       f"({', '.join(roots) or 'nothing allowed'})", error)
