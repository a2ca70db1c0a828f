"""Pure helpers of coldsnap.capsule: references, mounts, device maps, the unit's environment."""

from __future__ import annotations

import json
import re

import pytest

from coldsnap.capsule import Mount, UnitSpec, Validation, WorkerSpec, device_map
from coldsnap.capsule.criu_probe import criu_check_passed, criu_version
from coldsnap.capsule.criu_restore import lazy_restore_pays
from coldsnap.capsule.oci import capsule_reference, split_reference
from coldsnap.capsule.spec import (
    CRIU_CAPABILITIES,
    container_path_for,
    docker_name,
    docker_tag,
    host_path_for,
)
from coldsnap.formats.capsule import CriuExtent, CriuImageFile, CriuImageObject, CriuImageSet

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("127.0.0.1:5000/coldsnap/x@" + DIGEST, ("127.0.0.1:5000/coldsnap/x", None, DIGEST)),
        ("127.0.0.1:5000/coldsnap/x:v1", ("127.0.0.1:5000/coldsnap/x", "v1", None)),
        ("127.0.0.1:5000/coldsnap/x:v1@" + DIGEST, ("127.0.0.1:5000/coldsnap/x", "v1", DIGEST)),
        ("repo/x", ("repo/x", None, None)),
        ("localhost:5000/x", ("localhost:5000/x", None, None)),
        # A bare digest (the request format allows it) has no repository, not one named sha256.
        (DIGEST, ("", None, DIGEST)),
    ],
)
def test_split_reference_keeps_registry_port_out_of_the_tag(
    ref: str, expected: tuple[str, str | None, str | None]
) -> None:
    assert split_reference(ref) == expected


def test_host_path_for_maps_through_the_longest_mount() -> None:
    mounts = (Mount(source="/data/models", target="/models"),
              Mount(source="/fast/shards", target="/models/shards"))
    assert host_path_for(mounts, "/models/a.bin") == "/data/models/a.bin"
    assert host_path_for(mounts, "/models/shards/s0.bin") == "/fast/shards/s0.bin"
    assert host_path_for(mounts, "/models") == "/data/models"
    assert host_path_for(mounts, "/modelsX/a.bin") is None
    assert host_path_for(mounts, "/etc/passwd") is None


def test_host_path_for_never_leaves_its_mount() -> None:
    mounts = (Mount(source="/data/models", target="/models", read_only=True),)
    assert host_path_for(mounts, "/models/../../../../etc/shadow") is None
    assert host_path_for(mounts, "/models/a/../b.bin") == "/data/models/b.bin"
    assert host_path_for(mounts, "models/a.bin") is None


def test_container_path_for_is_the_inverse_through_the_deepest_mount() -> None:
    mounts = (Mount(source="/data/models", target="/models", read_only=True),
              Mount(source="/data/models/fast", target="/fast", read_only=True))
    assert container_path_for(mounts, "/data/models/a.bin") == "/models/a.bin"
    assert container_path_for(mounts, "/data/models/fast/s0.bin") == "/fast/s0.bin"
    assert container_path_for(mounts, "/data/modelsX/a.bin") is None


def test_device_map_is_by_slot_and_refuses_a_different_count() -> None:
    assert device_map(["GPU-a", "GPU-b"], ["GPU-x", "GPU-y"]) == {"GPU-a": "GPU-x",
                                                                  "GPU-b": "GPU-y"}
    with pytest.raises(ValueError, match="captured 2 devices"):
        device_map(["GPU-a", "GPU-b"], ["GPU-x"])


def test_docker_name_is_safe_for_names_repositories_and_tags() -> None:
    assert docker_name("Unit_0/Rank:1") == "unit_0-rank-1"
    assert docker_name("...") == "x"
    assert len(docker_name("a" * 300)) == 100


def test_capsule_tags_are_one_to_one_with_the_capture_and_unit() -> None:
    # A failed capture `model-a` discards its capsule by tag: it must never be the tag of an
    # earlier `Model-A`, nor of an id that differs only past the cut, nor of another unit.
    long_a, long_b = "c" * 120 + "a", "c" * 120 + "b"
    refs = {capsule_reference(unit, cap) for cap in ("Model-A", "model-a", "model_a",
                                                     long_a, long_b)
            for unit in ("unit-0", "Unit-0")}
    assert len(refs) == 10
    for repo, tag in refs:
        assert re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,127}", tag), tag
        assert repo.startswith("coldsnap/capsule/")
    assert capsule_reference("unit-0", "Model-A") == capsule_reference("unit-0", "Model-A")
    assert docker_tag("Model-A").startswith("model-a-")


def test_criu_version_is_read_from_the_probe_output() -> None:
    assert criu_version("Version: 4.2.1\nLooks good.") == "4.2.1"
    assert criu_version("Looks good.") is None


