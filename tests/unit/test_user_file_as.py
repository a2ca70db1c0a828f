"""An artifact path a non-root submitter names is read with its access (issue 35, finding 10):
a file it may not read is refused in the same words as a file that does not exist."""

from __future__ import annotations

import os
import pwd
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap.formats.request import parse_request
from coldsnap.runner.operation_kinds import OPERATIONS
from coldsnap.runner.prepared import Refused, RunOptions
from coldsnap.store import LocalStore
from coldsnap.store.user_file import UserFileMissing
from coldsnap.store.user_file_as import read_user_file_as
from tests.unit.conftest import minimal_request

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switches to another uid: root only")
NOBODY = pwd.getpwnam("nobody").pw_uid if os.geteuid() == 0 else 65534


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every uid may search (pytest's own is root's only)."""
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        Path(tmp).chmod(0o755)
        yield Path(tmp)


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    readable = tmp_path / "open.json"
    readable.write_text('{"a": 1}')
    readable.chmod(0o644)
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "x"}')
    secret.chmod(0o600)
    return readable, secret


def test_a_file_the_uid_cannot_read_reads_as_one_that_does_not_exist(shared: Path) -> None:
    tmp_path = shared
    readable, secret = _tree(tmp_path)
    blob, real = read_user_file_as(str(readable), NOBODY, what="artifact file", limit=100)
    assert blob == b'{"a": 1}' and real == str(readable)
    answers = []
    for path in (secret, tmp_path / "absent.json", tmp_path):
        with pytest.raises(UserFileMissing) as refused:
            read_user_file_as(str(path), NOBODY, what="artifact file", limit=100)
        answers.append(str(refused.value).replace(str(path), "PATH"))
    assert len(set(answers)) == 1, answers
    assert f"cannot be read by uid {NOBODY}" in answers[0]


def test_a_restore_of_an_unreadable_artifact_file_names_no_existence(shared: Path) -> None:
    tmp_path = shared
    _, secret = _tree(tmp_path)
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("hosts:\n- {name: host-0, address: 127.0.0.1, port: 1,"
                         " data_dir: /var/lib/coldsnap}\n")
    store = LocalStore(tmp_path / "store").ensure()
    messages = []
    for path in (secret, tmp_path / "absent.json"):
        options = RunOptions(inventory=inventory, store=store.root, uid=NOBODY,
                             artifact=str(path))
        with pytest.raises(Refused) as refused:
            OPERATIONS["restore"].prepare(options, None)
        messages.append(str(refused.value).replace(str(path), "PATH"))
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("--artifact PATH: artifact file PATH cannot be read by uid")


def test_a_lifecycle_requests_artifact_file_is_read_as_its_submitter(shared: Path) -> None:
    _, secret = _tree(shared)
    inventory = shared / "inventory.yaml"
    inventory.write_text("hosts:\n- {name: host-0, address: 127.0.0.1, port: 1,"
                         " data_dir: /var/lib/coldsnap}\n")
    store = LocalStore(shared / "store").ensure()
    request = parse_request({**minimal_request("restore"), "operation": "status",
                             "id": "status-1", "artifact": str(secret),
                             "workload": {"cluster_id": "c", "intent_id": "i-1", "recipe": "r",
                                          "runtime": "vllm", "model": "org/model"}})
    options = RunOptions(inventory=inventory, store=store.root, uid=NOBODY)
    with pytest.raises(Refused, match=rf"artifact file {secret} cannot be read by uid "
                                      rf"{NOBODY} \(it does not exist"):
        OPERATIONS["status"].prepare(options, request)
