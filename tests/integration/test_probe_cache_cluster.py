"""The remembered CRIU probe on the dev cluster (real dockerd, real CRIU): a second restore on
the same boot of a host starts no probe container, another image is probed again, a failed
probe is never remembered. Probe containers are counted from each dockerd's own events."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from coldsnap.capsule import CriuProbeFailed
from coldsnap.capsule.containers import LABEL_OPERATION, LABEL_ROLE
from coldsnap.hosts.probe import probe_hosts
from coldsnap.operations.probe_cache import (
    PROBES_DIR,
    ProbeCache,
    admit_criu,
    probe_key,
)
from tests.integration.capsule_fixtures import *  # noqa: F403
from tests.integration.capsule_fixtures import BREAK_CRIU, ClusterHost, unique
from tests.integration.ops_fixtures import Ops, dev_requests, ops

pytestmark = pytest.mark.integration
__all__ = ["dev_requests", "ops"]  # fixtures used by name below


def _probe_creations(client: Any, since: float, *labels: str) -> int:
    """Probe containers this dockerd created since `since` (with all of `labels`)."""
    events = client.events(since=int(since) - 1, until=int(time.time()) + 1, decode=True,
                           filters={"type": "container", "event": "create",
                                    "label": [f"{LABEL_ROLE}=probe", *labels]})
    return sum(1 for _ in events)


def _probe_spans(receipt: dict[str, Any]) -> dict[str, bool]:
    return {s["attributes"]["unit"]: s["attributes"]["cached"]
            for s in receipt["timing"]["spans"] if s["name"] == "restore.criu-probe"}


def test_second_restore_on_the_same_boot_starts_no_probe_container(ops: Ops) -> None:
    cap = ops.coldsnapd("capture", "--request",
                        str(ops.request("tp2-two-hosts", suffix="probe-cache"))).ok()
    assert cap.receipt is not None
    capture_id = cap.receipt["result"]["artifact"]
    t0 = time.time()
    first = ops.coldsnapd("restore", "--artifact", capture_id).ok()
    second = ops.coldsnapd("restore", "--artifact", capture_id).ok()
    assert first.receipt is not None and second.receipt is not None
    assert _probe_spans(first.receipt) == {"unit-0": False, "unit-1": False}
    assert _probe_spans(second.receipt) == {"unit-0": True, "unit-1": True}
    remembered = list((ops.store / PROBES_DIR).glob("*.json"))
    assert len(remembered) == 2  # one per (host, capsule image)
    for host in ("host-0", "host-1"):
        client = ops.docker(host)
        try:
            ran = _probe_creations(client, t0,
                                   f"{LABEL_OPERATION}={first.receipt['operation_id']}")
            again = _probe_creations(client, t0,
                                     f"{LABEL_OPERATION}={second.receipt['operation_id']}")
        finally:
            client.close()
        assert (ran, again) == (1, 0), host
    ops.remove_units()


async def _facts_key(h: ClusterHost, image: str) -> Any:
    (probed,) = await probe_hosts([(h.target.host, h.entry)])
    facts = probed.admission_facts()
    key = probe_key(h.entry, facts, image)
    assert key is not None, f"{h.name}: the facts name no boot or dockerd: {probed}"
    return key


async def _image_id(h: ClusterHost, ref: str) -> str:
    s = h.session
    repo, digest = ref.split("@", 1)
    await s.call(s.client.images.pull, repo, tag=digest)
    return str((await s.call(s.client.images.get, ref)).id)


async def _variant(h: ClusterHost, ref: str, script: str) -> str:
    """An image made from `ref` by running `script` in it: another image id."""
    s = h.session
    c = await s.call(s.client.containers.create, ref, ["sh", "-c", script], network_mode="none")
    try:
        await s.call(c.start)
        assert (await s.call(c.wait))["StatusCode"] == 0
        repo, tag = f"coldsnap-test/probe-variant:{unique('t')}".split(":")
        image = await s.call(c.commit, repository=repo, tag=tag)
    finally:
        await s.call(c.remove, force=True)
    return str(image.id)


async def _admit(h: ClusterHost, cache: ProbeCache, image: str, op: str) -> Any:
    key = await _facts_key(h, image)
    return await admit_criu(h.session, cache, key, cache.lookup(key), image, unit="probe-test",
                            kernel=None, labels={LABEL_OPERATION: op})


async def test_another_image_is_probed_again_and_a_failed_probe_is_not_remembered(
    capsule_cluster: dict[str, ClusterHost], capsule_ref: str, tmp_path: Path
) -> None:
    h = capsule_cluster["host-1"]
    s = h.session
    cache = ProbeCache(tmp_path)
    op = unique("probe-op")
    t0 = time.time()
    base = await _image_id(h, capsule_ref)
    other = await _variant(h, capsule_ref, "echo variant > /etc/coldsnap-probe-variant")
    broken = await _variant(h, capsule_ref, BREAK_CRIU)
    try:
        await _admit(h, cache, base, op)
        assert cache.lookup(await _facts_key(h, base)) is not None
        await _admit(h, cache, base, op)  # remembered: no container
        assert cache.lookup(await _facts_key(h, other)) is None
        await _admit(h, cache, other, op)  # another image id: probed
        key = await _facts_key(h, other)
        assert cache.lookup(key) is not None
        # The same probe after a reboot (another boot id) or under another dockerd is not it.
        assert cache.lookup(dataclasses.replace(key, boot_id=unique("boot"))) is None
        assert cache.lookup(dataclasses.replace(key, docker_instance="1 2")) is None
        for _ in range(2):
            with pytest.raises(CriuProbeFailed):
                await _admit(h, cache, broken, op)
        assert cache.lookup(await _facts_key(h, broken)) is None
        assert len(list((tmp_path / PROBES_DIR).glob("*.json"))) == 2
        # base once, other once, broken twice (never remembered).
        made = await s.call(_probe_creations, s.client, t0, f"{LABEL_OPERATION}={op}")
        assert made == 4
    finally:
        for image in (other, broken):
            await s.call(s.client.images.remove, image, force=True)
