"""Fuzzing the real command line with hostile input: requests given to `validate`, and artifact
files given to `restore`, through `coldsnap.cli.main` in this process.

Each case is a valid document put through random structural mutations (replaced, reused,
deleted, added and duplicated values), wrong types, huge strings and unicode (lone surrogates
included, which JSON can carry and UTF-8 cannot encode). Whatever comes in: no traceback, exit
0 or 2, and every refusal names where the problem is. A restore refused on its artifact never
reaches the hosts.

The number of cases comes from the hypothesis profile `fuzz` (tests/conftest.py): 10,000
each by default, as CI runs them; COLDSNAP_FUZZ_CASES=300 for a quick local run."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from coldsnap import cli
from coldsnap.commands import operation as operation_command
from coldsnap.formats.canonical import canonical_json
from coldsnap.store import LocalStore
from tests.unit.conftest import make_artifact
from tests.unit.test_properties import EXAMPLES, at, mutate_once

FUZZ = settings.get_profile("fuzz")

unicode_text = st.text(alphabet=st.characters(exclude_categories=()), max_size=40)  # surrogates too
huge_text = st.integers(1, 200_000).map(lambda n: "\u00e9x/.." * (n // 5 + 1))
wrong_types = st.sampled_from([None, True, 0, -1, 2**64, 1.5, float("inf"), "", [], {},
                               [None], {"": None}])


def pick_path(doc: Any, data: st.DataObject) -> tuple[str | int, ...]:
    """A path into `doc` by a random walk from the root: cheap on a large document, where
    listing every path for each mutation would be most of the fuzzer's time."""
    path: tuple[str | int, ...] = ()
    node = doc
    while True:
        keys: list[str | int] = (list(node) if isinstance(node, dict)
                                 else list(range(len(node))) if isinstance(node, list) else [])
        if not keys or (path and data.draw(st.integers(0, 3)) == 0):
            return path
        key = data.draw(st.sampled_from(keys))
        path, node = (*path, key), node[key]


def hostile(doc: dict[str, Any], data: st.DataObject, *, structural: bool = True) -> None:
    """One mutation: the structural ones of test_properties, or a hostile value."""
    kind = data.draw(st.sampled_from(["structural", "wrong-type", "huge", "unicode",
                                      "unicode-key", "nest"]))
    if kind == "structural" and structural:
        mutate_once(doc, data)
        return
    if kind == "structural":
        kind = data.draw(st.sampled_from(["delete", "duplicate", "reuse"]))
    path = pick_path(doc, data)
    if not path:
        return
    parent: Any = at(doc, path[:-1])
    last: Any = path[-1]
    if kind == "delete":
        del parent[last]
    elif kind == "duplicate" and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[last]))
    elif kind == "reuse":  # a value from elsewhere: crossed references, duplicate ids
        parent[last] = copy.deepcopy(at(doc, pick_path(doc, data)))
    elif kind == "wrong-type":
        parent[last] = copy.deepcopy(data.draw(wrong_types))  # never shared between cases
    elif kind == "huge":
        parent[last] = data.draw(huge_text)
    elif kind == "unicode":
        parent[last] = data.draw(unicode_text)
    elif kind == "unicode-key" and isinstance(parent, dict):
        parent[data.draw(unicode_text)] = parent.pop(last)
    elif kind == "nest":
        wrapped = parent[last]
        parent[last] = [wrapped] if data.draw(st.booleans()) else {"x": wrapped}


def encode(doc: Any, data: st.DataObject, *, yaml_too: bool = True) -> tuple[bytes, str]:
    """The document as a file's bytes and its suffix: JSON (ASCII-escaped or not) or, one
    case in four, YAML. Not YAML for large documents: the pure-Python YAML parser spends
    seconds on a huge string, which only slows the fuzzer down without reaching other code."""
    form = data.draw(st.sampled_from(["json-ascii", "json-utf8", "json-utf8", "yaml"]))
    if not yaml_too:
        form = "json-utf8" if form == "yaml" else form
    if form == "yaml" and len(json.dumps(doc)) > 16_000:
        form = "json-utf8"
    if form == "yaml":
        try:
            return yaml.safe_dump(doc, allow_unicode=True).encode("utf-8"), ".yaml"
        except (yaml.YAMLError, UnicodeEncodeError):
            form = "json-ascii"  # a lone surrogate: only escaped JSON can carry it
    ascii_only = form == "json-ascii"
    text = json.dumps(doc, ensure_ascii=ascii_only, allow_nan=True)
    return text.encode("utf-8", errors="surrogatepass"), ".json"


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    # Not pytest's tmp_path: one directory serves every case of a test.
    with tempfile.TemporaryDirectory(prefix="coldsnap-fuzz-") as d:
        yield Path(d)


