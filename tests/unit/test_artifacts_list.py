"""`coldsnapd artifacts list` with a bad index file among good ones: the good ones are listed,
the bad one is named, and the exit status says the store needs a look."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coldsnap.cli import main
from coldsnap.store import LocalStore
from tests.unit.conftest import make_artifact


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'{"capture_id": "x"}', b"\xff\xfe"])
def test_one_bad_index_file_does_not_hide_the_others(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes) -> None:
    store = LocalStore(tmp_path / "store").ensure()
    store.put_artifact(make_artifact("good-1"))
    store.put_artifact(make_artifact("good-2"))
    bad = store.artifacts_dir / "broken.json"
    bad.write_bytes(content)

    assert main(["artifacts", "list", "--store", str(store.root), "--json"]) == 1
    out, err = capsys.readouterr()
    assert [row["capture_id"] for row in json.loads(out)] == ["good-1", "good-2"]
    assert f"coldsnapd: unreadable artifact index file {bad}: " in err
    assert "Traceback" not in err

    assert main(["artifacts", "list", "--store", str(store.root)]) == 1
    out, err = capsys.readouterr()
    assert "good-1" in out and "good-2" in out and str(bad) in err

    bad.unlink()
    assert main(["artifacts", "list", "--store", str(store.root)]) == 0
