"""Property tests: mutated requests fail only as RequestInvalid; digests ignore encoding."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coldsnap.formats.canonical import canonical_json
from coldsnap.formats.errors import RequestInvalid
from coldsnap.formats.request import Request, parse_request
from coldsnap.identity import normalize_command
from coldsnap.topology import resolve
from tests.unit.conftest import EXAMPLE_NAMES, load_example, minimal_request

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

EXAMPLES: dict[str, dict[str, Any]] = {n: load_example(n) for n in EXAMPLE_NAMES}
EXAMPLES["minimal"] = minimal_request()
EXAMPLES["minimal-restore"] = minimal_request("restore")

json_scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats() | st.text(max_size=12)
    | st.sampled_from(["", "/", "-1", "w0", "unit-0", "worker-1", "vllm:world", "n580",
                       "sha256:" + "0" * 64, "/var/cache/coldsnap/runtime", "--enforce-eager"])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=6,
)

Path = tuple[str | int, ...]


def all_paths(node: Any, prefix: Path = ()) -> list[Path]:
    out: list[Path] = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out.extend(all_paths(value, (*prefix, key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out.extend(all_paths(value, (*prefix, i)))
    return out


def scalars(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in scalars(v)]
    if isinstance(node, list):
        return [s for v in node for s in scalars(v)]
    return [node]


def at(doc: Any, path: Path) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def mutate_once(doc: dict[str, Any], data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(all_paths(doc)))
    op = data.draw(st.sampled_from(["replace", "reuse", "delete", "add-key", "duplicate"]))
    if not path:
        if op in ("add-key", "delete"):
            doc[data.draw(st.text(max_size=6))] = data.draw(json_values)
        return
    parent: Any = at(doc, path[:-1])
    last: Any = path[-1]
    if op == "replace":
        parent[last] = data.draw(json_values)
    elif op == "reuse":
        # Values taken from elsewhere in the request make duplicate ids, wrong references and
        # crossed slots, which random values rarely reach.
        parent[last] = data.draw(st.sampled_from(scalars(doc)))
    elif op == "delete":
        del parent[last]
    elif op == "add-key":
        target = at(doc, path)
        if isinstance(target, dict):
            target[data.draw(st.text(max_size=6))] = data.draw(json_values)
    elif op == "duplicate" and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[last]))


@SETTINGS
@given(name=st.sampled_from(sorted(EXAMPLES)), rounds=st.integers(1, 4), data=st.data())
def test_mutations_only_ever_raise_request_invalid(name: str, rounds: int,
                                                   data: st.DataObject) -> None:
    doc = copy.deepcopy(EXAMPLES[name])
    for _ in range(rounds):
        mutate_once(doc, data)
    try:
        req = parse_request(doc)
    except RequestInvalid as exc:
        assert exc.issues
        assert all(isinstance(i.path, str) and i.message for i in exc.issues)
        return
    # Whatever validation accepts must resolve and hash without surprises.
    assert isinstance(req, Request)
    assert req.request_sha256.startswith("sha256:")
    topo = resolve(req)
    for host in topo.hosts:
        topo.objects_for_host(host)


@SETTINGS
@given(name=st.sampled_from(sorted(EXAMPLES)), rounds=st.integers(1, 3), data=st.data())
def test_mutated_yaml_text_only_raises_request_invalid(name: str, rounds: int,
                                                       data: st.DataObject) -> None:
    doc = copy.deepcopy(EXAMPLES[name])
    for _ in range(rounds):
        mutate_once(doc, data)
    try:
        text = yaml.safe_dump(doc)
    except yaml.YAMLError:
        return
    try:
        parse_request(text)
    except RequestInvalid as exc:
        assert exc.issues


@settings(max_examples=200, deadline=None)
@given(blob=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_arbitrary_bytes_only_raise_request_invalid(blob: bytes) -> None:
    try:
        parse_request(blob)
    except RequestInvalid as exc:
        assert exc.issues


def shuffled(node: Any, rng: random.Random) -> Any:
    if isinstance(node, dict):
        keys = list(node)
        rng.shuffle(keys)
        return {k: shuffled(node[k], rng) for k in keys}
    if isinstance(node, list):
        return [shuffled(v, rng) for v in node]
    return node


@SETTINGS
@given(name=st.sampled_from(sorted(EXAMPLES)), seed=st.integers(0, 2**32),
       flow=st.booleans())
def test_digest_ignores_key_order_and_encoding(name: str, seed: int, flow: bool) -> None:
    doc = EXAMPLES[name]
    expected = parse_request(doc).request_sha256
    variant = shuffled(doc, random.Random(seed))
    assert parse_request(variant).request_sha256 == expected
    assert parse_request(json.dumps(variant).encode()).request_sha256 == expected
    assert parse_request(json.dumps(variant, indent=2), encoding="json").request_sha256 == \
        expected
    as_yaml = yaml.safe_dump(variant, sort_keys=False, default_flow_style=flow)
    assert parse_request(as_yaml, encoding="yaml").request_sha256 == expected


@SETTINGS
@given(name=st.sampled_from(sorted(EXAMPLES)), data=st.data())
def test_any_semantic_change_changes_the_digest(name: str, data: st.DataObject) -> None:
    doc = copy.deepcopy(EXAMPLES[name])
    expected = parse_request(doc).request_sha256
    paths = [p for p in all_paths(doc) if p and isinstance(at(doc, p), str)
             and p[-1] in ("served_model_name", "revision", "host", "output")]
    if not paths:
        return
    path = data.draw(st.sampled_from(paths))
    at(doc, path[:-1])[path[-1]] = at(doc, path) + "x"
    assert parse_request(doc).request_sha256 != expected


json_documents = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(value=json_documents)
def test_canonical_json_round_trips_and_is_idempotent(value: Any) -> None:
    encoded = canonical_json(value)
    assert encoded.isascii()
    decoded = json.loads(encoded)
    assert decoded == value
    assert canonical_json(decoded) == encoded


@settings(max_examples=200, deadline=None)
@given(argv=st.lists(st.sampled_from(["--port", "--port=1", "--master-addr", "a b", "x",
                                      "--dist-init-addr=h:1", "--portal"]) | st.text(max_size=8),
                     max_size=8))
def test_normalize_command_is_idempotent_and_keeps_length(argv: list[str]) -> None:
    once = normalize_command(argv)
    assert len(once) == len(argv)
    assert normalize_command(once) == once
