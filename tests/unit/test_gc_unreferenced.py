"""`coldsnapd gc --unreferenced` on a real data_dir (a LocalHost) and a real store: what no
artifact references goes, what one references stays, and so do partial files, busy or
non-empty per-operation directories, and everything while an index entry is unreadable."""

from __future__ import annotations

import asyncio
import fcntl
from pathlib import Path

from coldsnap.capsule.oci import capsule_reference
from coldsnap.hosts.inventory import parse_inventory
from coldsnap.hosts.local import LocalHost
from coldsnap.operations.hostset import HostSet
from coldsnap.runner.ledger import Ledger
from coldsnap.store import LocalStore
from coldsnap.upkeep.registry_sweep import OTHER, tag_owners
from coldsnap.upkeep.unreferenced import Place, describe, sweep_unreferenced
from tests.unit.conftest import make_artifact

UNREF = "e" * 64


def _setup(tmp_path: Path) -> tuple[LocalStore, HostSet, Path, str]:
    store = LocalStore(tmp_path / "store").ensure()
    stored = store.put_artifact(make_artifact("cap-1"))
    for obj in stored.artifact.objects:
        store.object_path(obj.sha256).write_bytes(b"x" * obj.bytes)
    data = tmp_path / "data"
    objs = data / "objects" / "sha256"
    objs.mkdir(parents=True)
    referenced = stored.artifact.objects[0].sha256.removeprefix("sha256:")
    (objs / referenced).write_bytes(b"r")
    (objs / UNREF).write_bytes(b"u" * 10)
    (objs / f"{UNREF}.coldsnap-part").write_bytes(b"p")  # a transfer in flight
    (data / "criu-images" / UNREF).mkdir(parents=True)
    (data / "criu-images" / UNREF / "pages-1.img").write_bytes(b"i" * 20)
    (data / "criu-images" / f".{UNREF}.op-x.partial").mkdir()
    for op in ("op-dead", "op-run", "op-full"):
        (data / "dumps" / op).mkdir(parents=True)
    (data / "dumps" / "op-full" / "c").mkdir()
    (store.objects_dir / UNREF).write_bytes(b"s" * 7)
    inventory = parse_inventory({"hosts": [{"name": "local", "address": "127.0.0.1",
                                            "data_dir": str(data), "docker_socket": None}]})
    return store, HostSet(inventory, {"local": LocalHost("local")}), data, referenced


def _sweep(store: LocalStore, hosts: HostSet, dry_run: bool) -> list[Place]:
    return asyncio.run(sweep_unreferenced(hosts, store, None, dry_run=dry_run))


def test_unreferenced_removed_referenced_and_busy_kept(tmp_path: Path) -> None:
    store, hosts, data, referenced = _setup(tmp_path)
    ledger = Ledger(store.root)
    ledger.dir.mkdir(parents=True, exist_ok=True)
    with ledger.lock_path("op-run").open("ab") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # op-run is running
        dry = _sweep(store, hosts, dry_run=True)
        assert (data / "objects" / "sha256" / UNREF).exists() and store.has("sha256:" + UNREF)
        places = _sweep(store, hosts, dry_run=False)
    assert [p.removed for p in dry] == [p.removed for p in places]
    store_place, host = places
    assert [j.what for j in store_place.removed] == ["sha256:" + UNREF]
    assert not store.has("sha256:" + UNREF) and store.has_artifact("cap-1")
    assert {j.what for j in host.removed} == {
        f"criu-images/{UNREF}", str(data / "dumps" / "op-dead"), f"objects/sha256/{UNREF}"}
    objs = data / "objects" / "sha256"
    assert sorted(p.name for p in objs.iterdir()) == sorted([referenced,
                                                             f"{UNREF}.coldsnap-part"])
    assert [p.name for p in (data / "criu-images").iterdir()] == [f".{UNREF}.op-x.partial"]
    assert sorted(p.name for p in (data / "dumps").iterdir()) == ["op-full", "op-run"]
    lines = describe(places, dry_run=False)
    assert f"local: removed objects/sha256/{UNREF} (10 B): no artifact references it" in lines
    assert f"local: kept {data / 'dumps' / 'op-run'}: its operation is running" in lines


def test_an_unreadable_index_entry_keeps_everything(tmp_path: Path) -> None:
    store, hosts, data, _ = _setup(tmp_path)
    (store.artifacts_dir / "broken.json").write_text("{")
    store_place, host = _sweep(store, hosts, dry_run=False)
    assert store_place.removed == [] and store.has("sha256:" + UNREF)
    assert (data / "objects" / "sha256" / UNREF).exists()
    assert any("unreadable" in j.why for j in host.kept)


def test_a_capsule_tag_is_attributed_to_the_capture_and_unit_it_was_derived_from(
        tmp_path: Path) -> None:
    """Capsule tags carry a digest of the exact capture and unit ids, so gc derives them again
    per unit repository: this store's unreferenced capture's tag may go (None), a kept or
    running capture's stays, and a tag no capture of this store made is another node's."""
    store = LocalStore(tmp_path / "store").ensure()
    ledger = Ledger(store.root)
    for capture in ("cap-dead", "cap-kept", "cap-run"):
        assert ledger.reserve(capture, "capture", "sha256:" + "0" * 64) is None
    repo, tag_dead = capsule_reference("unit-0", "cap-dead")
    owners = tag_owners(store.root, {"cap-kept"})
    with ledger.lock_path("cap-run").open("ab") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # cap-run is running
        assert owners.why(repo, capsule_reference("unit-0", "cap-run")[1]) == \
            "capture cap-run of this store runs"
    assert owners.why(f"198.18.0.1:5000/{repo}", tag_dead) is None
    assert owners.why(repo, capsule_reference("unit-0", "cap-kept")[1]) == \
        "capture cap-kept of this store, whose artifact is kept"
    # the same capture's tag for another unit, in this unit's repository: not ours to judge
    assert owners.why(repo, capsule_reference("unit-1", "cap-dead")[1]) == OTHER
    assert owners.why(repo, capsule_reference("unit-0", "another-nodes-capture")[1]) == OTHER
