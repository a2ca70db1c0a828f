"""A restore replaces only the earlier instance of the same workload on the unit's host, and
only after the new one validated: until then the earlier one is stopped, not removed, and a
restore that fails (here: cancelled by SIGTERM after its units started) brings it back."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

import docker.errors
import pytest

from tests.integration.capsule_fixtures import EXPECTED
from tests.integration.ops_fixtures import Ops, dev_requests, ops
from tests.integration.test_cancellation import artifact, labelled, start
from tests.integration.test_lifecycle import MOVED, _ask, _restore, _workload

pytestmark = pytest.mark.integration
__all__ = ["artifact", "dev_requests", "ops"]  # fixtures used by name below

HOSTS = ("host-2", "host-3")  # where MOVED places unit-0 and unit-1
LABEL_CLUSTER_ID = "org.coldsnap.workload.cluster-id"


@pytest.fixture
def foreign(ops: Ops) -> Iterator[Any]:
    """unit-0 of another workload on host-2, as a restore labels it (stopped: it serves
    nothing, so its port is no conflict). No restore of our workload may touch it."""
    client = ops.docker("host-2")
    made = []

    def make(image: str) -> Any:
        c = client.containers.create(image, ["/usr/local/bin/capsule-init"], labels={
            "org.coldsnap.unit": "unit-0", "org.coldsnap.role": "restore",
            LABEL_CLUSTER_ID: "another-workload", "org.coldsnap.operation": "someone-else"},
            network_mode="none")
        made.append(c)
        return c

    yield make
    for c in made:
        with contextlib.suppress(docker.errors.NotFound):
            c.remove(force=True)
    client.close()


def _ids(ops: Ops) -> dict[str, list[str]]:
    return {h: sorted(c.id for c in ops.unit_containers(h)
                      if c.labels.get(LABEL_CLUSTER_ID) != "another-workload") for h in HOSTS}


def test_a_failed_restore_leaves_the_earlier_instance_serving_and_others_alone(
        ops: Ops, artifact: str, foreign: Any) -> None:
    ops.remove_units()
    wl = _workload(ops, "replace")
    first = _restore(ops, artifact, wl, "replace-first")
    assert first.receipt is not None
    earlier = _ids(ops)
    assert all(len(ids) == 1 for ids in earlier.values()), earlier
    image = ops.docker("host-2").containers.get(earlier["host-2"][0]).image.id
    other = foreign(image)
    assert _ask(ops, "host-2") == (200, EXPECTED)

    request = ops.request(MOVED, suffix="replace-cancelled", artifact=artifact, workload=wl)
    run = start(ops, "restore", "--request", str(request))
    run.wait_for("restore.criu-restore", "host-3")
    # The new units run; the earlier ones are stopped, not removed, until validation.
    for host in HOSTS:
        (old,) = [c for c in ops.unit_containers(host) if c.id in earlier[host]]
        assert old.status == "exited", (host, old.status)
    run.signal(signal.SIGTERM)
    status, err, receipt = run.finish()

    assert status == 143, err
    message = receipt["error"]["message"]
    for unit, host in (("unit-0", "host-2"), ("unit-1", "host-3")):
        assert f"{unit} on {host} removed (previous coldsnap-" in message, message
    assert message.count("serving again") == 2, message
    assert labelled(ops, receipt["operation_id"]) == {}
    # The earlier instance is back, the same containers, serving the validation prompt.
    assert _ids(ops) == earlier
    for host in HOSTS:
        (old,) = [c for c in ops.unit_containers(host) if c.id in earlier[host]]
        assert old.status == "running", (host, old.status)
    assert _ask(ops, "host-2") == (200, EXPECTED)
    # The other workload's unit-0 was never the restore's to stop or remove.
    other.reload()  # raises NotFound once removed

    # A restore that validates replaces the earlier instance, and only it.
    second = _restore(ops, artifact, wl, "replace-second")
    assert second.receipt is not None
    now = _ids(ops)
    assert all(len(ids) == 1 for ids in now.values()) and not set(
        now["host-2"] + now["host-3"]) & set(earlier["host-2"] + earlier["host-3"]), now
    assert _ask(ops, "host-2") == (200, EXPECTED)
    other.reload()
    ops.remove_units()
