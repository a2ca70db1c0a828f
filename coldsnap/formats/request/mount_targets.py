"""Where a unit's bind mount may land inside its capsule (`launch.units[].mounts[].target`).

coldsnapd runs CRIU, cuda-checkpoint, `sh` and its helpers inside the capsule with the
container's capabilities. They, their libraries and their configuration come from the
capsule's read-only rootfs; a request that mounted a host directory it writes over one of
those places (`/usr/local/sbin`, `/etc`, a library directory) would choose what runs with
them, so a mount target may not be at `/` nor at or under:

- the program, library and configuration directories (`/usr`, `/bin`, `/sbin`, `/lib*`,
  `/etc`), the kernel's views (`/proc`, `/sys`, `/dev`);
- `/root`, root's home, which held CRIU's and Python's per-user configuration;
- coldsnapd's own paths in the capsule (`CAPSULE_STATE_DIR`, `CAPSULE_LOG_DIR`).

One place under them is a cache, not configuration: `/root/.cache` (`ALLOWED_UNDER_DENIED`),
where the reference's clients (Sparkrun) mount the Hugging Face cache
(`/root/.cache/huggingface`). Nothing coldsnapd runs reads it: every privileged exec runs
with `HOME` on a path that does not exist (coldsnap.capsule.spec.TRUSTED_EXEC_ENV).

A service policy can narrow the targets further (`mounts.targets`,
coldsnap.formats.service_policy).
"""

from __future__ import annotations

import posixpath

# coldsnapd's own directories inside every capsule (the capsule layer's spec names them).
CAPSULE_STATE_DIR = "/var/lib/coldsnap"
CAPSULE_LOG_DIR = "/var/log/coldsnap"

DENIED_ROOTS: tuple[str, ...] = (
    "/usr", "/bin", "/sbin", "/lib", "/etc", "/root", "/proc", "/sys", "/dev",
    CAPSULE_STATE_DIR, CAPSULE_LOG_DIR,
)
# `/lib32`, `/lib64`, `/libx32`, `/lib.usr-is-merged`...: every top-level name that starts so.
_DENIED_PREFIX = "/lib"
ALLOWED_UNDER_DENIED: tuple[str, ...] = ("/root/.cache",)


def within(path: str, root: str) -> bool:
    """Whether clean absolute `path` is `root` or inside it."""
    root = root.rstrip("/") or "/"
    return root == "/" or path == root or path.startswith(root + "/")


def _denied_root(path: str) -> str | None:
    top = "/" + path.split("/")[1]
    if top.startswith(_DENIED_PREFIX):
        return top
    return next((r for r in DENIED_ROOTS if within(path, r)), None)


def target_refusal(target: str) -> str | None:
    """Why a mount may not land at `target` (None: it may)."""
    if not target.startswith("/"):
        return f"'{target}' is not an absolute path"
    path = posixpath.normpath(target)
    if path == "/":
        return "a mount at '/' would replace the capsule's whole rootfs"
    denied = _denied_root(path)
    if denied is None or any(within(path, a) for a in ALLOWED_UNDER_DENIED):
        return None
    return (f"'{target}' is at or under '{denied}', where the programs coldsnapd runs with "
            "the capsule's capabilities (or their configuration, or coldsnapd's own state) "
            "live; mount under another directory (e.g. /models, /data, "
            f"{', '.join(ALLOWED_UNDER_DENIED)})")
