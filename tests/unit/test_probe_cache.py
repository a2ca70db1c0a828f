"""The remembered CRIU probe's key and store: what makes a remembered probe stale, and that a
torn or foreign entry reads as absent."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from coldsnap.admission import HostFacts
from coldsnap.capsule.criu_probe import PROBE_RECIPE, CriuProbe
from coldsnap.hosts.inventory import HostEntry
from coldsnap.operations.probe_cache import PROBES_DIR, ProbeCache, ProbeKey, probe_key

ENTRY = HostEntry(name="h1", address="10.0.0.1", data_dir="/d", docker_socket="/run/d.sock",
                  simulated=True, driver_version="610.43.02")
FACTS = HostFacts(arch="x86_64", kernel="6.8.0-1", driver_version="610.43.02",
                  boot_id="0b1c", docker="26.1.5", docker_instance="77 1700000000")
IMAGE = "sha256:" + "a" * 64
PROBE = CriuProbe("h1", IMAGE, "Version: 4.2\nLooks good.", "4.2")


def test_facts_without_boot_or_dockerd_remember_nothing() -> None:
    assert probe_key(ENTRY, FACTS, IMAGE) is not None
    for field in ("boot_id", "docker", "docker_instance"):
        assert probe_key(ENTRY, dataclasses.replace(FACTS, **{field: None}), IMAGE) is None


def test_a_passed_probe_is_found_under_its_key_only(tmp_path: Path) -> None:
    cache = ProbeCache(tmp_path)
    key = probe_key(ENTRY, FACTS, IMAGE)
    assert key is not None and key.recipe == PROBE_RECIPE
    assert cache.lookup(key) is None
    cache.remember(key, PROBE)
    found = cache.lookup(key)
    assert found is not None and found.version == "4.2" and found.image == IMAGE
    changed: list[ProbeKey] = [
        dataclasses.replace(key, boot_id="other-boot"),  # rebooted
        dataclasses.replace(key, kernel="6.9.0"),
        dataclasses.replace(key, docker_instance="78 1700000100"),  # dockerd restarted
        dataclasses.replace(key, docker="27.0.1"),
        dataclasses.replace(key, image_id="sha256:" + "b" * 64),
        dataclasses.replace(key, host="h2"),
        dataclasses.replace(key, recipe="sha256:" + "c" * 64),  # another probe script
    ]
    for other in changed:
        assert cache.lookup(other) is None, other


def test_a_torn_or_foreign_entry_reads_as_absent(tmp_path: Path) -> None:
    cache = ProbeCache(tmp_path)
    key = probe_key(ENTRY, FACTS, IMAGE)
    assert key is not None
    cache.remember(key, PROBE)
    path = cache.path(key)
    assert path.parent == tmp_path / PROBES_DIR
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(doc)[:40])
    assert cache.lookup(key) is None
    doc["key"]["boot_id"] = "someone-else"  # written for another key under this name
    path.write_text(json.dumps(doc))
    assert cache.lookup(key) is None
