"""Mount targets under a rule (issue 35, finding 1): a request cannot mount a directory it
writes over the programs that coldsnapd runs with the capsule's capabilities."""

from __future__ import annotations

import copy
import io
import json
from typing import Any

import pytest

from coldsnap.cli import main
from coldsnap.formats.request import parse_request
from coldsnap.formats.request.mount_targets import target_refusal
from coldsnap.formats.service_policy import parse_service_policy, request_refusals
from tests.unit.conftest import minimal_request, paths_for


def _with_target(target: str) -> dict[str, Any]:
    raw = copy.deepcopy(minimal_request())
    raw["launch"]["units"][0]["mounts"].append({"source": "/srv/tools", "target": target})
    return raw


@pytest.mark.parametrize("target", [
    "/", "/usr", "/usr/local/sbin", "/usr/bin", "/bin", "/sbin/x", "/lib", "/lib64",
    "/lib/x86_64-linux-gnu", "/libx32", "/library", "/etc", "/etc/criu", "/root", "/root/.criu",
    "/root/.local", "/proc/sys", "/sys", "/dev/shm", "/var/lib/coldsnap",
    "/var/lib/coldsnap/images", "/var/log/coldsnap"])
def test_a_target_over_programs_or_coldsnapds_paths_is_refused_by_field(target: str) -> None:
    assert target_refusal(target) is not None
    assert "launch.units[0].mounts[1].target" in paths_for(_with_target(target))


@pytest.mark.parametrize("target", [
    "/models/extra", "/data/weights", "/root/.cache/huggingface", "/root/.cache", "/srv/cache",
    "/var/lib/engine", "/opt/models", "/usrx", "/rootfs"])
def test_ordinary_targets_and_the_huggingface_cache_stay_accepted(target: str) -> None:
    assert target_refusal(target) is None
    assert paths_for(_with_target(target)) == []


def test_validate_exits_2_naming_the_field(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    raw = _with_target("/usr/local/sbin")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(json.dumps(raw).encode())))
    assert main(["validate", "--request-json", "-"]) == 2
    err = capsys.readouterr().err
    assert "launch.units[0].mounts[1].target" in err and "'/usr'" in err


def test_the_policy_narrows_targets() -> None:
    request = parse_request(_with_target("/data/tools"))
    narrow = parse_service_policy({"images": {"allow": ["vllm/vllm-openai"]},
                                   "mounts": {"allow": ["/srv"], "targets": ["/models"]},
                                   "outputs": {"allow": ["/var/lib/coldsnap"]}})
    assert request_refusals(narrow, 1000, request) == [
        "launch.units[0].mounts[1].target: /data/tools is outside mounts.targets (/models)"]
    wide = parse_service_policy({"images": {"allow": ["vllm/vllm-openai"]},
                                 "mounts": {"allow": ["/srv"]},
                                 "outputs": {"allow": ["/var/lib/coldsnap"]}})
    assert request_refusals(wide, 1000, request) == []