def test_criu_check_accepts_a_read_only_ns_last_pid_only_when_clone3_sets_pids() -> None:
    read_only = ("Error (criu/cr-check.c:160): sys/kernel/ns_last_pid sysctl is inaccessible: "
                 "Read-only file system\n")
    tun = "Error (criu/tun.c:85): tun: Unable to create tun: No such file or directory\n"
    looks_bad = "Warn  (criu/cr-check.c:1674): Does not look good.\n"
    supported = "clone3_set_tid is supported\n"
    assert criu_check_passed("Version: 4.2.1\nLooks good.\n")
    assert criu_check_passed(supported + tun + read_only + looks_bad)
    assert not criu_check_passed(tun + read_only + looks_bad)
    other = "Error (criu/cr-check.c:99): Kernel doesn't support PTRACE_O_SUSPEND_SECCOMP\n"
    assert not criu_check_passed(supported + read_only + other + looks_bad)
    assert not criu_check_passed(supported + tun + looks_bad)


def test_unit_environment_carries_identity_and_devices() -> None:
    spec = UnitSpec(
        unit_id="u1", image="r/x@" + DIGEST, image_digest=DIGEST, command=("engine",),
        devices=("GPU-a", "GPU-b"),
        workers=(WorkerSpec("w1", 3, 4, 1, (1,)), WorkerSpec("w0", 2, 4, 0, (0,))),
        validation=Validation(prompt="p", expected="e"), environment={"RANK_HINT": "x"},
        gpu_mode="simulated")
    env = spec.container_environment()
    manifest = json.loads(env["COLDSNAP_UNIT"])
    assert [w["id"] for w in manifest["workers"]] == ["w0", "w1"]  # by process slot
    assert manifest["workers"][1] == {"id": "w1", "global_rank": 3, "world_size": 4,
                                      "process_slot": 1, "device_slots": [1]}
    assert env["COLDSNAP_SIMULATED_GPUS"] == env["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert env["RANK_HINT"] == "x"
    assert env["COLDSNAP_RUNTIME_DIR"] == "/var/lib/coldsnap/runtime"
    moved = spec.container_environment(["GPU-x", "GPU-y"])
    assert json.loads(moved["COLDSNAP_UNIT"])["devices"] == ["GPU-x", "GPU-y"]
    real = UnitSpec(**{**spec.__dict__, "gpu_mode": "nvidia"}).container_environment()
    assert "COLDSNAP_SIMULATED_GPUS" not in real


def test_only_the_capabilities_criu_needs() -> None:
    assert set(CRIU_CAPABILITIES) == {"SYS_ADMIN", "SYS_PTRACE", "SYS_TIME", "NET_ADMIN",
                                      "DAC_READ_SEARCH"}


def _image_set(total: int) -> CriuImageSet:
    digest = "sha256:" + "ab" * 32
    return CriuImageSet(chunk_bytes=total, objects=[CriuImageObject(sha256=digest, bytes=total)],
                        files=[CriuImageFile(name="pages-1.img", size=total, mode=0o600,
                                             extents=[CriuExtent(object=digest, offset=0,
                                                                 length=total)])])


@pytest.mark.parametrize(("total", "lazy"), [
    (32 << 20, False),  # a snapshot whose weights were released: read back whole
    ((256 << 20) - 1, False),
    (256 << 20, True),
    (8 << 30, True),  # weights in the images: the engine runs before they are all back
])
def test_only_large_criu_images_are_restored_lazily(total: int, lazy: bool) -> None:
    assert lazy_restore_pays(_image_set(total)) is lazy


def test_the_checked_binds_survive_in_the_containers_label() -> None:
    # A container stopped and started again is verified against what its creation checked
    # (Docker binds the sources anew at each start): the label keeps it, whole.
    from coldsnap.capsule.handle import CheckedBind
    from coldsnap.capsule.host_paths import bind_field, binds_from_label, binds_label

    binds = (CheckedBind("mounts[0].source", "/srv/m", "/models", "/mnt/m", "2049:131"),
             CheckedBind("workload.log_path", "/var/log/u.log", "/var/log/coldsnap/engine.log",
                         "/var/log/u.log", "2049:77"))
    assert binds_from_label(binds_label(binds)) == binds
    assert binds_from_label(None) is None and binds_from_label("not json") is None
    spec = UnitSpec(unit_id="u", image="r/x@sha256:" + "a" * 64, image_digest="sha256:" + "a" * 64,
                    command=("e",), devices=(), workers=(), validation=Validation(),
                    mounts=(Mount(source="/srv/m", target="/models"),), log_path="/l.log")
    fields = [bind_field(spec, j, m) for j, m in enumerate(spec.container_mounts())]
    assert fields == ["mounts[0].source", "workload.log_path"]
