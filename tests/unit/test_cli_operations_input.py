"""Bad input to `capture` and `restore` is refused before any host is contacted: exit 2,
the offending field named, no traceback, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from coldsnap.cli import main
from tests.unit.artifact_factory import EXAMPLES


def _inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"hosts": [
        {"name": "host-0", "address": "127.0.0.254", "data_dir": "/var/lib/coldsnap"}]}))
    return path


def test_capture_refuses_an_invalid_request_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load((EXAMPLES / "tp2-two-hosts.yaml").read_text())
    doc["launch"]["execution"]["workers"][1]["device_slots"] = [3]
    doc["output"] = str(tmp_path / "artifact.json")
    request = tmp_path / "req.yaml"
    request.write_text(yaml.safe_dump(doc))
    status = main(["capture", "--request", str(request), "--inventory",
                   str(_inventory(tmp_path)), "--store", str(tmp_path / "store")])
    err = capsys.readouterr().err
    assert status == 2
    assert "launch.execution.workers[1].device_slots[0]" in err
    assert "Traceback" not in err
    assert not (tmp_path / "artifact.json").exists()
    assert not (tmp_path / "store").exists()


def test_capture_refuses_a_restore_request(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load((EXAMPLES / "tp2-two-hosts.yaml").read_text())
    doc["operation"] = "restore"
    doc.pop("output", None)
    request = tmp_path / "req.yaml"
    request.write_text(yaml.safe_dump(doc))
    assert main(["capture", "--request", str(request)]) == 2
    assert "operation" in capsys.readouterr().err


def test_bad_inventory_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": [{"name": "host-0", "address": "x",
                                                    "data_dir": "relative/dir"}]}))
    status = main(["capture", "--request", str(EXAMPLES / "tp2-two-hosts.yaml"),
                   "--inventory", str(inventory), "--store", str(tmp_path / "s")])
    assert status == 2
    assert "data_dir" in capsys.readouterr().err


def test_restore_needs_an_artifact_that_exists(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["restore", "--artifact", "nope", "--inventory", str(_inventory(tmp_path)),
                   "--store", str(tmp_path / "store")])
    assert status == 2
    assert "no artifact 'nope'" in capsys.readouterr().err


def test_receipt_and_events_cannot_both_take_stdout(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["restore", "--artifact", "x", "--receipt-json", "-",
                   "--timing-events", "-"])
    assert status == 2
    assert "cannot both be '-'" in capsys.readouterr().err
