"""Bad input to `capture` and `restore` is refused before any host is contacted: exit 2,
the offending field named, no traceback, nothing written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from coldsnap.cli import main
from devtools.as_user import python_for_others
from tests.unit.conftest import EXAMPLES


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
    doc = yaml.safe_load((EXAMPLES / "tp2-two-hosts.yaml").read_text())
    doc["output"] = str(tmp_path / "artifact.json")
    request = tmp_path / "req.yaml"
    request.write_text(yaml.safe_dump(doc))
    status = main(["capture", "--request", str(request),
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


def _capture_with(tmp_path: Path, output: str, *flags: str) -> list[str]:
    doc = yaml.safe_load((EXAMPLES / "tp2-two-hosts.yaml").read_text())
    doc["output"] = output
    request = tmp_path / "req.yaml"
    request.write_text(yaml.safe_dump(doc))
    return ["capture", "--request", str(request), "--inventory", str(_inventory(tmp_path)),
            "--store", str(tmp_path / "store"), *flags]


@pytest.mark.parametrize(("output", "flags", "said"), [
    ("/srv/../etc/artifact.json", (), "output: must be an absolute, clean path"),
    # Relative: the user's, from their working directory (the test's is {tmp}).
    ("missing/artifact.json", (),
     "output {tmp}/missing/artifact.json: its directory {tmp}/missing does not exist"),
    ("./artifact.json", ("--receipt-json", "gone/receipt.json"),
     "--receipt-json {tmp}/gone/receipt.json: its directory {tmp}/gone does not exist"),
    ("{tmp}/artifact.json", ("--receipt-json", "{tmp}/../r.json"),
     "--receipt-json '{tmp}/../r.json' must be '-' or an absolute, clean path"),
    ("{tmp}/missing/artifact.json", (),
     "output {tmp}/missing/artifact.json: its directory {tmp}/missing does not exist"),
    ("{tmp}/artifact.json", ("--receipt-json", "{tmp}/missing/r.json"),
     "--receipt-json {tmp}/missing/r.json: its directory {tmp}/missing does not exist"),
    ("{tmp}/artifact.json", ("--receipt-json", "-", "--timing-events", "{tmp}/gone/t.ndjson"),
     "--timing-events {tmp}/gone/t.ndjson: its directory {tmp}/gone does not exist"),
])
def test_output_paths_are_checked_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        output: str, flags: tuple[str, ...], said: str) -> None:
    monkeypatch.chdir(tmp_path)
    tmp = str(tmp_path)
    argv = _capture_with(tmp_path, output.format(tmp=tmp), *(f.format(tmp=tmp) for f in flags))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said.format(tmp=tmp) in err, err
    assert not (tmp_path / "store").exists()


def test_an_existing_output_is_refused_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "artifact.json"
    taken.write_text("mine\n")
    assert main(_capture_with(tmp_path, str(taken))) == 2
    assert f"output {taken} already exists" in capsys.readouterr().err
    assert taken.read_text() == "mine\n"
    assert not (tmp_path / "store" / "operations").exists() or \
        not any((tmp_path / "store" / "operations").glob("*.json"))


def test_a_relative_output_is_the_users_path_from_their_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolved by the CLI against its working directory: an existing file there is refused
    by its absolute name, and `validate` takes the request as it is."""
    (tmp_path / "artifacts").mkdir()
    taken = tmp_path / "artifacts" / "tp2.json"
    taken.write_text("mine\n")
    monkeypatch.chdir(tmp_path)
    assert main(_capture_with(tmp_path, "./artifacts/tp2.json")) == 2
    assert f"output {taken} already exists" in capsys.readouterr().err
    assert taken.read_text() == "mine\n"
    assert main(["validate", "--request", str(tmp_path / "req.yaml")]) == 0


def test_a_directory_the_user_cannot_write_is_refused(tmp_path: Path) -> None:
    """As an unprivileged user (root may write anywhere): a directory of root's, 0755."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the command as another user")
    closed = Path("/var/tmp") / f"coldsnap-closed-{os.getpid()}"
    closed.mkdir(mode=0o755)
    try:
        doc = yaml.safe_load((EXAMPLES / "tp2-two-hosts.yaml").read_text())
        doc["output"] = str(closed / "artifact.json")
        python, env = python_for_others()
        proc = subprocess.run([*python, "capture", "--request", "-"], input=yaml.safe_dump(doc),
                              capture_output=True, text=True, timeout=120, user="nobody",
                              group="nogroup", env=env, check=False, cwd="/")
    finally:
        closed.rmdir()
    assert proc.returncode == 2, proc.stderr
    assert f"output {closed}/artifact.json: its directory {closed} is not writable by this " \
        "user" in proc.stderr


def test_the_artifact_is_written_whole_and_never_over_a_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from coldsnap.commands.outputs import write_output

    target = tmp_path / "artifact.json"
    assert write_output({"format": 9, "capture_id": "cap-1"}, str(target), "cap-1")
    assert yaml.safe_load(target.read_text()) == {"format": 9, "capture_id": "cap-1"}
    assert not write_output({"format": 9, "capture_id": "cap-2"}, str(target), "cap-2")
    err = capsys.readouterr().err
    assert f"cannot write output {target}" in err and "artifacts show --json cap-2" in err
    assert yaml.safe_load(target.read_text())["capture_id"] == "cap-1"
    assert [p.name for p in tmp_path.iterdir()] == ["artifact.json"]  # no temporary file left