# The parser is the same for every case; building it again each time would be most of the
# fuzzer's time. main() itself runs unchanged.
_PARSER = functools.cache(cli.build_parser)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """`coldsnapd ARGV` in this process: exit status, stdout, stderr. Any exception out of
    main is a traceback a user would have seen: the test fails with it."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "build_parser", _PARSER)
        try:
            status = cli.main(argv)
        except SystemExit as exc:  # argparse's own refusals
            status = int(exc.code or 0)
    return status, out.getvalue(), err.getvalue()


WORK = tempfile.mkdtemp(prefix="coldsnap-fuzz-")


@FUZZ
@given(name=st.sampled_from(sorted(EXAMPLES)), rounds=st.integers(1, 4), data=st.data())
def test_requests_are_refused_with_exit_2_naming_a_path(name: str, rounds: int,
                                                        data: st.DataObject) -> None:
    doc = copy.deepcopy(EXAMPLES[name])
    for _ in range(rounds):
        hostile(doc, data)
    blob, suffix = encode(doc, data)
    path = Path(WORK) / f"request{suffix}"
    path.write_bytes(blob)
    status, out, err = run_cli(["validate", "--request-json", str(path), "--json"])
    assert "Traceback" not in err
    answer = json.loads(out)
    if status == 0:
        assert answer["valid"] is True and answer["request_sha256"].startswith("sha256:")
        return
    assert status == 2, err
    assert answer["valid"] is False and answer["errors"], out
    for issue in answer["errors"]:
        # A path (or the whole document, named as such), and what is wrong there.
        assert isinstance(issue["path"], str) and issue["message"], issue
    assert any(issue["path"] for issue in answer["errors"]) or len(answer["errors"]) == 1, out


def _valid_artifact_doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(canonical_json(make_artifact("fuzz-1").to_json()))
    return doc


ARTIFACT = _valid_artifact_doc()
INVENTORY = """\
hosts:
  - {name: host-0, address: 198.18.0.250, data_dir: /srv/coldsnap, simulated: true}
  - {name: host-1, address: 198.18.0.251, data_dir: /srv/coldsnap, simulated: true}
"""


@pytest.fixture(scope="module")
def restore_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An inventory and an empty store; `run_here` is replaced by a tripwire, so the
    fuzzer sees whether a restore got past its input checks to the hosts."""
    where = tmp_path_factory.mktemp("restore-fuzz")
    (where / "inventory.yaml").write_text(INVENTORY)
    LocalStore(where / "store").ensure()
    yield where


@FUZZ
@given(rounds=st.integers(0, 4), data=st.data())
def test_artifact_files_given_to_restore_are_refused_with_exit_2(
        restore_env: Path, rounds: int, data: st.DataObject) -> None:
    doc = copy.deepcopy(ARTIFACT)
    for _ in range(rounds):
        # Structural mutations list every path of the document first: too slow on an
        # artifact; the walk reaches the same places.
        hostile(doc, data, structural=False)
    blob, _ = encode(doc, data, yaml_too=False)  # an artifact file is JSON
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(blob)))
        blob = blob[:cut]  # truncated, as a copy cut off mid-way
    path = restore_env / "artifact.json"
    path.write_bytes(blob)
    reached: list[str] = []

    def tripwire(*args: Any, **kwargs: Any) -> int:
        reached.append("hosts")
        return 0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(operation_command, "run_here", tripwire)
        status, out, err = run_cli([
            "restore", "--local", "--artifact", str(path),
            "--inventory", str(restore_env / "inventory.yaml"),
            "--store", str(restore_env / "store"), "--receipt-json", str(restore_env / "r.json")])
    assert "Traceback" not in err
    # The store holds none of the artifact's objects: no artifact file can be restored.
    assert status == 2, err
    assert reached == [], "a refused artifact reached the hosts"
    assert out == ""
    assert err.startswith(f"coldsnapd: --artifact {path}: ") and len(err.splitlines()) >= 1, err
