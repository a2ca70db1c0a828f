"""The real-vLLM benchmarks (scripts/bench_vllm.py, bench_vllm_tp2.py) without vLLM: their
arguments and the JSON line they assemble from what a run recorded. The smoke runs of every
other benchmark are in tests/integration/test_bench_smoke.py; these two need the vLLM capsule
and minutes of CPU, so only their parts that need neither are checked here."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import structlog

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def benches() -> Iterator[tuple[ModuleType, ModuleType]]:
    # bench_common configures structlog for a benchmark's process (logs on the stderr of the
    # moment): the other tests' configuration is put back once the modules are loaded.
    saved = structlog.get_config()
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench_vllm
        import bench_vllm_tp2
    finally:
        sys.path.remove(str(SCRIPTS))
        structlog.configure(**saved)
    yield bench_vllm, bench_vllm_tp2


def receipt(duration: float, spans: dict[str, float], crossings: Any = None) -> dict[str, Any]:
    """A coldsnapd receipt as --receipt-json writes it, with the fields the benchmarks read."""
    return {"duration_seconds": duration,
            "timing": {"spans": [{"name": n, "duration_seconds": d, "parent": "op"}
                                 for n, d in spans.items()]},
            "result": {"crossings": crossings}}


def manifest(*sizes: int) -> dict[str, Any]:
    return {"criu_images": {"files": [{"size": s} for s in sizes]}, "weights_released": True,
            "accelerator": "cpu"}


def recorded(mod: ModuleType) -> Any:
    return mod.Recorded(
        cold_s=40.0, health_s=30.0, ready=25.0,
        capture=receipt(35.0, {"capture.start": 5.0, "capture.wait-ready": 20.0,
                               "capture.dump": 3.0}),
        cold=receipt(8.0, {"restore.stage": 4.0}), warm=receipt(2.0, {"restore.stage": 0.1},
                                                                  crossings=["sessions"]),
        rtts=[0.3, 0.1, 0.2], cold_caches=True)


def test_arguments_default_to_tp1_and_name_the_layout(benches: tuple[ModuleType, ...]) -> None:
    vllm, _ = benches
    args = vllm.parse_args([])
    assert (args.layout, args.keep, args.keep_caches) == ("tp1", False, False)
    assert vllm.layout_figures(args) == {"hosts": 2, "workers": 1}
    tp2 = vllm.parse_args(["--layout", "tp2", "--keep", "--keep-caches"])
    assert (tp2.layout, tp2.keep, tp2.keep_caches) == ("tp2", True, True)
    assert vllm.layout_figures(tp2) == {"layout": "tp2", "hosts": 4, "units": 2, "workers": 2}


def test_an_unknown_layout_is_refused_with_exit_2(benches: tuple[ModuleType, ...],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    vllm, _ = benches
    with pytest.raises(SystemExit) as exc:
        vllm.parse_args(["--layout", "tp8"])
    assert exc.value.code == 2
    assert "--layout" in capsys.readouterr().err


TP1_KEYS = {
    "hosts", "workers", "model", "cold_start_seconds", "cold_start_health_seconds",
    "capture_seconds", "capture_after_ready_seconds", "restore_cold_host_seconds",
    "restore_warm_host_seconds", "raw_criu_restore_seconds",
    "raw_criu_restore_to_answer_seconds", "raw_criu_lazy_restore_seconds",
    "raw_criu_lazy_restore_to_answer_seconds", "validation_round_trip_seconds",
    "criu_images_bytes", "weights_released", "accelerator", "caches_dropped", "ratios",
    "targets", "phases"}


def test_the_tp1_line_holds_every_documented_figure(benches: tuple[ModuleType, ...]) -> None:
    vllm, _ = benches
    figures = vllm.tp1_figures(recorded(vllm), manifest(100, 23), raw=0.5, raw_answer=0.9,
                               raw_lazy=0.2, raw_lazy_answer=1.0)
    doc = vllm.document(vllm.parse_args([]), figures)
    assert set(doc) == TP1_KEYS
    assert [k for k, v in doc.items() if v is None] == []
    assert doc["capture_after_ready_seconds"] == 10.0  # 35 less start and wait-ready
    assert doc["validation_round_trip_seconds"] == 0.2  # the median
    assert doc["criu_images_bytes"] == 123
    assert doc["ratios"] == {
        "cold_start_vs_restore_warm_host": 20.0,
        "restore_warm_host_vs_raw_restore_plus_validation": round(2.0 / 0.7, 3),
        "restore_cold_host_vs_cold_start": 0.2,
        "restore_warm_host_vs_raw_lazy_restore_to_answer": 2.0}
    assert doc["phases"]["capture"] == {"capture.start": 5.0, "capture.wait-ready": 20.0,
                                        "capture.dump": 3.0}


TP2_KEYS = {
    "layout", "hosts", "units", "workers", "model", "cold_start_seconds",
    "cold_start_health_seconds", "capture_seconds", "capture_after_ready_seconds",
    "restore_cold_host_seconds", "restore_warm_host_seconds", "raw_criu_restore_seconds",
    "raw_criu_restore_to_answer_seconds", "raw_criu_restore_error",
    "validation_round_trip_seconds", "criu_images_bytes", "crossings", "caches_dropped",
    "ratios", "targets", "phases"}


def test_the_tp2_line_sums_both_units_and_keeps_its_keys_when_the_raw_restore_failed(
        benches: tuple[ModuleType, ...]) -> None:
    vllm, tp2 = benches
    args = vllm.parse_args(["--layout", "tp2"])
    units = {"unit-0": manifest(10, 20), "unit-1": manifest(30)}
    ok = vllm.document(args, tp2.tp2_figures(recorded(vllm), units, raw=0.5, raw_answer=0.8,
                                             raw_error=None))
    assert set(ok) == TP2_KEYS
    assert [k for k, v in ok.items() if v is None] == ["raw_criu_restore_error"]
    assert ok["criu_images_bytes"] == 60
    assert ok["crossings"] == {"restore_warm": ["sessions"]}
    assert ok["ratios"]["restore_warm_host_vs_raw_restore_plus_validation"] == round(
        2.0 / 0.7, 3)
    failed = vllm.document(args, tp2.tp2_figures(recorded(vllm), units, raw=None,
                                                 raw_answer=None, raw_error="criu: boom"))
    assert set(failed) == TP2_KEYS
    assert failed["raw_criu_restore_error"] == "criu: boom"
    assert failed["raw_criu_restore_seconds"] is None
    assert failed["ratios"]["restore_warm_host_vs_raw_restore_plus_validation"] is None
    assert failed["ratios"]["cold_start_vs_restore_warm_host"] == 20.0
