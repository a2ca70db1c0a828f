"""Canonical JSON and digests, plus the documents coldsnapd writes (artifact, receipt, timing)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from pydantic import ValidationError

from coldsnap.formats.artifact import (
    Artifact,
    parse_artifact,
    payload_path,
    replay_plan_path,
)
from coldsnap.formats.canonical import canonical_json, digest, digest_bytes, is_digest
from coldsnap.formats.errors import ArtifactInvalid
from coldsnap.formats.owners import Owner
from coldsnap.formats.receipt import Receipt, parse_rfc3339_ns, replay_semantics_for, rfc3339_ns
from coldsnap.formats.request import parse_request
from coldsnap.formats.timing import (
    Timing,
    TimingEvent,
    TimingRecorder,
    check_event_stream,
)
from tests.unit.conftest import load_example

ADAPTER_VECTOR = {
    "dimensions": {"context": 1, "data": 1, "expert": 1, "pipeline": 1, "tensor": 1},
    "runtime": "vllm-direct",
}


def test_adapter_vector_from_formats_md() -> None:
    assert digest(ADAPTER_VECTOR) == (
        "sha256:236933adde8b8b19c2ad3b79d2797964764ac4f7aaf767d4d2431784588a1613"
    )
    assert canonical_json(ADAPTER_VECTOR) == (
        b'{"dimensions":{"context":1,"data":1,"expert":1,"pipeline":1,"tensor":1},'
        b'"runtime":"vllm-direct"}'
    )


def test_astral_characters_become_surrogate_pairs() -> None:
    assert canonical_json({"s": "\U0001f600"}) == b'{"s":"\\ud83d\\ude00"}'
    assert canonical_json("\U00010348") == b'"\\ud800\\udf48"'


def test_non_ascii_bmp_and_controls_are_escaped() -> None:
    assert canonical_json("é\u2028\n") == b'"\\u00e9\\u2028\\n"'


def test_negative_zero_survives() -> None:
    assert canonical_json(-0.0) == b"-0.0"
    assert canonical_json(0.0) == b"0.0"
    assert digest(-0.0) != digest(0.0)


def test_floats_shortest_round_trip() -> None:
    assert canonical_json(1e16) == b"1e+16"
    assert canonical_json(0.1) == b"0.1"
    assert canonical_json(1e-7) == b"1e-07"
    assert canonical_json(123456789.125) == b"123456789.125"


def test_large_integers_are_exact() -> None:
    big = 2**53 + 1
    assert canonical_json(big) == b"9007199254740993"
    assert canonical_json(-(10**30)) == b"-1000000000000000000000000000000"
    assert json.loads(canonical_json({"n": big}))["n"] == big


def test_keys_sorted_by_code_point_at_every_level() -> None:
    doc = {"b": 1, "a": {"z": [3, {"y": 1, "x": 2}], "B": True}, "\u00e9": None}
    assert canonical_json(doc) == (
        b'{"a":{"B":true,"z":[3,{"x":2,"y":1}]},"b":1,"\\u00e9":null}'
    )


def test_non_finite_numbers_are_refused() -> None:
    with pytest.raises(ValueError):
        canonical_json(float("nan"))
    with pytest.raises(ValueError):
        canonical_json({"x": float("inf")})


def test_digest_format() -> None:
    value = digest({"a": 1})
    assert value == "sha256:" + hashlib.sha256(b'{"a":1}').hexdigest()
    assert is_digest(value)
    assert not is_digest(value.upper())
    assert not is_digest(value[:-1])
    assert digest_bytes(b"") == (
        "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )


def test_request_digest_is_over_canonical_form_with_defaults() -> None:
    req = parse_request(load_example("tp4-ep2"))
    assert req.request_sha256 == digest(req.canonical())
    canonical = req.canonical()
    assert canonical["policy"]["process"]["graph_policy"] == "preserve-nccl-exec"
    assert canonical["validation"]["health_path"] == "/health"
    assert "workload" not in canonical  # absent means omitted, never null


def test_null_inside_adapter_payload_is_kept_in_canonical_form() -> None:
    raw = load_example("tp8-one-host")
    payload = {"dimensions": {"tensor": 8}, "note": None}
    raw["launch"]["execution"]["adapter"].update(payload=payload, digest=digest(payload))
    req = parse_request(raw)
    assert req.canonical()["launch"]["execution"]["adapter"]["payload"] == payload


# --- artifact, receipt, timing ---------------------------------------------------------------


def _artifact_doc() -> dict[str, Any]:
    req = parse_request(load_example("tp4-two-2gpu-hosts"))
    launch = req.canonical()["launch"]
    units = [u["id"] for u in launch["units"]]
    workers = [w["id"] for w in launch["execution"]["workers"]]
    pack = "sha256:" + "11" * 32
    objects = [
        {"role": "oci-capsule", "owner": f"unit/{u}", "path": f"capsules/{u}.oci", "bytes": 10,
         "sha256": "sha256:" + "22" * 32} for u in units
    ] + [
        {"role": "model-weight-payload", "owner": f"worker/{w}", "path": payload_path(pack),
         "bytes": 5, "sha256": pack} for w in workers
    ]
    return {
        "format": 9,
        "kind": "coldsnap-snapshot-artifact",
        "state": "committed",
        "capture_id": req.id,
        "request_sha256": req.request_sha256,
        "snapshot_driver": {"id": "n610", "minimum_driver_major": 610},
        "launch": launch,
        "requires": ["criu", "cuda-checkpoint"],
        "compatibility": {"policy": "placement-independent-v1", "units": [
            {"unit": u, "architecture": "aarch64", "kernel": "6.11.0-1016-nvidia",
             "nvidia_driver_captured": "610.43.02", "nvidia_driver_min": 610,
             "cuda_userspace": "13.0", "devices": [
                 {"slot": s, "gpu_name": "NVIDIA GB10", "compute_capability": "12.1"}
                 for s in range(2)]}
            for u in units]},
        "capsule": {"images": [
            {"unit": u, "reference": f"coldsnap/capsule/{u}:cap-1",
             "digest": "sha256:" + "33" * 32} for u in units]},
        "objects": objects,
        "weights": {"recovery": {"replay_plan": [
            {"worker": w, "plan": replay_plan_path(w), "payload": payload_path(pack)}
            for w in workers]}},
    }


def test_artifact_round_trips_canonically() -> None:
    doc = _artifact_doc()
    artifact = parse_artifact(doc)
    assert artifact.to_json() == doc
    assert digest(artifact.to_json()) == digest(doc)
    assert payload_path("sha256:" + "11" * 32) == f"model-payloads/sha256/{'11' * 32}.pack"
    assert [o.path for o in artifact.objects_owned_by(Owner("worker", "worker-0"))] == [
        payload_path("sha256:" + "11" * 32)
    ]


def test_artifact_refuses_unknown_fields_and_owners() -> None:
    doc = _artifact_doc()
    doc["objects"][0]["owner"] = "unit/nope"  # unit-0's capsule: now it has none
    with pytest.raises(ArtifactInvalid) as info:
        parse_artifact(doc)
    assert [i.path for i in info.value.issues] == ["objects[0].owner", "objects"]
    doc = _artifact_doc()
    doc["extra"] = 1
    with pytest.raises(ArtifactInvalid) as info:
        parse_artifact(doc)
    assert [i.path for i in info.value.issues] == ["extra"]


def test_artifact_needs_one_capsule_per_unit() -> None:
    doc = _artifact_doc()
    doc["capsule"]["images"].pop()
    with pytest.raises(ArtifactInvalid) as info:
        parse_artifact(doc)
    assert [i.path for i in info.value.issues] == ["capsule.images"]
    # Its capsule object too: an artifact whose `objects` lost one cannot be restored.
    doc = _artifact_doc()
    doc["objects"] = [o for o in doc["objects"] if o["role"] != "oci-capsule"]
    with pytest.raises(ArtifactInvalid) as info:
        parse_artifact(doc)
    assert [(i.path, i.message) for i in info.value.issues] == [
        ("objects", f"must hold exactly one oci-capsule object owned by unit/{u} (its capsule "
                    "is not pushed to a registry), not 0")
        for u in ("unit-0", "unit-1")]
    # A capsule pushed to a registry is pulled by digest, so it has no object; one that names
    # an object anyway is refused too.
    for image in doc["capsule"]["images"]:
        image["reference"] = f"198.18.0.1:5000/coldsnap/capsule/{image['unit']}@{image['digest']}"
    parse_artifact(doc)
    doc["objects"] = _artifact_doc()["objects"]
    with pytest.raises(ArtifactInvalid) as info:
        parse_artifact(doc)
    assert {i.message for i in info.value.issues} == {
        f"must hold no oci-capsule object owned by unit/{u} (its capsule is pushed to a "
        "registry), not 1" for u in ("unit-0", "unit-1")}


def test_artifact_snapshot_driver_minimum_must_match_driver() -> None:
    doc = _artifact_doc()
    doc["snapshot_driver"]["minimum_driver_major"] = 580
    with pytest.raises(ValidationError):
        Artifact.model_validate(doc)


def _timing() -> tuple[Timing, list[TimingEvent]]:
    events: list[TimingEvent] = []
    ticks = iter(range(0, 10**12, 250_000_000))
    recorder = TimingRecorder("op-1", "capture", sink=events.append,
                              wall_ns=lambda: 1_700_000_000_000_000_000,
                              monotonic_ns=lambda: next(ticks))
    with recorder.span("capture") as root, recorder.span("dump", parent=root):
        pass
    with pytest.raises(RuntimeError), recorder.span("upload"):
        raise RuntimeError("boom")
    return recorder.complete("failed"), events


def test_timing_recorder_builds_a_tree_and_a_contiguous_stream() -> None:
    timing, events = _timing()
    assert [s.name for s in timing.spans] == ["dump", "capture", "upload"]
    assert timing.spans[0].parent == timing.spans[1].id
    assert timing.spans[2].status == "error"
    assert timing.spans[1].duration_seconds == pytest.approx(0.75)
    assert check_event_stream(events) == []
    assert events[0].event == "stream_start"
    assert events[-1].event == "stream_complete"
    assert events[-1].timing_sha256 == digest(timing.to_json())
    line = events[-1].to_ndjson()
    assert line.endswith(b"\n")
    assert TimingEvent.model_validate(json.loads(line)) == events[-1]


def test_event_stream_gaps_are_reported() -> None:
    _, events = _timing()
    del events[2]
    assert next(i.path for i in check_event_stream(events)) == "[2].sequence"


def test_timing_refuses_cycles_and_unknown_clocks() -> None:
    clock = {"id": "c", "source": "controller-monotonic", "origin_unix_ns": 1}
    span = {"name": "x", "clock": "c", "start_offset_seconds": 0.0, "duration_seconds": 1.0,
            "status": "ok"}
    with pytest.raises(ValidationError, match="cycle"):
        Timing.model_validate({"clocks": [clock], "spans": [
            {**span, "id": "a", "parent": "b"}, {**span, "id": "b", "parent": "a"}]})
    with pytest.raises(ValidationError, match="unknown clock"):
        Timing.model_validate({"clocks": [], "spans": [{**span, "id": "a"}]})


def test_timing_event_fields_must_match_event() -> None:
    with pytest.raises(ValidationError, match="missing timing_sha256"):
        TimingEvent.model_validate({"sequence": 3, "event": "stream_complete",
                                    "state": "succeeded"})


def test_receipt_timestamps_and_error_consistency() -> None:
    timing, _ = _timing()
    base = {
        "operation_id": "op-1", "operation": "capture", "state": "failed",
        "request_sha256": "sha256:" + "44" * 32, "engine": "vllm",
        "snapshot_driver": {"id": "n580", "minimum_driver_major": 580},
        "replay_semantics": replay_semantics_for("capture"),
        "started_at": rfc3339_ns(1_795_000_000_000_000_001),
        "completed_at": rfc3339_ns(1_795_000_002_500_000_000),
        "duration_seconds": 2.5, "timing": timing.to_json(),
        "error": {"code": "capture-failed", "message": "dump failed on host-1"},
    }
    receipt = Receipt.model_validate(base)
    assert receipt.started_at == "2026-11-18T11:06:40.000000001Z"
    assert parse_rfc3339_ns(receipt.started_at) == 1_795_000_000_000_000_001
    assert receipt.to_json()["kind"] == "coldsnap-operation-receipt"
    with pytest.raises(ValidationError, match="failed receipt carries error"):
        Receipt.model_validate({**base, "state": "succeeded"})
    with pytest.raises(ValidationError):
        Receipt.model_validate({**base, "started_at": "2026-11-18T11:06:40Z"})
    assert replay_semantics_for("restore") == "reconcile-replace"
    assert replay_semantics_for("restore", prepare_only=True) == "safe-repeat"
