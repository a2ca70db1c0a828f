"""Every `scripts/bench` mode runs in its smoke size (`--smoke`: one round, MiB of state) and
prints its JSON line with every figure it documents. A benchmark nobody runs breaks unseen
(issue 37: `bench capsule` died on the bounded gets); the real sizes stay the benchmarks'.

The real-vLLM modes (vllm, vllm_tp2) need the vLLM capsule and minutes: their arguments and
line assembly are tests/unit/test_bench_vllm.py. Lines go to a tmp directory
(COLDSNAP_BENCH_RESULTS), never to bench-results/. Modes that use the dev cluster use the
suite's; those that start their own (probe, restore, fanout) get a network base no namespace
on this machine holds, so they run beside the suite's cluster and any other."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from devtools.layout import MAX_SLOT, fits, namespaces_of

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts" / "bench"
TIMEOUT = 600  # one smoke run takes seconds to about a minute on a 2-CPU machine


def free_net_base(hosts: int) -> int:
    """A network base whose hosts' and registry's namespaces (and the slots' other kind) are
    all absent now: the benchmarks that start a cluster of their own take it."""
    taken = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                               check=True).stdout.split())
    for base in range(MAX_SLOT // 2, 0, -hosts):
        if fits(base, hosts) and not taken & set(namespaces_of(base, hosts)):
            return base
    raise AssertionError("no free network base on this machine for a benchmark's cluster")


def bench(name: str, results: Path, *args: str, **env: str) -> dict[str, Any]:
    """`scripts/bench NAME --smoke ARGS`: its one JSON line (also the only line it appended
    to results/NAME.jsonl), after checking that bench-results/ in the repository is
    untouched."""
    mine = REPO / "bench-results" / f"{name}.jsonl"
    before = mine.read_bytes() if mine.exists() else None
    proc = subprocess.run(
        [str(BENCH), name, "--smoke", *args], cwd=REPO, capture_output=True, text=True,
        timeout=TIMEOUT, check=False,
        env={**os.environ, "COLDSNAP_BENCH_RESULTS": str(results), **env})
    assert proc.returncode == 0, f"bench {name} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"bench {name} printed more than its JSON line:\n{proc.stdout}"
    doc: dict[str, Any] = json.loads(lines[0])
    assert (results / f"{name}.jsonl").read_text().splitlines() == lines
    assert (mine.read_bytes() if mine.exists() else None) == before
    assert doc["bench"] == name and doc["smoke"] is True
    assert len(doc["load_average"]) == 3  # how loaded the machine was, beside every figure
    return doc


def assert_figures(doc: dict[str, Any], keys: set[str], nullable: frozenset[str] = frozenset()
                   ) -> None:
    """Every documented key is in the line, and none but `nullable` is null."""
    assert keys <= set(doc), f"missing: {sorted(keys - set(doc))}"
    assert [k for k in keys if doc[k] is None and k not in nullable] == []


@pytest.fixture
def results(tmp_path: Path) -> Path:
    return tmp_path / "bench-results"


@pytest.fixture
def cluster_env(dev_inventory: Path) -> dict[str, str]:
    """The suite's dev cluster, for the modes that benchmark against a running one."""
    return {"COLDSNAP_DEV_CLUSTER_DIR": str(dev_inventory.parent)}


def test_fuzz(results: Path) -> None:
    doc = bench("fuzz", results)
    assert_figures(doc, {"cases_per_fuzzer", "requests_wall_s", "requests_cpu_s",
                         "artifacts_wall_s", "artifacts_cpu_s"})


def test_staging(results: Path, cluster_env: dict[str, str]) -> None:
    doc = bench("staging", results, **cluster_env)
    assert_figures(doc, {"host", "transport", "bytes", "rounds", "coldsnapd_seconds",
                         "scp_seconds", "ratio", "target_ratio_max", "scp_aes128gcm_seconds",
                         "samples"})
    assert doc["rounds"] == 1 and doc["bytes"] < 64 << 20
    # `staging --link`: every staging path and every raw floor of the same bytes, per shape,
    # with the best floor and the default path's ratio to it.
    doc = bench("staging", results / "link", "--link", **cluster_env)
    assert_figures(doc, {"mode", "host", "bytes", "chunk_bytes", "rounds", "default_path",
                         "chunks", "file", "target_ratio_min", "sha256_mb_s"})
    assert doc["mode"] == "link" and doc["rounds"] == 1 and doc["bytes"] < 64 << 20
    for shape in ("chunks", "file"):
        figures = doc[shape]
        for kind in ("store-openssh", "store-asyncssh", "store-auto", "registry", "curl",
                     "scp", "cat", "curl-sync"):
            assert figures[kind]["seconds"] > 0 and figures[kind]["mb_s"] > 0, kind
        assert figures["best_floor"] in ("curl", "scp", "cat") and figures["ratio"] > 0
    assert doc["chunks"]["objects"] == doc["bytes"] // doc["chunk_bytes"]
    assert doc["file"]["objects"] == 1


def test_fetch(results: Path, cluster_env: dict[str, str]) -> None:
    doc = bench("fetch", results, **cluster_env)
    assert_figures(doc, {"hosts", "mib_per_host", "rounds", "asyncssh_seconds",
                         "openssh_seconds", "scp_seconds", "ratios", "runs"})
    assert set(doc["ratios"]) == {"asyncssh_vs_scp", "openssh_vs_scp"}
    assert doc["rounds"] == 1 and doc["mib_per_host"] < 64


def test_launch(results: Path, cluster_env: dict[str, str]) -> None:
    doc = bench("launch", results, **cluster_env)
    assert_figures(doc, {"host", "pid_floor", "repeat", "confined_launch_s",
                         "fork_pid_advance_s"})


CAPSULE_FIGURES = {
    "warm_state_bytes", "workers", "engine_warmup_rounds", "rounds", "cold_start_seconds",
    "dump_seconds", "image_bytes", "restore_seconds", "raw_criu_restore_seconds", "registry",
    "commit_seconds", "capsule_bytes", "criu_object_bytes", "criu_objects", "fetch_seconds",
    "stage_seconds", "staged_bytes", "stage_warm_seconds", "load_seconds",
    "criu_restore_step_seconds", "container_create_seconds", "restore_over_raw",
    "cold_over_restore", "per_round"}


def test_capsule(results: Path, cluster_env: dict[str, str]) -> None:
    """The mode issue 37 found broken: its fetch made a get without a size."""
    doc = bench("capsule", results, **cluster_env)
    # registry: null only with --no-registry or an inventory without one.
    assert_figures(doc, CAPSULE_FIGURES, nullable=frozenset({"registry"}))
    assert doc["rounds"] == 1 and doc["warm_state_bytes"] < 64 << 20
    assert doc["fetch_seconds"] > 0 and doc["staged_bytes"] > 0


def test_service(results: Path, cluster_env: dict[str, str]) -> None:
    doc = bench("service", results, **cluster_env)
    assert_figures(doc, {"shard_bytes", "capture_alone_host01_s", "capture_alone_host23_s",
                         "captures_disjoint_together_s", "concurrency_ratio",
                         "prepare_only_via_service_median_s", "prepare_only_local_median_s",
                         "repeat"})


def test_probe(results: Path) -> None:
    doc = bench("probe", results, COLDSNAP_BENCH_NET_BASE=str(free_net_base(2)))
    assert_figures(doc, {
        "hosts", "rounds", "one_host_seconds", "many_hosts_seconds", "ratio",
        "target_ratio_max", "serial_seconds", "coldsnapd_seconds", "openssh_parallel_seconds",
        "openssh_kex", "openssh_default_kex_parallel_seconds", "vs_openssh_ratio",
        "target_vs_openssh_max", "coldsnapd_cpu_seconds", "openssh_clients_cpu_seconds",
        "warm_one_host_seconds", "warm_many_hosts_seconds", "warm_ratio", "cpus", "samples"})
    assert (doc["hosts"], doc["rounds"]) == (2, 1)


RESTORE_FIGURES = {
    "gib_per_worker", "hosts", "workers", "cold_start_seconds", "capture_seconds",
    "capture_after_ready_seconds", "restore_cold_host_seconds", "bytes_staged_cold",
    "restore_warm_host_replacing_seconds", "restore_warm_host_seconds",
    "warm_host_nothing_running", "scp_seconds_same_bytes", "scp_to_control_seconds",
    "fsync_after_scp_seconds", "fsync_after_scp_to_control_seconds", "raw_criu_dump_seconds",
    "raw_criu_restore_seconds", "raw_wake_to_answer_seconds", "validation_round_trip_seconds",
    "criu_images_bytes", "payload_bytes", "weights_released",
    "caches_dropped_before_cold_restore_and_scp", "mem_free_before_cold_restore_bytes",
    "ratios", "targets", "phases"}


def test_restore(results: Path) -> None:
    doc = bench("restore", results, COLDSNAP_BENCH_NET_BASE=str(free_net_base(2)))
    assert_figures(doc, RESTORE_FIGURES)
    assert doc["gib_per_worker"] < 1 / 16


FANOUT_WAY = {"wall_seconds", "restore_seconds", "staging_seconds", "control_bytes",
              "control_bytes_csd_br0", "registry_egress_bytes", "staged_bytes",
              "objects_dir_bytes", "load_avg"}
FANOUT_FLOOR = {"wall_seconds", "per_host_seconds", "control_bytes", "control_bytes_csd_br0",
                "registry_egress_bytes", "staged_bytes", "load_avg"}


def test_fanout(results: Path) -> None:
    doc = bench("fanout", results, COLDSNAP_BENCH_NET_BASE=str(free_net_base(2)))
    # link_mbit: null when the links were left unshaped (the smoke size's default).
    assert_figures(doc, {"gib", "link_mbit", "registry_link", "hosts", "replicas", "engine",
                         "load_avg_start", "load_avg_end", "capture_id", "published",
                         "capture_seconds", "artifact_bytes", "bytes_per_host", "objects",
                         "payload_bytes", "runs", "goals", "targets"},
                   nullable=frozenset({"link_mbit"}))
    assert doc["replicas"] == [1, 2] and set(doc["runs"]) == {"1", "2"}
    for run in doc["runs"].values():
        assert_figures(run["store"], FANOUT_WAY)
        assert_figures(run["registry"], FANOUT_WAY)
        assert_figures(run["floor"], FANOUT_FLOOR)
        assert set(run["goals"]) == {"control_bytes_vs_staged_registry",
                                     "pull_vs_floor_per_host"}
    assert set(doc["goals"]) == {"registry_wall_n2_vs_n1", "store_wall_n2_vs_n1",
                                 "registry_restore_max_n2_vs_n1",
                                 "registry_staging_max_n2_vs_n1"}


def test_every_mode_is_smoke_tested_here_or_in_the_unit_tests() -> None:
    """A new benchmark gets its smoke test: the modes scripts/bench lists are the ones above
    plus the real-vLLM two."""
    modes = {p.name[len("bench_"):-len(".py")] for p in (REPO / "scripts").glob("bench_*.py")}
    here = {n[len("test_"):] for n in globals() if n.startswith("test_")}
    assert modes - {"common"} == here - {"every_mode_is_smoke_tested_here_or_in_the_unit_tests"
                                         } | {"vllm", "vllm_tp2"}
