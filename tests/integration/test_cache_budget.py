"""A host cache held to its budget on the dev cluster: five captures restored in turn into a
host whose `cache_budget` holds two; the oldest are evicted, the newest restores again with
nothing sent, and a restore of an evicted artifact keeps what it needs while it runs; then
`gc --unreferenced` after an artifact left the store.

The hosts get fresh data_dirs (below their dev ones) for this test, so that what the budget
counts is only what these operations put there."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from coldsnap.formats.capsule import parse_capsule_manifest
from tests.integration.conftest import REPO
from tests.integration.ops_fixtures import Ops, dev_requests, edited_inventory, ops

pytestmark = pytest.mark.integration

__all__ = ["dev_requests", "ops"]  # fixtures used by name

HOST = "host-0"
MANIFEST = ("application/vnd.docker.distribution.manifest.v2+json, "
            "application/vnd.oci.image.manifest.v1+json")


def _du(path: Path) -> int:
    out = subprocess.run(["du", "-sb", "--", str(path)], check=True, capture_output=True,
                         text=True).stdout
    return int(out.split()[0])


def _image_set(ops: Ops, capture_id: str) -> str:
    """The hex name of unit-0's (host-0's) published image set."""
    artifact = json.loads((ops.store / "artifacts" / f"{capture_id}.json").read_text())
    obj = next(o for o in artifact["objects"]
               if o["role"] == "capsule-manifest" and o["owner"] == "unit/unit-0")
    manifest = parse_capsule_manifest(json.loads(
        (ops.store / "objects" / "sha256" / obj["sha256"][7:]).read_text()))
    return manifest.criu_images.digest.removeprefix("sha256:")


def test_five_captures_into_a_budget_that_holds_two(ops: Ops) -> None:
    token = secrets.token_hex(3)
    dirs = {h: Path(ops.hosts[h]["data_dir"]) / f"budget-{token}" for h in ("host-0", "host-1")}
    for d in dirs.values():
        d.mkdir()
    try:
        _run(ops, dirs)
    finally:
        ops.remove_units()
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)


def _run(ops: Ops, dirs: dict[str, Path]) -> None:
    free = edited_inventory(ops, "budget-free", {h: {"data_dir": str(d)}
                                                 for h, d in dirs.items()})
    captures = []
    for n in range(5):
        run = ops.coldsnapd("capture", "--request", str(ops.request(
            "tp2-two-hosts", suffix=f"budget-{n}")), inventory=free).ok()
        assert run.receipt is not None
        captures.append(run.receipt["result"]["artifact"])
        # The capture's per-operation directories went with it.
        for d in dirs.values():
            assert not (d / "dumps" / run.receipt["operation_id"]).exists()
            assert not (d / "capsules" / run.receipt["operation_id"]).exists()
    sets = {c: _image_set(ops, c) for c in captures}
    assert len(set(sets.values())) == 5

    # The first restore, without a budget, measures what one artifact adds.
    ops.coldsnapd("restore", "--artifact", captures[0], inventory=free).ok()
    ops.remove_units()
    images = dirs[HOST] / "criu-images"
    one = _du(images / sets[captures[0]])
    total = _du(dirs[HOST])
    size = total + one * 3 // 2  # two artifacts fit under the high watermark, three do not
    low = 100 * (total + one * 6 // 5) // size
    budget = edited_inventory(ops, "budget", {
        **{h: {"data_dir": str(d)} for h, d in dirs.items()},
        HOST: {"data_dir": str(dirs[HOST]),
               "cache_budget": {"size": size, "high_percent": 100, "low_percent": low}}})

    def held() -> set[str]:
        return {p.name for p in images.iterdir() if not p.name.startswith(".")}

    for n, capture in enumerate(captures[1:], start=1):
        run = ops.coldsnapd("restore", "--artifact", capture, inventory=budget).ok()
        ops.remove_units()
        kept = {sets[c] for c in captures[max(0, n - 1):n + 1]}
        assert held() == kept, (n, run.stderr[-3000:])
        if n >= 2:
            assert f"{HOST}: usage" in run.stderr and f"evicted {captures[n - 2]}" in run.stderr
    assert held() == {sets[captures[3]], sets[captures[4]]}

    # The newest restores from what the host holds: nothing is sent to it.
    again = ops.coldsnapd("restore", "--artifact", captures[4], inventory=budget).ok()
    ops.remove_units()
    line = next(x for x in again.stderr.splitlines() if x.startswith(f"{HOST}: ")
                and " owned, " in x)
    assert "sent 0 B" in line, line

    # The oldest, evicted, restored again: least recently used of all when eviction runs
    # after it staged, but its running restore needs it, so the one before the newest goes.
    oldest = ops.coldsnapd("restore", "--artifact", captures[0], inventory=budget).ok()
    ops.remove_units()
    assert held() == {sets[captures[0]], sets[captures[4]]}, oldest.stderr[-3000:]
    assert f"evicted {captures[3]}" in oldest.stderr

    # An artifact dropped from the store: gc --unreferenced removes what only it named, on
    # the control node, the host and in the registry, and keeps the newest's.
    artifact = json.loads((ops.store / "artifacts" / f"{captures[0]}.json").read_text())
    (ops.store / "artifacts" / f"{captures[0]}.json").unlink()
    gc = subprocess.run([sys.executable, "-m", "coldsnap", "gc", "--unreferenced", "--json",
                         "--inventory", str(budget), "--store", str(ops.store)],
                        capture_output=True, text=True, cwd=REPO)
    assert gc.returncode == 0, gc.stderr[-3000:]
    places = {p["place"]: p for p in json.loads(gc.stdout)["unreferenced"]}
    removed = {p: {j["what"] for j in places[p]["removed"]} for p in places}
    assert held() == {sets[captures[4]]}
    assert f"criu-images/{sets[captures[0]]}" in removed[HOST]
    newest = json.loads((ops.store / "artifacts" / f"{captures[4]}.json").read_text())
    unique = {o["sha256"] for o in artifact["objects"]} - {o["sha256"] for o in newest["objects"]}
    assert unique and unique <= removed["control node store"]
    assert not any((ops.store / "objects" / "sha256" / d[7:]).exists() for d in unique)
    # Its capsule, pulled on host-0 by its restores, left that host's Docker too.
    pulled = artifact["capsule"]["images"][0]["digest"]
    client = ops.docker(HOST)
    try:
        names = [n for i in client.images.list() for n in i.attrs.get("RepoDigests") or []]
    finally:
        client.close()
    assert not [n for n in names if n.endswith("@" + pulled)]
    assert any(w.startswith("image ") and pulled in w for w in removed[HOST]), removed[HOST]
    registry = yaml.safe_load(ops.inventory.read_text())["registry"]
    for image in artifact["capsule"]["images"]:
        repo, _, digest = image["reference"].partition("@")
        assert any(w.startswith(f"{repo}@{digest}") for w in removed[f"registry {registry}"])
        request = urllib.request.Request(
            f"http://{registry}/v2/{repo.removeprefix(registry + '/')}/manifests/{digest}",
            method="HEAD", headers={"Accept": MANIFEST})
        with pytest.raises(urllib.error.HTTPError) as gone:
            urllib.request.urlopen(request, timeout=10)
        assert gone.value.code == 404
