"""The unit's engine through its adapter (coldsnap.engines), reached from its own host: where
it serves, its workers found from the host's view of its processes, the one readiness poll,
quiesce (drain or sleep), resume (wake), the validation prompt, and a unit of a failed
capture back to serving."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from coldsnap.capsule.containers import container_host_pids, pids_alive
from coldsnap.capsule.errors import EngineNotReady, QuiesceFailed, ValidationFailed
from coldsnap.capsule.gpu_checkpoint import gpu_return_to_running
from coldsnap.capsule.handle import UnitHandle, fail
from coldsnap.capsule.images import clear_dump
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import ENGINE_LOG
from coldsnap.engines import (
    EngineAdapter,
    EngineCallFailed,
    EngineEndpoint,
    KvRelease,
    adapter_for,
    discovery,
)
from coldsnap.engines.base import kv_release
from coldsnap.hosts.http import HttpAnswer


@dataclass(frozen=True)
class ValidationResult:
    unit_id: str
    text: str
    seconds: float


def endpoint(s: CapsuleSession, handle: UnitHandle) -> tuple[EngineAdapter, EngineEndpoint]:
    """The unit's engine adapter and where its engine serves, reached from its own host."""
    spec = handle.spec
    adapter = adapter_for(spec.engine)
    return adapter, EngineEndpoint(s.target.host, spec.address,
                                   adapter.serving_port(spec.command),
                                   adapter.api_key(spec.command, spec.environment))


async def discover_workers(s: CapsuleSession, handle: UnitHandle, step: str) -> dict[str, int]:
    """Map every worker of the unit to its PID inside the container, from the host's view of
    the unit's processes (coldsnap.engines.discovery); never from the engine's own word."""
    spec = handle.spec
    container = await s.container(handle.container_id, handle.unit, step)
    pids = await container_host_pids(s, container, handle.unit, step)
    try:
        if spec.accelerator == "cpu":
            return await discovery.discover_cpu_workers(
                s.target.host, pids, spec.workers, adapter_for(spec.engine).cpu_worker_titles)
        return await discovery.discover_workers(
            s.target.host, pids, spec.workers, handle.devices,
            simulated=spec.gpu_mode == "simulated")
    except discovery.DiscoveryError as exc:
        raise fail(s, handle.unit, step, str(exc), EngineNotReady) from None


# What an error message quotes of the engine's log at most: its last lines, read as its last
# bytes first, so that one endless line (the engine writes this file) is never read whole.
_LOG_TAIL_BYTES = 16 * 1024


async def engine_log_tail(s: CapsuleSession, container: Any, lines: int = 20) -> str:
    out = await s.exec(container, ["/usr/bin/tail", "-c", str(_LOG_TAIL_BYTES), ENGINE_LOG],
                       output_limit=_LOG_TAIL_BYTES)
    return "\n".join(out.stdout_tail.strip().splitlines()[-lines:])


async def poll_ready(adapter: EngineAdapter, ep: EngineEndpoint, health_path: str, *,
                     deadline: float, interval: float,
                     between: Callable[[], Awaitable[None]] | None = None) -> HttpAnswer:
    """Ask the engine's readiness probe until it answers 200 or `deadline` (time.monotonic())
    has passed, and return its last answer: the caller judges one that is not 200 and names
    its own error. `between` runs after every answer that is not 200, before the deadline is
    looked at (a starting engine's liveness check, which raises to end the poll)."""
    while True:
        ans = await adapter.ready(ep, health_path)
        if ans.status == 200:
            return ans
        if between is not None:
            await between()
        if time.monotonic() > deadline:
            return ans
        await asyncio.sleep(interval)


async def wait_ready(
    s: CapsuleSession, handle: UnitHandle, *, timeout_s: float = 600.0, interval: float = 0.2
) -> dict[str, int]:
    """Wait until the engine's readiness probe answers 200 on its host, then map its workers
    to PIDs from the host's view of the unit's processes."""
    step = "wait-ready"
    spec = handle.spec
    adapter, ep = endpoint(s, handle)
    container = await s.container(handle.container_id, handle.unit, step)
    deadline = time.monotonic() + timeout_s
    assert handle.engine_pid is not None
    engine_pid = handle.engine_pid

    async def engine_alive() -> None:
        if not await pids_alive(s, container, [engine_pid]):
            raise fail(s, handle.unit, step, "engine exited before it was healthy:\n"
                       + await engine_log_tail(s, container), EngineNotReady)

    if not adapter.serves_api(spec.command):
        handle.worker_pids = await _wait_headless(s, handle, step, deadline, interval,
                                                  engine_alive)
        return dict(handle.worker_pids)
    ans = await poll_ready(adapter, ep, spec.validation.health_path, deadline=deadline,
                           interval=interval, between=engine_alive)
    if ans.status != 200:
        raise fail(s, handle.unit, step,
                   f"{ep}{spec.validation.health_path} not ready after {timeout_s:.0f}s "
                   f"(last: {ans.describe()})", EngineNotReady)
    handle.worker_pids = await discover_workers(s, handle, step)
    return dict(handle.worker_pids)


async def _wait_headless(s: CapsuleSession, handle: UnitHandle, step: str, deadline: float,
                         interval: float, alive: Callable[[], Awaitable[None]]
                         ) -> dict[str, int]:
    """A headless unit has no readiness probe: it is ready once its workers' processes are
    found; the head's probe answers 200 only once they have joined its groups."""
    while True:
        try:
            return await discover_workers(s, handle, step)
        except EngineNotReady as exc:
            await alive()
            if time.monotonic() > deadline:
                raise fail(s, handle.unit, step, f"headless unit: {exc.detail}",
                           EngineNotReady) from None
        await asyncio.sleep(interval)


