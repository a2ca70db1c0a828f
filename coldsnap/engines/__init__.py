"""Engine adapters (one per `launch.engine`) and worker discovery from a host's processes
(discovery; its one simulation seam, the GPU simulator's state, is simulated_gpus)."""

from coldsnap.engines.base import (
    EngineAdapter,
    EngineCallFailed,
    EngineEndpoint,
    KvRelease,
    master_addr,
    master_port,
)
from coldsnap.engines.sglang import SglangAdapter
from coldsnap.engines.vllm import VllmAdapter

_ADAPTERS: dict[str, EngineAdapter] = {"vllm": VllmAdapter(), "sglang": SglangAdapter()}


def adapter_for(engine: str) -> EngineAdapter:
    """The adapter for a request's `launch.engine`; KeyError names the unknown engine."""
    try:
        return _ADAPTERS[engine]
    except KeyError:
        raise KeyError(f"no engine adapter for {engine!r} (known: "
                       f"{', '.join(sorted(_ADAPTERS))})") from None


__all__ = [
    "EngineAdapter",
    "EngineCallFailed",
    "EngineEndpoint",
    "KvRelease",
    "SglangAdapter",
    "VllmAdapter",
    "adapter_for",
    "master_addr",
    "master_port",
]
