"""Shared helpers for the format, topology and CLI tests: example requests and a builder."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.formats.canonical import digest
from coldsnap.formats.errors import RequestInvalid, ValidationIssue
from coldsnap.formats.request import parse_request

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "configs" / "examples"
EXAMPLE_NAMES = (
    "tp2-two-hosts",
    "tp4-two-2gpu-hosts",
    "tp8-one-host",
    "tp4-dp2",
    "tp4-pp2",
    "tp4-ep2",
    "sglang-prefill-decode",
)
IMAGE_DIGEST = "sha256:" + "ab" * 32


def example_path(name: str) -> Path:
    return EXAMPLES / f"{name}.yaml"


def load_example(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(example_path(name).read_text())
    return data


def minimal_request(operation: str = "capture") -> dict[str, Any]:
    """TP2 over two 1-GPU hosts, nothing optional: the smallest realistic valid request.
    (`output` and `artifact` are required: a capture says where its artifact goes, a restore
    which artifact it restores.)"""
    payload = {"dimensions": {"tensor": 2}, "runtime": "vllm-direct"}
    units = []
    for i in range(2):
        units.append({
            "id": f"u{i}",
            "index": i,
            "host": f"host-{i}",
            "devices": ["0"],
            "image": f"vllm/vllm-openai@{IMAGE_DIGEST}",
            "image_digest": IMAGE_DIGEST,
            "command": ["vllm", "serve", "m", "--tensor-parallel-size", "2",
                        "--master-addr", "10.0.0.1", "--port", "8000"],
            "environment": {"NCCL_SOCKET_IFNAME": "eth0", "MASTER_PORT": "29500"},
            "mounts": [{"source": "/srv/models", "target": "/models", "read_only": True}],
        })
    where = {"output": "/var/lib/coldsnap/artifacts/req-1.json"} if operation == "capture" \
        else {"artifact": "req-0"}
    return {
        "operation": operation,
        "id": "req-1",
        **where,
        "snapshot_driver": {"id": "n610"},
        "launch": {
            "engine": "vllm",
            "model": {"id": "org/model", "revision": "abc123"},
            "units": units,
            "execution": {
                "workers": [
                    {"id": "w0", "unit": "u0", "service": "svc", "process_slot": 0,
                     "device_slots": [0]},
                    {"id": "w1", "unit": "u1", "service": "svc", "process_slot": 0,
                     "device_slots": [0]},
                ],
                "groups": [
                    {"id": "world", "kind": "vllm:world", "service": "svc",
                     "members": ["w0", "w1"]},
                    {"id": "tp", "kind": "vllm:tensor", "service": "svc",
                     "members": ["w0", "w1"]},
                ],
                "services": [{"id": "svc", "role": "vllm:engine", "workers": ["w0", "w1"]}],
                "adapter": {"schema": "vllm:topology-v1", "digest": digest(payload),
                            "payload": payload},
            },
        },
    }


def issues_for(raw: dict[str, Any], **kwargs: Any) -> list[ValidationIssue]:
    try:
        parse_request(raw, **kwargs)
    except RequestInvalid as exc:
        return exc.issues
    return []


def paths_for(raw: dict[str, Any], **kwargs: Any) -> list[str]:
    return [i.path for i in issues_for(raw, **kwargs)]


@pytest.fixture
def request_dict() -> dict[str, Any]:
    return copy.deepcopy(minimal_request())


@pytest.fixture
def mutate() -> Callable[[Callable[[dict[str, Any]], object]], dict[str, Any]]:
    def apply(change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
        raw = copy.deepcopy(minimal_request())
        change(raw)
        return raw

    return apply


# Real registries for the publish tests (session-scoped: started once).
from tests.unit.registry_fixtures import auth_registry, plain_registry  # noqa: E402, F401
