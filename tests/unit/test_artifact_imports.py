"""What an import indexes (issue 35, finding 3): a published artifact only from a registry the
inventory names, and an artifact file's objects only as what they are (a payload indexed by
one artifact cannot be declared another's CRIU images; a capsule manifest must parse as its
unit's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coldsnap.formats.artifact import ROLE_CAPSULE_MANIFEST, ArtifactObject
from coldsnap.hosts.inventory import load_inventory
from coldsnap.operations.artifact_registry import import_reference
from coldsnap.runner.operation_kinds import OPERATIONS
from coldsnap.runner.prepared import Refused, RunOptions
from coldsnap.store import LocalStore
from coldsnap.store.refs import ArtifactRefInvalid, resolve_reference
from tests.unit.conftest import stored_artifact

INVENTORY = ("hosts:\n- {name: host-0, address: 127.0.0.1, port: 1, data_dir: /var/lib/coldsnap}"
             "\n- {name: host-1, address: 127.0.0.1, port: 1, data_dir: /var/lib/coldsnap}\n"
             "registries:\n  198.18.0.1:5000: {insecure: true}\n")
ELSEWHERE = "203.0.113.9:5000/team/engine@sha256:" + "ab" * 32


def test_a_reference_on_a_registry_the_inventory_does_not_name_is_refused(
        tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY)
    store = LocalStore(tmp_path / "store").ensure()
    # Refused before any connection: nothing listens there.
    with pytest.raises(ValueError, match=r"registry 203.0.113.9:5000 is not one of the "
                                         r"inventory's registries \(198.18.0.1:5000\)"):
        import_reference(store, ELSEWHERE, load_inventory(inventory))
    options = RunOptions(inventory=inventory, store=store.root, uid=1000, artifact=ELSEWHERE)
    with pytest.raises(Refused, match=rf"--artifact {ELSEWHERE}: .*registry 203.0.113.9:5000 "
                                      "is not one of the inventory's registries"):
        OPERATIONS["restore"].prepare(options, None)


def _file(tmp_path: Path, doc: dict[str, object]) -> Path:
    path = tmp_path / "planted.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_payload_declared_as_criu_images_is_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    victim = stored_artifact(store, "cap-a")
    payload = next(o for o in victim.artifact.objects if o.role == "model-weight-payload")
    doc = victim.artifact.to_json()
    doc["capture_id"] = "planted"
    doc["objects"] = [{**o, "sha256": payload.sha256, "bytes": payload.bytes}
                      if o["role"] == "oci-capsule" else o for o in doc["objects"]]
    with pytest.raises(ArtifactRefInvalid, match=r"objects\[0\] \(oci-capsule of unit/unit-0, "
                                                 r"sha256:.*\) is indexed in the store as "
                                                 r"model-weight-payload, not oci-capsule"):
        resolve_reference(store, str(_file(tmp_path, doc)))
    assert store.indexed("planted") is None


def test_a_capsule_manifest_that_is_not_its_units_is_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    victim = stored_artifact(store, "cap-a")
    doc = victim.artifact.to_json()
    doc["capture_id"] = "planted"
    weights = store.add_bytes(b"not a manifest at all")
    manifests = [o for o in victim.artifact.objects if o.role == ROLE_CAPSULE_MANIFEST]
    swapped = {manifests[0].sha256: manifests[1], manifests[1].sha256: manifests[0]}
    doc["objects"] = [{**o, "sha256": swapped[o["sha256"]].sha256,
                       "bytes": swapped[o["sha256"]].bytes}
                      if o["role"] == ROLE_CAPSULE_MANIFEST else o for o in doc["objects"]]
    with pytest.raises(ArtifactRefInvalid, match=r"capsule-manifest of unit/unit-0: it is the "
                                                 r"capsule manifest of unit unit-1"):
        resolve_reference(store, str(_file(tmp_path, doc)))
    junk = ArtifactObject(role=ROLE_CAPSULE_MANIFEST, owner="unit/unit-0",
                          path="capsules/unit-0.json", bytes=weights[1], sha256=weights[0])
    doc["objects"] = [junk.model_dump() if o["role"] == ROLE_CAPSULE_MANIFEST
                      and o["owner"] == "unit/unit-0" else o for o in victim.artifact.to_json()
                      ["objects"]]
    with pytest.raises(ArtifactRefInvalid, match="it is not a capsule-manifest"):
        resolve_reference(store, str(_file(tmp_path, doc)))
    assert store.indexed("planted") is None