async def quiesce(s: CapsuleSession, handle: UnitHandle) -> None:
    """Put the engine to sleep through its own surface: requests drained, cross-worker
    connections closed, the KV cache (`discard_kv`) and the weights (`release_weights`)
    released. An engine without sleep (the CPU) is drained, then its KV cache released
    where the engine can (`handle.kv_release` says what it gave back)."""
    adapter, ep = endpoint(s, handle)
    if not adapter.serves_api(handle.spec.command):
        return  # headless: its head's quiesce stops the work its workers do
    try:
        if handle.spec.drains:
            await adapter.drain(ep)
            if handle.spec.discard_kv:
                handle.kv_release = await _release_kv(s, handle, adapter)
        else:
            await adapter.quiesce(ep, release_weights=handle.spec.release_weights,
                                  discard_kv=handle.spec.discard_kv)
    except EngineCallFailed as exc:
        raise fail(s, handle.unit, "quiesce", f"{ep}: {exc}", QuiesceFailed) from None


# How long the engine may take to answer its KV release (every worker's madvise).
_KV_RELEASE_S = 180.0


async def _release_kv(s: CapsuleSession, handle: UnitHandle,
                      adapter: EngineAdapter) -> KvRelease | None:
    """The engine's KV cache released by its own command, run in the unit's container (not
    through a route another engine on the host could call); None: the engine has none."""
    argv = adapter.kv_release_argv(handle.spec.accelerator)
    if argv is None:
        return None
    container = await s.container(handle.container_id, handle.unit, "quiesce")
    out = await s.exec(container, argv, timeout_s=_KV_RELEASE_S)
    return kv_release(out.exit_status, out.stdout_tail, out.stderr)


async def resume(s: CapsuleSession, handle: UnitHandle, *, step: str = "resume") -> None:
    """Wake the engine (after a failed capture, or to release a restored unit): it reads any
    new placement, rebuilds its cross-worker connections and, when its quiesce released
    them, reloads its weights from its model directory."""
    spec = handle.spec
    adapter, ep = endpoint(s, handle)
    if spec.drains or not adapter.serves_api(spec.command):
        # A drained engine was never put to sleep, and a headless unit is woken through its
        # head: there is nothing to wake.
        return
    model_dir = adapter.model_dir(spec.command) if spec.release_weights else None
    try:
        await adapter.resume(ep, model_dir=model_dir, discard_kv=spec.discard_kv)
    except EngineCallFailed as exc:
        raise fail(s, handle.unit, step, f"{ep}: {exc}") from None



async def release(s: CapsuleSession, handle: UnitHandle) -> None:
    """Wake the restored engine: it reads the placement, rebuilds its cross-worker
    connections and reopens intake."""
    await resume(s, handle, step="release")


async def return_to_serving(s: CapsuleSession, handle: UnitHandle) -> None:
    """Roll a unit of a failed capture back: GPUs restored and unlocked, intake reopened.
    Safe at any point after `start_unit`, also after a successful `dump`."""
    step = "rollback"
    container = await s.container(handle.container_id, handle.unit, step)
    problems = await gpu_return_to_running(s, container, handle.worker_pids)
    if problems:
        raise fail(s, handle.unit, step, "; ".join(problems))
    await resume(s, handle, step=step)
    # A dump left beside a serving container is the engine's memory, kept for nothing (after
    # a commit it lives in the capsule's objects; after a failure it is never used).
    await clear_dump(s.target.host, handle.images_dir)



# Between two validation prompts answered 503 (see validate).
_PROMPT_RETRY_S = 0.25


async def validate(s: CapsuleSession, handle: UnitHandle, *,
                   timeout_s: float = 120.0) -> ValidationResult:
    """The readiness probe answers 200, then the validation prompt gets the expected text
    (asked again while the engine answers it 503, until `timeout_s`); both sent from the
    unit's own host to its engine's port."""
    step = "validate"
    spec = handle.spec
    adapter, ep = endpoint(s, handle)
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    ans = await poll_ready(adapter, ep, spec.validation.health_path, deadline=deadline,
                           interval=0.1)
    if ans.status != 200:
        raise fail(s, handle.unit, step, f"{ep}{spec.validation.health_path} not ready: "
                   f"{ans.describe()}", ValidationFailed)
    while True:
        left = max(5.0, deadline - time.monotonic())
        try:
            text = await adapter.complete(ep, spec.validation.prompt, timeout=left)
            break
        except EngineCallFailed as exc:
            # The head's readiness probe speaks for its own workers only: a group formed on
            # another unit of the service may still be reconnecting after a restore, and the
            # engine says so with 503 (unavailable, for now). Asked again until the deadline;
            # any other answer is final.
            if exc.status == 503 and time.monotonic() + _PROMPT_RETRY_S < deadline:
                await asyncio.sleep(_PROMPT_RETRY_S)
                continue
            raise fail(s, handle.unit, step, f"{ep}: validation prompt: {exc}; expected "
                       f"{spec.validation.expected!r}", ValidationFailed) from None
    if text.strip() != spec.validation.expected.strip():
        raise fail(s, handle.unit, step, f"{ep}: validation prompt got {text!r}; expected "
                   f"{spec.validation.expected!r}", ValidationFailed)
    return ValidationResult(handle.unit, text, time.monotonic() - t0)
