"""Which earlier containers a restore may replace: those of its own workload only."""

from __future__ import annotations

from coldsnap.capsule.containers import LABEL_ARTIFACT, LABEL_CLUSTER_ID, UnitContainer
from coldsnap.formats.request import Workload, load_request
from coldsnap.operations.replace import previous_identity, same_workload
from tests.unit.conftest import EXAMPLES, make_artifact


def _container(**labels: str) -> UnitContainer:
    return UnitContainer("id", "coldsnap-unit-0-restore-x", "restore", "running", (), labels)


def test_a_named_workload_replaces_its_own_containers_whatever_the_artifact() -> None:
    artifact = make_artifact("cap-1")
    request = load_request(EXAMPLES / "tp2-two-hosts.yaml").model_copy(update={
        "workload": Workload(cluster_id="spark-a")})
    identity = previous_identity(request, artifact)
    assert identity == [f"{LABEL_CLUSTER_ID}=spark-a"]
    assert same_workload(_container(**{LABEL_CLUSTER_ID: "spark-a", LABEL_ARTIFACT: "cap-0"}),
                         identity)


def test_without_a_workload_only_the_same_artifact_without_a_cluster_id() -> None:
    artifact = make_artifact("cap-1")
    identity = previous_identity(None, artifact)
    assert identity == [f"{LABEL_ARTIFACT}=cap-1"]
    assert same_workload(_container(**{LABEL_ARTIFACT: "cap-1"}), identity)
    # The restored capsule's blanked workload labels are no workload either.
    assert same_workload(_container(**{LABEL_ARTIFACT: "cap-1", LABEL_CLUSTER_ID: ""}), identity)
    # A named workload restored from the same artifact is someone else's.
    assert not same_workload(_container(**{LABEL_ARTIFACT: "cap-1",
                                           LABEL_CLUSTER_ID: "spark-b"}), identity)
