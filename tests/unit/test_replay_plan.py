"""The replay plan is a strict format: what capture writes, restore reads back the same, and a
damaged plan is refused naming the field."""

from __future__ import annotations

import json

import pytest

from coldsnap.formats.canonical import canonical_json
from coldsnap.formats.errors import ArtifactInvalid
from coldsnap.formats.replay import ReplayPlan, parse_replay_plan

DIGEST = "sha256:" + "ab" * 32
PLAN = {
    "unit_id": "unit-0", "engine": "vllm",
    "worker": {"id": "worker-0", "global_rank": 0, "world_size": 2, "process_slot": 0,
               "device_slots": [0]},
    "image": f"r/x@{DIGEST}", "image_digest": DIGEST, "command": ["vllm", "serve", "m"],
    "environment": {"NCCL_SOCKET_IFNAME": "ens0"},
    "mounts": [{"source": "/srv/models", "target": "/models", "read_only": True}],
    "model_dir": "/models",
    "payload": {"sha256": DIGEST, "bytes": 10, "container_path": "/models/shard.bin"},
    "validation": {"prompt": "p", "expected": "e", "health_path": "/health"},
}


def test_round_trip_is_canonical() -> None:
    data = canonical_json(ReplayPlan.model_validate(PLAN).model_dump(mode="json"))
    plan = parse_replay_plan(data)
    assert plan.format == "coldsnap-replay-plan/1"
    assert plan.payload.container_path == "/models/shard.bin"
    assert canonical_json(plan.model_dump(mode="json")) == data


@pytest.mark.parametrize(("change", "path"), [
    (lambda p: p["payload"].update(container_path="models/x"), "payload.container_path"),
    (lambda p: p["worker"].update(global_rank=-1), "worker.global_rank"),
    (lambda p: p.update(engine="tgi"), "engine"),
    (lambda p: p.update(extra=1), "extra"),
    (lambda p: p.update(format="coldsnap-replay-plan/9"), "format"),
])
def test_a_damaged_plan_names_the_field(change, path) -> None:  # type: ignore[no-untyped-def]
    raw = json.loads(json.dumps(PLAN))
    change(raw)
    with pytest.raises(ArtifactInvalid) as err:
        parse_replay_plan(json.dumps(raw).encode())
    assert any(i.path == path for i in err.value.issues), err.value.issues
