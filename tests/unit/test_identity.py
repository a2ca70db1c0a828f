"""Restore identity: what must match the capture and what placement may change."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from coldsnap.formats.request import Launch, parse_request
from coldsnap.identity import (
    PLACEMENT,
    compare_restore_identity,
    is_transport_variable,
    normalize_command,
)
from tests.unit.conftest import load_example

Raw = dict[str, Any]


def launch_of(raw: Raw) -> Launch:
    return parse_request(raw).launch


def compare(change: Callable[[Raw], object], *, pins: bool = True,
            example: str = "tp4-two-2gpu-hosts") -> list[str]:
    captured = load_example(example)
    restored = copy.deepcopy(captured)
    change(restored)
    issues = compare_restore_identity(launch_of(captured), launch_of(restored),
                                      capsule_pins_image=pins)
    return [i.path for i in issues]


def unit(raw: Raw, i: int = 0) -> Raw:
    u: Raw = raw["launch"]["units"][i]
    return u


def ex(raw: Raw) -> Raw:
    e: Raw = raw["launch"]["execution"]
    return e


def test_identical_launch_matches() -> None:
    assert compare(lambda r: None) == []


def move_everything(raw: Raw) -> None:
    for i, u in enumerate(raw["launch"]["units"]):
        u["host"] = f"spark-{i}"
        u["devices"] = [f"GPU-{i}-{k}" for k in range(len(u["devices"]))]
        u["mounts"] = [dict(m, source="/mnt/other" + m["target"]) for m in reversed(u["mounts"])]
        env = u["environment"]
        env["NCCL_SOCKET_IFNAME"] = "ib0"
        env["NCCL_IB_HCA"] = "mlx5_1"
        env["UCX_TLS"] = "rc"
        env["OMPI_MCA_btl"] = "tcp"
        env["VLLM_HOST_IP"] = "192.168.7.1"
        env.pop("GLOO_SOCKET_IFNAME", None)
        env["MN_IF_NAME"] = "eth1"
        env["NODE_IP"] = "192.168.7.1"
        env["TP_SOCKET_IFNAME"] = "eth1"
        cmd = u["command"]
        for flag in ("--master-addr", "--master-port", "--port"):
            if flag in cmd:
                cmd[cmd.index(flag) + 1] = "1234"


def rename_unit(raw: Raw) -> None:
    unit(raw)["id"] = "unit-x"
    for w in ex(raw)["workers"]:
        if w["unit"] == "unit-0":
            w["unit"] = "unit-x"


def test_placement_may_change() -> None:
    assert compare(move_everything) == []


def test_image_may_change_only_when_the_capsule_pins_it() -> None:
    def new_image(raw: Raw) -> None:
        d = "sha256:" + "ee" * 32
        unit(raw).update(image=f"mirror.local/vllm@{d}", image_digest=d)

    assert compare(new_image, pins=True) == []
    assert compare(new_image, pins=False) == ["launch.units[0].image",
                                              "launch.units[0].image_digest"]


@pytest.mark.parametrize(("change", "path"), [
    (lambda r: r["launch"].update(engine="sglang"), "launch.engine"),
    (lambda r: r["launch"]["model"].update(revision="other"), "launch.model.revision"),
    (lambda r: r["launch"]["model"].update(id="other/model"), "launch.model.id"),
    (lambda r: r["launch"]["model"].update(source="s3"), "launch.model.source"),
    (rename_unit, "launch.units[0].id"),
    (lambda r: unit(r)["devices"].append("2"), "launch.units[0].devices"),
    (lambda r: unit(r)["environment"].update(MASTER_ADDR="10.9.9.9"),
     "launch.units[0].environment.MASTER_ADDR"),
    (lambda r: unit(r)["environment"].update(MASTER_PORT="1"),
     "launch.units[0].environment.MASTER_PORT"),
    (lambda r: unit(r)["environment"].pop("HF_HUB_OFFLINE"),
     "launch.units[0].environment.HF_HUB_OFFLINE"),
    (lambda r: unit(r)["environment"].update(VLLM_USE_V1="0"),
     "launch.units[0].environment.VLLM_USE_V1"),
    (lambda r: unit(r)["command"].__setitem__(2, "other/model"), "launch.units[0].command[2]"),
    (lambda r: unit(r)["command"].append("--enable-prefix-caching"), "launch.units[0].command"),
    (lambda r: unit(r)["command"].__setitem__(4, "8"), "launch.units[0].command[4]"),
    (lambda r: unit(r)["command"].__setitem__(6, "3"), "launch.units[0].command[6]"),
    (lambda r: unit(r)["mounts"][0].update(read_only=False),
     "launch.units[0].mounts[0].read_only"),
    (lambda r: unit(r)["mounts"][0].update(target="/models"), "launch.units[0].mounts[0].target"),
    (lambda r: ex(r)["adapter"].update(schema="vllm:topology-v2"),
     "launch.execution.adapter.schema"),
    (lambda r: ex(r)["workers"][1].update(process_slot=3),
     "launch.execution.workers[1].process_slot"),
    (lambda r: ex(r)["groups"][0]["members"].reverse(), "launch.execution.groups[0].members"),
    (lambda r: ex(r)["groups"].reverse(), "launch.execution.groups[0].id"),
    (lambda r: ex(r)["services"][0].update(role="vllm:other"),
     "launch.execution.services[0].role"),
])
def test_identity_differences_are_named(change: Callable[[Raw], object], path: str) -> None:
    assert path in compare(change)


def test_adapter_digest_and_worker_shape_changes() -> None:
    def new_payload(raw: Raw) -> None:
        from coldsnap.formats.canonical import digest
        payload = {"dimensions": {"tensor": 4}, "runtime": "vllm-v2"}
        ex(raw)["adapter"].update(payload=payload, digest=digest(payload))

    assert compare(new_payload) == ["launch.execution.adapter.digest"]

    def drop_unit(raw: Raw) -> None:
        raw["launch"]["units"] = raw["launch"]["units"][:1]
        ex(raw)["workers"] = ex(raw)["workers"][:2]
        for g in ex(raw)["groups"]:
            g["members"] = g["members"][:2]
        ex(raw)["services"][0]["workers"] = ex(raw)["services"][0]["workers"][:2]

    paths = compare(drop_unit)
    assert "launch.units" in paths
    assert "launch.execution.workers" in paths
    assert "launch.execution.groups[0].members" in paths


def test_missing_mount_target_is_named() -> None:
    assert compare(lambda r: unit(r).update(mounts=[])) == ["launch.units[0].mounts"]


def test_placement_flag_spelling_must_not_change() -> None:
    def to_equals(raw: Raw) -> None:
        cmd = unit(raw)["command"]
        i = cmd.index("--port")
        cmd[i:i + 2] = [f"--port={cmd[i + 1]}"]

    assert compare(to_equals) == ["launch.units[0].command"]


def test_normalize_command_forms() -> None:
    assert normalize_command(["vllm", "--port", "8000", "--master-addr=10.0.0.1"]) == [
        "vllm", "--port", PLACEMENT, f"--master-addr={PLACEMENT}"]
    assert normalize_command(["bash", "-c", "serve --dist-init-addr 10.0.0.1:5000 --tp 2"]) == [
        "bash", "-c", f"serve --dist-init-addr {PLACEMENT} --tp 2"]
    assert normalize_command(["--master-address", "a", "--master-port=1"]) == [
        "--master-address", PLACEMENT, f"--master-port={PLACEMENT}"]
    # Lookalike flags are engine settings, not placement.
    assert normalize_command(["--portal", "1", "--port-range=5", "--ports", "2"]) == [
        "--portal", "1", "--port-range=5", "--ports", "2"]
    assert normalize_command(["x", "--port"]) == ["x", "--port"]


def test_shell_string_placement_values_may_change() -> None:
    captured = normalize_command(["sh", "-c", "vllm serve m --port 8000 --master-port=1"])
    restored = normalize_command(["sh", "-c", "vllm serve m --port 9000 --master-port=2"])
    assert captured == restored
    assert normalize_command(["sh", "-c", "vllm serve m --port=8000"]) != captured


def test_transport_variables() -> None:
    for name in ("GLOO_SOCKET_IFNAME", "MN_IF_NAME", "NODE_IP", "TP_SOCKET_IFNAME",
                 "UCX_NET_DEVICES", "VLLM_HOST_IP", "NCCL_IB_HCA", "OMPI_MCA_pml", "UCX_TLS"):
        assert is_transport_variable(name), name
    for name in ("MASTER_ADDR", "MASTER_PORT", "NCCL", "VLLM_PORT", "HF_HOME", "XNCCL_A"):
        assert not is_transport_variable(name), name
