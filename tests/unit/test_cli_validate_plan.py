"""`coldsnapd validate` and `coldsnapd plan`, through the real CLI entry point."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.cli import main
from coldsnap.formats.request import load_request
from tests.unit.conftest import REPO, example_path, minimal_request


def write(tmp_path: Path, doc: dict[str, Any], name: str = "req.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def broken(tmp_path: Path) -> Path:
    raw = minimal_request()
    raw["launch"]["units"][0]["image"] = "vllm/vllm-openai:latest"
    raw["launch"]["execution"]["workers"][1]["device_slots"] = [4]
    raw["launch"]["execution"]["groups"][0]["members"] = ["w0", "w0", "w1"]
    return write(tmp_path, raw)


BROKEN_PATHS = [
    "launch.units[0].image",
    "launch.execution.workers[1].device_slots[0]",
    "launch.execution.groups[0].members[1]",
]


def test_validate_valid_prints_the_digest(capsys: pytest.CaptureFixture[str]) -> None:
    path = example_path("tp2-two-hosts")
    assert main(["validate", "--request", str(path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == load_request(path).request_sha256


def test_validate_valid_json(capsys: pytest.CaptureFixture[str]) -> None:
    path = example_path("sglang-prefill-decode")
    assert main(["validate", "--request", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"valid": True, "request_sha256": load_request(path).request_sha256}


def test_validate_invalid_reports_every_error(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--request", str(broken(tmp_path))]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    for path in BROKEN_PATHS:
        assert any(line.startswith(f"{path}: ") for line in lines), (path, lines)
    assert "Traceback" not in captured.err


def test_validate_invalid_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--request", str(broken(tmp_path)), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["valid"] is False
    assert sorted(e["path"] for e in doc["errors"]) == sorted(BROKEN_PATHS)
    assert all(set(e) == {"path", "message"} and e["message"] for e in doc["errors"])


@pytest.mark.parametrize("content", [None, b"launch: [\n", b"\xff\xfe\x00", b"- 1\n"])
def test_unusable_files_exit_2_without_traceback(tmp_path: Path, content: bytes | None,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "req.yaml"
    if content is not None:
        path.write_bytes(content)
    for command in ("validate", "plan"):
        assert main([command, "--request", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{path}: ")
        assert "Traceback" not in err


def test_plan_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    path = example_path("tp4-two-2gpu-hosts")
    assert main(["plan", "--request", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"request_sha256", "operation", "workers", "hosts"}
    assert doc["request_sha256"] == load_request(path).request_sha256
    assert doc["operation"] == "capture"
    assert doc["workers"][3] == {"id": "worker-3", "unit": "unit-1", "host": "host-1",
                                 "service": "engine", "global_rank": 3, "process_slot": 1,
                                 "device_slots": [1], "devices": ["1"]}
    assert list(doc["hosts"]) == ["host-0", "host-1"]
    host0 = doc["hosts"]["host-0"]
    assert host0["units"] == ["unit-0"]
    assert host0["workers"] == ["worker-0", "worker-1"]
    assert host0["objects"] == [
        {"owner": "unit/unit-0", "role": "oci-capsule"},
        {"owner": "unit/unit-0", "role": "criu-image"},
        {"owner": "worker/worker-0", "role": "model-weight-payload"},
        {"owner": "worker/worker-0", "role": "replay-plan"},
        {"owner": "worker/worker-1", "role": "model-weight-payload"},
        {"owner": "worker/worker-1", "role": "replay-plan"},
    ]


def test_plan_text_is_a_table_per_host(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--request", str(example_path("tp4-dp2"))]) == 0
    out = capsys.readouterr().out
    assert "host host-0" in out and "host host-1" in out
    assert out.index("host host-0") < out.index("r0-worker-3") < out.index("host host-1")
    assert re.search(r"^ +unit/unit-1 +oci-capsule$", out, re.MULTILINE)
    assert re.search(r"^ +unit/unit-1 +criu-image$", out, re.MULTILINE)
    assert "r1-worker-2" in out.split("host host-1")[1]
    assert "r1-worker-2" not in out.split("host host-1")[0]


def test_plan_invalid_json_lists_errors(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--request", str(broken(tmp_path)), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert sorted(e["path"] for e in doc["errors"]) == sorted(BROKEN_PATHS)


def test_help_explains_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "validate" in out and "plan" in out
    for command in ("validate", "plan"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert "--request-json PATH|-" in out and "--request PATH|-" in out
        assert "--json" in out
        assert "PATH: message" in out


def test_missing_request_argument_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["validate"])
    assert info.value.code == 2
    assert "--request" in capsys.readouterr().err


def test_python_dash_m_coldsnap(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    ok = subprocess.run([sys.executable, "-m", "coldsnap", "validate", "--request",
                         str(example_path("tp8-one-host")), "--json"],
                        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["valid"] is True
    bad = subprocess.run([sys.executable, "-m", "coldsnap", "validate", "--request",
                          str(broken(tmp_path))],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert bad.returncode == 2
    assert "launch.units[0].image: " in bad.stderr
