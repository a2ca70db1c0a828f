"""Which quiesce a capture asks of its engine: `policy.weights.mode` decides whether the
weights are released (so that the CRIU images exclude them), `policy.process.kv_discard`
whether the KV cache is dropped; an engine that cannot do what the policy asks is refused
before any unit starts."""

from __future__ import annotations

import pytest

from coldsnap.formats.request import ProcessPolicy, WeightsPolicy
from coldsnap.operations.units import discards_kv, releases_weights


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize(("mode", "released"), [
    ("auto", True), ("cache-only-auto", True), ("native", True), ("recovery", False)])
def test_weights_mode_decides_the_release(engine: str, mode: str, released: bool) -> None:
    assert releases_weights(WeightsPolicy.model_validate({"mode": mode}), engine) is released


def test_without_a_weights_policy_nothing_is_released() -> None:
    # A restore or a lifecycle operation: the capsule manifest says what the capture did.
    assert releases_weights(None, "vllm") is False


def test_kv_discard_false_keeps_the_kv_cache_where_the_engine_can() -> None:
    assert discards_kv(ProcessPolicy(), "vllm") is True
    assert discards_kv(None, "vllm") is True
    assert discards_kv(ProcessPolicy(kv_discard=False), "sglang") is False
    # vLLM's sleep on a GPU always drops it: accepted as the reference accepts it, and
    # dropped (the capsule manifest and the receipt's units[] say kv_discarded: true).
    assert discards_kv(ProcessPolicy(kv_discard=False), "vllm") is True
    assert discards_kv(ProcessPolicy(kv_discard=False), "vllm", "gpu") is True
    # On the CPU vLLM is drained, and keeps its KV cache unless the plugin releases it.
    assert discards_kv(ProcessPolicy(kv_discard=False), "vllm", "cpu") is False
    assert discards_kv(ProcessPolicy(), "vllm", "cpu") is True


@pytest.mark.parametrize(("engine", "asked", "discarded"), [
    ("vllm", True, True), ("vllm", False, False), ("sglang", False, False),
    ("sglang", True, True)])
def test_a_unit_found_to_run_on_the_cpu_decides_its_kv_discard_again(
        engine: str, asked: bool, discarded: bool) -> None:
    """A unit is placed before its capsule says it runs on the CPU: placed with vLLM, the
    policy's kv_discard: false reads as a GPU's (dropped anyway), and is decided again once
    the capsule's label is read."""
    from coldsnap.capsule.spec import UnitSpec, on_cpu
    from coldsnap.formats.request import Validation

    placed = UnitSpec(unit_id="unit-0", image="r/x@sha256:" + "a" * 64,
                      image_digest="sha256:" + "a" * 64, command=("vllm", "serve", "/m"),
                      devices=(), workers=(), validation=Validation(), engine=engine,
                      discard_kv=discards_kv(ProcessPolicy(kv_discard=asked), engine),
                      kv_discard_asked=asked, release_weights=True)
    cpu = on_cpu(placed)
    assert (cpu.accelerator, cpu.drains, cpu.release_weights) == ("cpu", True, False)
    assert cpu.discard_kv is discarded

