"""The CRIU capability probe: `criu check` from a capsule's pinned image on this host, with
the capsule's capabilities, before anything is restored there."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import docker.errors

from coldsnap.admission import criu_inet_refusal
from coldsnap.capsule.containers import LABEL_ROLE, list_containers, remove_container
from coldsnap.capsule.criu_log import HARMLESS_CRIU_ERRORS
from coldsnap.capsule.errors import CriuProbeFailed, CriuProbeRefused
from coldsnap.capsule.handle import fail
from coldsnap.capsule.session import LONG_DOCKER_CALL, CapsuleSession, trusted_argv
from coldsnap.capsule.spec import CRIU, CRIU_CAPABILITIES, CRIU_SECURITY_OPT, SH


@dataclass(frozen=True)
class CriuProbe:
    host: str
    image: str
    output: str
    version: str | None = None


# Docker keeps /proc/sys read-only, so `criu check` reports ns_last_pid as not writable. CRIU
# needs it only where clone3 cannot set a child's PID: with clone3_set_tid supported (and the
# container has the SYS_ADMIN it requires) that complaint is no refusal.
_PROBE = f'{CRIU} --version; {CRIU} check --feature clone3_set_tid; {CRIU} check'
_CLONE3_SET_TID = "clone3_set_tid is supported"
_NS_LAST_PID = "ns_last_pid sysctl is inaccessible"
# One probe's own container, whatever else it is labelled with.
_LABEL_PROBE = "org.coldsnap.probe"
# What the probe runs and with which privileges: a remembered probe is only as good as the
# recipe that passed, so a change of either makes every remembered one stale.
PROBE_RECIPE = "sha256:" + hashlib.sha256(json.dumps(
    [_PROBE, "network_mode=none", sorted(CRIU_CAPABILITIES), sorted(CRIU_SECURITY_OPT)]
).encode()).hexdigest()


def criu_check_passed(output: str) -> bool:
    """Whether the probe's output says CRIU can restore here: `criu check` looks good, or its
    only error is the read-only ns_last_pid and clone3 sets PIDs instead."""
    if "Looks good" in output:
        return True
    if _CLONE3_SET_TID not in output:
        return False
    errors = [ln for ln in output.splitlines() if ln.startswith("Error")
              and not any(h in ln for h in HARMLESS_CRIU_ERRORS)]
    return bool(errors) and all(_NS_LAST_PID in ln for ln in errors)


def criu_version(output: str) -> str | None:
    """The version `criu --version` printed ("Version: 4.2.1")."""
    for line in output.splitlines():
        if line.strip().startswith("Version:"):
            return line.split(":", 1)[1].strip() or None
    return None


async def probe_criu(s: CapsuleSession, image: str, *, unit: str = "-",
                     kernel: str | None = None, timeout_s: float = 120.0,
                     labels: Mapping[str, str] | None = None) -> CriuProbe:
    """Run `criu check` from `image` (the capsule or its base image, which pins the same
    CRIU) on this host, with the capsule's capabilities: the kernel-capability admission.
    With the host's `kernel`, the CRIU version floor for TCP-serving engines applies too.

    The probe container carries `labels` (an operation's, so that `coldsnapd gc` finds one
    that a killed run left) and is removed however the probe ends."""
    step = "criu-probe"
    tags = {**(labels or {}), LABEL_ROLE: "probe", _LABEL_PROBE: secrets.token_hex(8)}
    try:
        try:
            await s.call(s.client.images.get, image)
        except docker.errors.NotFound:
            await s.call(s.client.images.pull, image, timeout_s=LONG_DOCKER_CALL)
        api = s.client.api
        host_config = api.create_host_config(
            network_mode="none", cap_add=list(CRIU_CAPABILITIES),
            security_opt=list(CRIU_SECURITY_OPT))
        created = await s.call(api.create_container, image,
                               command=trusted_argv([SH, "-c", _PROBE]),
                               host_config=host_config, labels=tags)
        container = await s.call(s.client.containers.get, str(created["Id"]))
        await s.call(container.start)
        status = await asyncio.wait_for(s.call(container.wait), timeout_s)
        output = (await s.call(container.logs, stdout=True, stderr=True)).decode(
            errors="replace").strip()
    except docker.errors.DockerException as exc:
        await _remove_probe(s, tags)
        raise fail(s, unit, step, f"cannot run criu check from {image}: {exc}",
                   CriuProbeFailed) from exc
    except BaseException:
        # Also when cancelled with the creation in flight: found by its own label.
        await asyncio.shield(_remove_probe(s, tags, settle=True))
        raise
    await _remove_probe(s, tags)
    code = int(status.get("StatusCode", -1))
    if code not in (0, 1) or not criu_check_passed(output):
        raise fail(s, unit, step, f"criu check from {image} exited {code}: {output[-1500:]}",
                   CriuProbeRefused)
    probe = CriuProbe(s.host, image, output, criu_version(output))
    check_criu_version(s, probe, unit=unit, kernel=kernel)
    return probe


def check_criu_version(s: CapsuleSession, probe: CriuProbe, *, unit: str = "-",
                       kernel: str | None = None) -> None:
    """The CRIU version floor for TCP-serving engines on the host's `kernel`, for a probe
    that just passed or one remembered from an earlier restore."""
    if kernel is not None and probe.version is not None:
        why = criu_inet_refusal(kernel, probe.version)
        if why:
            raise fail(s, unit, "criu-probe", why, CriuProbeRefused)


async def _remove_probe(s: CapsuleSession, tags: Mapping[str, str], *,
                        settle: bool = False) -> None:
    """The probe container, found by its one-off label; a host that cannot be reached now
    leaves it to `coldsnapd gc` (it carries the operation's label)."""
    with contextlib.suppress(Exception):
        if settle:
            await s.settle(20.0)  # a creation still in flight lands before the search
        found = await list_containers(s, [f"{_LABEL_PROBE}={tags[_LABEL_PROBE]}"])
        for c in found:
            await remove_container(s, c.id)
