"""The compatibility corpus (tests/unit/compat_corpus, README there): requests in the shape the
reference documents and Sparkrun's ColdSnap plugin builds them. Each validates as the service
validates it, is taken unchanged (every field it sends is in its canonical form with the value
it sent; only the driver's default fills an empty graph_policy), and plans. A later refusal of
a value the format allows must keep this green."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from coldsnap.cli import main
from coldsnap.formats.request import DEFAULT_GRAPH_POLICY, parse_request
from coldsnap.operations.units import staged_cache

CORPUS = Path(__file__).resolve().parent / "compat_corpus"
FILES = sorted(CORPUS.glob("*.yaml"))


def _sent_fields(raw: Any, canonical: Any, path: str = "") -> list[str]:
    """Paths where `canonical` does not hold what `raw` sent."""
    if isinstance(raw, dict):
        if not isinstance(canonical, dict):
            return [path]
        return [p for k, v in raw.items()
                for p in ([f"{path}.{k}"] if k not in canonical
                          else _sent_fields(v, canonical[k], f"{path}.{k}"))]
    if isinstance(raw, list):
        if not isinstance(canonical, list) or len(raw) != len(canonical):
            return [path]
        return [p for i, (a, b) in enumerate(zip(raw, canonical, strict=True))
                for p in _sent_fields(a, b, f"{path}[{i}]")]
    return [] if raw == canonical else [path]


def test_the_corpus_has_every_shape_and_its_readme_names_each_file() -> None:
    names = {f.name for f in FILES}
    readme = (CORPUS / "README.md").read_text()
    assert names and all(f"`{n}`" in readme for n in names), names
    ops = {(yaml.safe_load(f.read_text())["launch"]["engine"],
            yaml.safe_load(f.read_text())["operation"]) for f in FILES}
    assert {("vllm", "capture"), ("vllm", "restore"), ("sglang", "capture"),
            ("sglang", "restore")} <= ops


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_each_request_validates_unchanged(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    req = parse_request(path.read_bytes())
    canonical = req.canonical()
    process = raw.get("policy", {}).get("process", {})
    if process.get("graph_policy") == "" and process.get("async_graphs", True):
        assert canonical["policy"]["process"]["graph_policy"] == \
            DEFAULT_GRAPH_POLICY[raw["snapshot_driver"]["id"]]
        process.pop("graph_policy")
    assert _sent_fields(raw, canonical) == []
    if req.operation == "capture" and req.policy.cache.seed:
        # Sparkrun stages one cache per unit; each unit seeds its own.
        staged = {u.id: staged_cache(req.policy.cache, u.id) for u in req.launch.units}
        assert all(v is not None and v[1].endswith(f"/units/{k}") for k, v in staged.items())


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_each_request_plans(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--request", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    raw = yaml.safe_load(path.read_text())
    assert [w["host"] for w in plan["workers"]] == [u["host"] for u in raw["launch"]["units"]]
    assert {h: sorted(v["units"]) for h, v in plan["hosts"].items()} == \
        {u["host"]: [u["id"]] for u in raw["launch"]["units"]}
