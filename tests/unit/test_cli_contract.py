"""The client contract of `capture` and `restore` that needs no host: requests on stdin,
required fields, receipts and their ids, timing-event outputs, and retries under a used id.

Every run here either is refused before anything runs, is answered from the store's record,
or fails on the control node before any host is contacted (the inventory's hosts do not
exist)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.cli import main
from coldsnap.formats.receipt import Receipt, ReceiptResult
from coldsnap.formats.request import Request, parse_request
from coldsnap.formats.timing import TimingEvent, check_event_stream
from coldsnap.operations.context import OperationContext, OperationFailed
from coldsnap.runner.ledger import Ledger
from coldsnap.store import LocalStore
from tests.unit.conftest import make_artifact, minimal_request
from tests.unit.test_artifact_refs import with_objects, write_output


@pytest.fixture
def stdin(monkeypatch: pytest.MonkeyPatch) -> Any:
    def feed(data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else data
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(raw)))
    return feed


def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"hosts": [
        {"name": f"host-{i}", "address": "127.0.0.254", "data_dir": "/var/lib/coldsnap"}
        for i in range(2)]}))
    return path


def capture_doc(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    doc = minimal_request()
    (tmp_path / "out").mkdir(exist_ok=True)  # the CLI checks that output's directory exists
    doc["output"] = str(tmp_path / "out" / "artifact.json")
    doc.update(changes)
    return doc


def run(tmp_path: Path, *argv: str) -> int:
    return main([*argv, "--inventory", str(inventory(tmp_path)),
                 "--store", str(tmp_path / "store")])


def receipt_of(request: Request, state: str = "succeeded") -> Receipt:
    ctx = OperationContext("capture", operation_id=request.id)
    error = OperationFailed("dump-failed", "unit u1: dump failed") if state == "failed" else None
    return ctx.finish(request_sha256=request.request_sha256, engine="vllm",
                      snapshot_driver="n610", error=error,
                      result=ReceiptResult(artifact=request.id, output=request.output))


def record(tmp_path: Path, request: Request, state: str = "succeeded") -> Receipt | None:
    records = Ledger(tmp_path / "store")
    assert records.reserve(request.id, request.operation, request.request_sha256) is None
    if state in ("queued", "running"):  # a claim is queued; its run, once started, running
        if state == "running":
            records.update(request.id, state="running")
        return None
    receipt = receipt_of(request, state)
    records.complete(receipt)
    return receipt


# -- request input ----------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["json", "yaml"])
def test_validate_and_plan_read_the_request_from_stdin(
        stdin: Any, capsys: pytest.CaptureFixture[str], encoding: str) -> None:
    doc = minimal_request()
    text = json.dumps(doc) if encoding == "json" else yaml.safe_dump(doc)
    stdin(text)
    assert main(["validate", "--request-json", "-"]) == 0
    assert capsys.readouterr().out.strip() == parse_request(doc).request_sha256
    stdin(text)
    assert main(["plan", "--request", "-", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["operation"] == "capture"


def test_a_bad_request_on_stdin_names_the_field(stdin: Any,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    doc = minimal_request()
    doc["launch"]["execution"]["workers"][1]["device_slots"] = [3]
    stdin(json.dumps(doc))
    assert main(["validate", "--request-json", "-"]) == 2
    err = capsys.readouterr().err
    assert "launch.execution.workers[1].device_slots[0]" in err
    assert "<stdin>: invalid (1 problem)" in err


def test_stdin_over_16_mib_is_refused_without_reading_it_all(
        stdin: Any, capsys: pytest.CaptureFixture[str]) -> None:
    stdin(b"#" * (16 * 1024 * 1024 + 1))
    assert main(["validate", "--request-json", "-"]) == 2
    assert "<stdin>: the request on stdin is larger than 16 MiB" in capsys.readouterr().err


def test_capture_reads_stdin_and_requires_output(tmp_path: Path, stdin: Any,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    doc = capture_doc(tmp_path)
    del doc["output"]
    stdin(json.dumps(doc))
    assert run(tmp_path, "capture", "--request-json", "-") == 2
    assert "output: is required for capture" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()


def test_restore_request_requires_artifact(tmp_path: Path, stdin: Any,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    doc = minimal_request("restore")
    del doc["artifact"]
    stdin(yaml.safe_dump(doc))
    assert run(tmp_path, "restore", "--request-json", "-", "--artifact", "cap-a") == 2
    assert "artifact: is required for restore" in capsys.readouterr().err


# -- timing events ----------------------------------------------------------------------------


@pytest.mark.parametrize(("events", "receipt", "message"), [
    ("/tmp/../tmp/e.ndjson", "r.json", "must be '-' or an absolute, clean path"),
    ("-", None, "needs --receipt-json"),
    ("-", "-", "cannot both be '-'"),
])
def test_timing_event_targets_are_checked_first(tmp_path: Path, stdin: Any, events: str,
                                                receipt: str | None, message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    stdin(json.dumps(capture_doc(tmp_path)))
    argv = ["capture", "--request-json", "-", "--timing-events", events]
    if receipt is not None:
        argv += ["--receipt-json", receipt]
    assert run(tmp_path, *argv) == 2
    assert message in capsys.readouterr().err


def test_receipt_and_events_may_not_share_a_file(tmp_path: Path, stdin: Any,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "link").symlink_to(tmp_path)
    stdin(json.dumps(capture_doc(tmp_path)))
    assert run(tmp_path, "capture", "--request-json", "-", "--receipt-json",
               str(tmp_path / "link" / "x.json"), "--timing-events",
               str(tmp_path / "x.json")) == 2
    assert "name the same file" in capsys.readouterr().err


def test_an_existing_events_file_is_refused_and_kept(tmp_path: Path, stdin: Any,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    events = tmp_path / "events.ndjson"
    events.write_text("someone else's stream\n")
    request = parse_request(capture_doc(tmp_path))
    stdin(json.dumps(capture_doc(tmp_path)))
    assert run(tmp_path, "capture", "--request-json", "-", "--receipt-json",
               str(tmp_path / "r.json"), "--timing-events", str(events)) == 2
    assert "already exists; it is never truncated" in capsys.readouterr().err
    assert events.read_text() == "someone else's stream\n"
    # Refused before the id was claimed: the request may run once the path is fixed.
    assert Ledger(tmp_path / "store").load(request.id) is None


# -- receipts and used ids ---------------------------------------------------------------------


def test_a_receipt_of_another_request_is_never_replaced(
        tmp_path: Path, stdin: Any, capsys: pytest.CaptureFixture[str]) -> None:
    other = parse_request(capture_doc(tmp_path, id="other-1"))
    target = tmp_path / "receipt.json"
    target.write_text(json.dumps(receipt_of(other).to_json()))
    before = target.read_bytes()
    stdin(json.dumps(capture_doc(tmp_path)))
    assert run(tmp_path, "capture", "--request-json", "-", "--receipt-json", str(target)) == 2
    err = capsys.readouterr().err
    assert "holds the receipt of another request" in err and "operation_id other-1" in err
    assert target.read_bytes() == before
    target.write_text("notes\n")
    stdin(json.dumps(capture_doc(tmp_path)))
    assert run(tmp_path, "capture", "--request-json", "-", "--receipt-json", str(target)) == 2
    assert "is not a readable receipt" in capsys.readouterr().err
    assert target.read_text() == "notes\n"


def test_a_retry_of_a_succeeded_request_prints_its_receipt_and_runs_nothing(
        tmp_path: Path, stdin: Any, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    doc = capture_doc(tmp_path)
    request = parse_request(doc)
    receipt = record(tmp_path, request)
    assert receipt is not None
    # The first run's events file is still there: a retry is recognized before it matters.
    events = tmp_path / "events.ndjson"
    events.write_text("first run\n")
    stdin(json.dumps(doc))
    assert run(tmp_path, "capture", "--request-json", "-", "--receipt-json", "-",
               "--timing-events", str(tmp_path / "events-2.ndjson")) == 0
    out, err = capsysbinary.readouterr()
    assert Receipt.model_validate(json.loads(out)) == receipt
    assert json.loads(out)["operation_id"] == request.id
    assert b"already succeeded" in err and b"nothing was run" in err
    assert not (tmp_path / "events-2.ndjson").exists()
    # To a file: written when absent, left as it is when it already holds that receipt.
    target = tmp_path / "receipt.json"
    for _ in range(2):
        stdin(json.dumps(doc))
        assert run(tmp_path, "capture", "--request-json", "-", "--receipt-json",
                   str(target), "--timing-events", str(events)) == 0
        assert Receipt.model_validate_json(target.read_text()) == receipt
    mtime = target.stat().st_mtime_ns
    stdin(json.dumps(doc))
    assert run(tmp_path, "capture", "--request-json", "-", "--receipt-json", str(target)) == 0
    assert target.stat().st_mtime_ns == mtime
    assert events.read_text() == "first run\n"


@pytest.mark.parametrize(("state", "changes", "needle"), [
    ("succeeded", {"validation": {"prompt": "other"}}, "for another request"),
    ("failed", {}, "capture req-1 failed at"),
    ("queued", {}, "has been queued since"),
    ("running", {}, "has been running since"),
])
def test_a_used_id_is_refused(tmp_path: Path, stdin: Any, state: str, changes: dict[str, Any],
                              needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    record(tmp_path, parse_request(capture_doc(tmp_path)), state)
    stdin(json.dumps(capture_doc(tmp_path, **changes)))
    assert run(tmp_path, "capture", "--request-json", "-", "--receipt-json", "-") == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "operation id req-1 is already used" in err and needle in err
    assert "every operation needs a fresh id" in err


def test_a_succeeded_receipt_file_of_the_same_request_is_an_answer_too(
        tmp_path: Path, stdin: Any, capsys: pytest.CaptureFixture[str]) -> None:
    doc = capture_doc(tmp_path)
    target = tmp_path / "receipt.json"
    target.write_text(json.dumps(receipt_of(parse_request(doc)).to_json()))
    before = target.read_bytes()
    stdin(json.dumps(doc))
    assert run(tmp_path, "capture", "--request-json", "-", "--receipt-json", str(target)) == 0
    assert target.read_bytes() == before
    assert Ledger(tmp_path / "store").load("req-1") is None


# -- restore: artifact references and operation ids --------------------------------------------


def stored_with_corrupt_object(tmp_path: Path) -> tuple[LocalStore, Path]:
    """An indexed artifact with an output file, one object of which has rotted (same size):
    references resolve, and the restore fails when it re-hashes objects, before any host."""
    store = LocalStore(tmp_path / "store").ensure()
    stored = store.put_artifact(with_objects(store, "cap-a"))
    output = write_output(tmp_path / "cap-a.json", stored.artifact)
    victim = store.object_path(stored.artifact.objects[0].sha256)
    victim.write_bytes(bytes(b ^ 1 for b in victim.read_bytes()))
    return store, output


def failed_receipt(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    assert doc["state"] == "failed"
    return doc


def test_restore_without_request_gets_a_generated_id_and_says_so(tmp_path: Path) -> None:
    stored_with_corrupt_object(tmp_path)
    receipt = tmp_path / "receipt.json"
    assert run(tmp_path, "restore", "--artifact", "cap-a", "--receipt-json", str(receipt)) == 1
    doc = failed_receipt(receipt)
    assert doc["operation_id"].startswith("restore-")
    assert doc["result"] == {"operation_id_generated": True}
    assert doc["error"]["code"] == "object-corrupt"
    # Its id is recorded like any other, and a second run is a new operation.
    records = Ledger(tmp_path / "store")
    held = records.load(doc["operation_id"])
    assert held is not None and held.state == "failed"


def test_restore_request_id_is_the_operation_id(tmp_path: Path, stdin: Any) -> None:
    _, output = stored_with_corrupt_object(tmp_path)
    current = tmp_path / "current.json"
    current.symlink_to(output)
    doc = minimal_request("restore")
    doc.update(id="restore-7", artifact=str(current),
               launch=make_artifact("cap-a").launch.to_json())
    receipt = tmp_path / "receipt.json"
    stdin(json.dumps(doc))
    assert run(tmp_path, "restore", "--request-json", "-", "--artifact", "cap-a",
               "--receipt-json", str(receipt)) == 1
    got = failed_receipt(receipt)
    assert got["operation_id"] == "restore-7"
    assert got["request_sha256"] == parse_request(doc).request_sha256
    assert "operation_id_generated" not in got.get("result", {})


def test_artifact_flag_and_request_must_name_one_artifact(
        tmp_path: Path, stdin: Any, capsys: pytest.CaptureFixture[str]) -> None:
    store, output = stored_with_corrupt_object(tmp_path)
    other = store.put_artifact(make_artifact("cap-b"))
    doc = minimal_request("restore")
    doc["artifact"] = str(output)
    stdin(json.dumps(doc))
    assert run(tmp_path, "restore", "--request-json", "-", "--artifact", "cap-b") == 2
    err = capsys.readouterr().err
    assert "--artifact cap-b (capture cap-b" in err and other.digest in err
    assert f"the request's artifact {output} (capture cap-a" in err
    assert "both must name the same artifact" in err


def test_a_tampered_artifact_file_is_bad_input(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _, output = stored_with_corrupt_object(tmp_path)
    doc = json.loads(output.read_text())
    doc["launch"]["model"]["revision"] = "other"
    output.write_text(json.dumps(doc))
    assert run(tmp_path, "restore", "--artifact", str(output)) == 2
    assert "changed after capture" in capsys.readouterr().err


def test_prepare_only_claims_no_id_but_respects_another_request(
        tmp_path: Path, stdin: Any, capsys: pytest.CaptureFixture[str]) -> None:
    stored_with_corrupt_object(tmp_path)
    doc = minimal_request("restore")
    doc.update(artifact="cap-a", launch=make_artifact("cap-a").launch.to_json())
    for _ in range(2):  # safe to repeat: each run runs (and fails on the rotten object)
        stdin(json.dumps(doc))
        assert run(tmp_path, "restore", "--request-json", "-", "--prepare-only") == 1
    held = Ledger(tmp_path / "store").load("req-1")
    assert held is None or held.prepare_only  # its run is recorded, no id is claimed
    record(tmp_path, parse_request(capture_doc(tmp_path)))
    stdin(json.dumps(doc))
    assert run(tmp_path, "restore", "--request-json", "-", "--prepare-only") == 2
    assert "already used" in capsys.readouterr().err


def test_events_on_stdout_are_the_only_thing_there(
        tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    stored_with_corrupt_object(tmp_path)
    receipt = tmp_path / "receipt.json"
    assert run(tmp_path, "restore", "--artifact", "cap-a", "--timing-events", "-",
               "--receipt-json", str(receipt)) == 1
    out, _ = capsysbinary.readouterr()
    events = [TimingEvent.model_validate(json.loads(line)) for line in out.splitlines()]
    assert check_event_stream(events) == []
    assert events[-1].state == "failed"
    assert events[-1].timing_sha256 == Receipt.model_validate_json(
        receipt.read_text()).timing.sha256()
