"""Admission of a destination host against an artifact's compatibility entry."""

from __future__ import annotations

from typing import Any

import pytest

from coldsnap.admission import (
    GpuFact,
    HostFacts,
    check_admission,
    normalize_arch,
    parse_driver_version,
)
from coldsnap.formats.artifact import CompatibilityUnit

GB10 = ("NVIDIA GB10", "12.1")


def compat(**overrides: Any) -> CompatibilityUnit:
    doc: dict[str, Any] = {
        "unit": "unit-0", "architecture": "aarch64", "kernel": "6.11.0-1016-nvidia",
        "nvidia_driver_captured": "610.43.02", "nvidia_driver_min": 610,
        "cuda_userspace": "13.0",
        "devices": [{"slot": 0, "gpu_name": GB10[0], "compute_capability": GB10[1]},
                    {"slot": 1, "gpu_name": GB10[0], "compute_capability": GB10[1]}],
    }
    doc.update(overrides)
    return CompatibilityUnit.model_validate(doc)


def facts(**overrides: Any) -> HostFacts:
    base: dict[str, Any] = {
        "arch": "aarch64", "kernel": "6.11.0-1016-nvidia", "driver_version": "610.43.02",
        "gpus": [GpuFact("GPU-aaaa", *GB10), GpuFact("GPU-bbbb", *GB10)],
    }
    base.update(overrides)
    return HostFacts(**base)


def paths(host: HostFacts, unit: CompatibilityUnit | None = None, **kwargs: Any) -> list[str]:
    kwargs.setdefault("devices", ["0", "1"])
    kwargs.setdefault("snapshot_driver_min", 610)
    result = check_admission(unit or compat(), host, **kwargs)
    return [i.path for i in result.refusals]


def test_matching_host_is_admitted_pending_the_criu_probe() -> None:
    result = check_admission(compat(), facts(), devices=["0", "1"], snapshot_driver_min=610)
    assert result.admitted
    assert result.refusals == []
    assert result.criu_probe_required


def test_exact_kernel_policy_compares_uname_and_needs_no_probe() -> None:
    result = check_admission(compat(), facts(), devices=["0", "1"], snapshot_driver_min=610,
                             kernel_policy="exact")
    assert result.admitted and not result.criu_probe_required
    assert paths(facts(kernel="6.11.0-1017-nvidia"), kernel_policy="exact") == [
        "compatibility.units[0].kernel"]
    # Under `capability` the captured kernel is provenance only.
    assert paths(facts(kernel="6.11.0-1017-nvidia")) == []


def test_architecture_must_match_under_any_spelling() -> None:
    assert paths(facts(arch="arm64")) == []
    assert paths(facts(arch="x86_64")) == ["compatibility.units[0].architecture"]
    assert normalize_arch("AMD64") == "x86_64"


@pytest.mark.parametrize(("driver", "min_major", "expected"), [
    ("580.95.05", 610, ["nvidia_driver_min", "nvidia_driver_captured"]),
    ("610.43.01", 610, ["nvidia_driver_captured"]),
    ("610.43.02", 610, []),
    ("611.0", 610, []),
    ("610.43.02", 620, ["nvidia_driver_min"]),
    ("banana", 610, ["nvidia_driver_min"]),
])
def test_driver_floors(driver: str, min_major: int, expected: list[str]) -> None:
    got = paths(facts(driver_version=driver), snapshot_driver_min=min_major)
    assert got == [f"compatibility.units[0].{p}" for p in expected]


def test_n580_artifact_on_a_580_driver() -> None:
    unit = compat(nvidia_driver_captured="580.95.05", nvidia_driver_min=580)
    assert paths(facts(driver_version="580.95.05"), unit, snapshot_driver_min=580) == []
    assert paths(facts(driver_version="575.1"), unit, snapshot_driver_min=580) == [
        "compatibility.units[0].nvidia_driver_min",
        "compatibility.units[0].nvidia_driver_captured"]


def test_captured_floor_can_be_relaxed_but_not_the_minimum() -> None:
    host = facts(driver_version="610.10.01")
    assert paths(host) == ["compatibility.units[0].nvidia_driver_captured"]
    assert paths(host, enforce_captured_driver_floor=False) == []
    assert paths(facts(driver_version="590.1"), enforce_captured_driver_floor=False) == [
        "compatibility.units[0].nvidia_driver_min"]


def test_gpu_model_and_compute_capability_per_slot() -> None:
    host = facts(gpus=[GpuFact("GPU-aaaa", *GB10), GpuFact("GPU-cccc", "NVIDIA H100", "9.0")])
    assert paths(host) == ["compatibility.units[0].devices[1].gpu_name",
                           "compatibility.units[0].devices[1].compute_capability"]
    # The same host admits the unit when its selectors avoid the odd GPU.
    host = facts(gpus=[GpuFact("GPU-cccc", "NVIDIA H100", "9.0"), GpuFact("GPU-aaaa", *GB10),
                       GpuFact("GPU-bbbb", *GB10)])
    assert paths(host, devices=["GPU-bbbb", "2"]) == []


def test_device_count_and_unknown_selectors() -> None:
    assert paths(facts(), devices=["0"]) == ["compatibility.units[0].devices"]
    assert paths(facts(), devices=["0", "GPU-zzzz"]) == ["compatibility.units[0].devices[1]"]
    assert paths(facts(gpus=[]), devices=["0", "1"]) == ["compatibility.units[0].devices[0]",
                                                         "compatibility.units[0].devices[1]"]


def test_refusal_paths_follow_base() -> None:
    result = check_admission(compat(), facts(arch="x86_64"), devices=["0", "1"],
                             snapshot_driver_min=610, base="compatibility.units[3]")
    assert [str(i) for i in result.refusals] == [
        "compatibility.units[3].architecture: destination is x86_64, the capture is aarch64"]


def test_parse_driver_version() -> None:
    assert parse_driver_version("610.43.02") == (610, 43, 2)
    assert parse_driver_version("580") == (580,)
    assert parse_driver_version("580.95.05") < parse_driver_version("580.100.1")
    for bad in ("", "610.x", "v610"):
        with pytest.raises(ValueError):
            parse_driver_version(bad)
