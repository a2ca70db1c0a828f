"""Temporary files that outlived the run that wrote them, on the hosts: what `coldsnapd gc`
sweeps besides containers. A transfer that was cut off keeps its `.coldsnap-part` (so the
next try resumes it), and a commit killed mid-save leaves its `.partial` tar; once a day has
passed, no run will resume them."""

from __future__ import annotations

from coldsnap.hosts.base import Host
from coldsnap.hosts.transfer.protocol import PART_SUFFIX

TEMP_MAX_AGE_S = 24 * 3600.0
# The commit's `docker save` target before its rename (coldsnap.capsule.oci.commit).
COMMIT_PARTIAL_SUFFIX = ".partial"
SWEEP_TIMEOUT_S = 60.0


async def sweep_host_temp(host: Host, data_dir: str, *, older_than_s: float = TEMP_MAX_AGE_S,
                          dry_run: bool = False) -> list[str]:
    """The temporary files under the host's data_dir older than `older_than_s`, removed
    unless `dry_run`; returns their paths. Only regular files, on data_dir's own filesystem,
    never through a symlink."""
    minutes = max(1, int(older_than_s // 60))
    argv = ["find", "-P", data_dir, "-xdev", "-type", "f",
            "(", "-name", f"*{PART_SUFFIX}", "-o", "-name", f"*{COMMIT_PARTIAL_SUFFIX}", ")",
            "-mmin", f"+{minutes}", "-print"]
    if not dry_run:
        argv.append("-delete")
    out = await host.run(["sh", "-c", '[ -d "$1" ] || exit 0; shift; exec "$@"', "sh",
                          data_dir, *argv], timeout=SWEEP_TIMEOUT_S,
                         output_limit=16 << 20)
    return sorted(out.stdout.decode(errors="replace").splitlines())
