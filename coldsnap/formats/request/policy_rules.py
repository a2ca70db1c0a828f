"""Policy rules that relate fields to each other or to the launch: CUDA graphs, weights
recovery, the compiler-cache paths and the mounts they must not overlap; and the values of
the format that this coldsnapd does not act on, refused rather than validated and ignored
(`unsupported_issues`; docs/formats.md lists what each field does here)."""

from __future__ import annotations

import posixpath

from coldsnap.formats.errors import Issues, join
from coldsnap.formats.request.models import Request
from coldsnap.formats.request.policy import CACHE_ROOTS


def policy_issues(issues: Issues, req: Request) -> None:
    _process_issues(issues, req)
    _weights_issues(issues, req)
    _cache_issues(issues, req)
    unsupported_issues(issues, req)


def _unsupported(issues: Issues, path: str, value: object, why: str) -> None:
    issues.add(path, f"{value!r} is not supported by this coldsnapd: {why}")


def unsupported_issues(issues: Issues, req: Request) -> None:
    """Values the format allows that coldsnapd does not act on: each is refused, naming its
    field, with what coldsnapd does instead. Only values the reference refuses too, or that
    would need work coldsnapd does not do, belong here: tests/unit/compat_corpus holds the
    requests that the reference's clients send, and each must stay accepted."""
    native = req.policy.weights.native
    if native is not None and native.materialize == "async":
        _unsupported(issues, "policy.weights.native.materialize", "async",
                     "nothing writes native packs in the background here ('off': none is "
                     "written; 'required': every payload is staged before any unit starts)")


def _inside(path: str, root: str) -> bool:
    """True when `path` equals `root` or lies below it (both clean and absolute)."""
    return path == root or root == "/" or path.startswith(root + "/")


def _process_issues(issues: Issues, req: Request) -> None:
    process = req.policy.process
    if process.async_graphs:
        for i, unit in enumerate(req.launch.units):
            for j, arg in enumerate(unit.command):
                if "--enforce-eager" in arg:
                    issues.add(f"launch.units[{i}].command[{j}]",
                               "--enforce-eager is refused while policy.process.async_graphs "
                               "is true (eager mode has no CUDA graphs to capture)")
    else:
        if process.graph_policy not in ("", "disabled"):
            issues.add("policy.process.graph_policy", "must be empty or 'disabled' when "
                                                      "async_graphs is false")
        if process.shape_calibration == "enabled":
            issues.add("policy.process.shape_calibration", "'enabled' needs async_graphs")


def _weights_issues(issues: Issues, req: Request) -> None:
    weights = req.policy.weights
    if weights.mode != "native" and not weights.recovery.enabled:
        issues.add("policy.weights.recovery.enabled",
                   f"must be true for weights mode '{weights.mode}' (only 'native' may "
                   "disable recovery)")
    worker_ids = {w.id for w in req.launch.execution.workers}
    native = weights.native
    if native is not None:
        for wid in (native.files_by_worker or {}):
            if wid not in worker_ids:
                issues.add(join("policy.weights.native.files_by_worker", wid),
                           f"unknown worker '{wid}'")
        for i, staged in enumerate(native.staged or []):
            if staged.worker not in worker_ids:
                issues.add(f"policy.weights.native.staged[{i}].worker",
                           f"unknown worker '{staged.worker}'")


def _cache_issues(issues: Issues, req: Request) -> None:
    cache = req.policy.cache
    if not cache.seed:
        if cache.paths:
            issues.add("policy.cache.paths", "must be empty when seed is false")
        if cache.staged:
            issues.add("policy.cache.staged", "must be empty when seed is false")
    _cache_path_issues(issues, cache.paths)
    if cache.staged:
        _cache_staged_issues(issues, req)
    _cache_mount_issues(issues, req)


def _cache_path_issues(issues: Issues, paths: list[str]) -> None:
    seen: dict[str, int] = {}
    for i, path in enumerate(paths):
        pp = f"policy.cache.paths[{i}]"
        if path in seen:
            issues.add(pp, f"repeats paths[{seen[path]}]")
            continue
        seen[path] = i
        if not any(_inside(path, root) for root in CACHE_ROOTS):
            issues.add(pp, "is not under a known compiler-cache root (" + ", ".join(CACHE_ROOTS)
                       + ")")
    # Nesting through each path's ancestors and a lookup table: linear in the paths times
    # their depth, where comparing every pair took seconds for a few thousand paths.
    first = {p: i for i, p in reversed(list(enumerate(paths)))}
    for i, path in enumerate(paths):
        parent = posixpath.dirname(path)
        while parent != path:
            j = first.get(parent)
            if j is not None:
                issues.add(f"policy.cache.paths[{i}]", f"is nested inside paths[{j}] ('{parent}')")
            path, parent = parent, posixpath.dirname(parent)


def _cache_staged_issues(issues: Issues, req: Request) -> None:
    """A capture stages exactly one cache per unit; nothing else stages one."""
    if req.operation != "capture":
        issues.add("policy.cache.staged", "is only for capture")
    unit_ids = [u.id for u in req.launch.units]
    counted: dict[str, int] = {}
    for i, entry in enumerate(req.policy.cache.staged):
        if entry.unit not in unit_ids:
            issues.add(f"policy.cache.staged[{i}].unit", f"unknown unit '{entry.unit}'")
        elif entry.unit in counted:
            issues.add(f"policy.cache.staged[{i}].unit", f"unit '{entry.unit}' already has "
                                                         f"staged[{counted[entry.unit]}]")
        else:
            counted[entry.unit] = i
    missing = [u for u in unit_ids if u not in counted]
    if missing and req.operation == "capture":
        issues.add("policy.cache.staged", "needs exactly one entry per unit; missing: "
                                          + ", ".join(missing))


def _cache_mount_issues(issues: Issues, req: Request) -> None:
    paths = req.policy.cache.paths
    for i, unit in enumerate(req.launch.units):
        for j, mount in enumerate(unit.mounts):
            for k, path in enumerate(paths):
                if _inside(mount.target, path) or _inside(path, mount.target):
                    issues.add(f"launch.units[{i}].mounts[{j}].target",
                               f"'{mount.target}' overlaps the runtime cache path "
                               f"policy.cache.paths[{k}] ('{path}')")
