"""The order of a restore (coldsnap.operations.restore.restore), on fakes: each phase replaced
by a recorder, the hosts by an object that only answers what restore() itself asks. The
phases' own work is the cluster tests' (test_operations_e2e, test_layouts); here, that restore()
runs them in the documented order, holds the devices only when it starts units, stops after
staging for prepare-only, and that a refusal stops it before anything is staged."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from types import SimpleNamespace
from typing import Any

import pytest

from coldsnap.capsule.errors import CriuProbeFailed, CriuProbeRefused
from coldsnap.formats.artifact import ROLE_REPLAY_PLAN, ArtifactObject, payload_path
from coldsnap.formats.errors import ValidationIssue
from coldsnap.hosts.registry.access import RegistryAccess
from coldsnap.operations import restore as restore_module
from coldsnap.operations import restore_target
from coldsnap.operations.context import OperationContext, OperationFailed
from coldsnap.operations.sources import RegistrySource
from coldsnap.store import LocalStore

FULL = ["target", "locks", "facts", "place", "devices", "refusals", "sessions", "check_free",
        "unit_runs", "check_space", "stage_and_admit", "say_replays", "start_and_validate",
        "sessions-closed", "locks-released"]


class FakeHosts:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def facts(self, names: Iterable[str]) -> dict[str, Any]:
        self.calls.append("facts")
        return {n: None for n in names}

    @contextlib.asynccontextmanager
    async def sessions(self, names: Iterable[str]) -> AsyncIterator[dict[str, Any]]:
        self.calls.append("sessions")
        try:
            yield {n: None for n in names}
        finally:
            self.calls.append("sessions-closed")


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    target = SimpleNamespace(warm=False, launch=None, per_host={}, sets={},
                             topology=SimpleNamespace(hosts=["host-0", "host-1"]))

    def record(name: str, result: Any = None) -> Any:
        def sync(*_: Any, **__: Any) -> Any:
            calls.append(name)
            return result

        return sync

    def arecord(name: str, result: Any = None) -> Any:
        async def run(*_: Any, **__: Any) -> Any:
            calls.append(name)
            return result

        return run

    class Locks:
        async def devices(self, _placed: Any) -> None:
            calls.append("devices")

    @contextlib.asynccontextmanager
    async def exclusive(*_: Any, **__: Any) -> AsyncIterator[Locks]:
        calls.append("locks")
        try:
            yield Locks()
        finally:
            calls.append("locks-released")

    async def listening(*_: Any) -> dict[str, set[int]]:
        return {}

    monkeypatch.setattr(restore_module, "resolve_target", record("target", target))
    monkeypatch.setattr(restore_module, "exclusive", exclusive)
    monkeypatch.setattr(restore_module, "listening_by_host", listening)
    monkeypatch.setattr(restore_module, "survey_hosts", lambda *_: {})
    monkeypatch.setattr(restore_module, "place_target", arecord("place", (["placed"], "plan")))
    monkeypatch.setattr(restore_module, "refuse_or_replay", record("refusals", {}))
    monkeypatch.setattr(restore_module, "check_free", arecord("check_free", {}))
    monkeypatch.setattr(restore_module, "_unit_runs", record("unit_runs", []))
    monkeypatch.setattr(restore_module, "check_room", arecord("check_space"))
    monkeypatch.setattr(restore_module, "_stage_and_admit", arecord("stage_and_admit", []))
    monkeypatch.setattr(restore_module, "_say_replays", record("say_replays", []))
    monkeypatch.setattr(restore_module, "_start_and_validate",
                        arecord("start_and_validate", ["answer"]))
    return calls


def _restore(calls: list[str], **options: Any) -> Any:
    stored = SimpleNamespace(artifact=None)
    return asyncio.run(restore_module.restore(
        stored, None, FakeHosts(calls), None, OperationContext("restore"),  # type: ignore[arg-type]
        source=None, **options))  # type: ignore[arg-type]


def test_a_restore_runs_its_phases_in_order(recorded: list[str]) -> None:
    outcome = _restore(recorded)
    assert recorded == FULL
    assert outcome.answers == ["answer"] and not outcome.prepared_only


def test_prepare_only_stages_and_starts_nothing(recorded: list[str]) -> None:
    """No device is held, no port checked (nothing will listen), nothing started."""
    outcome = _restore(recorded, prepare_only=True)
    assert recorded == [c for c in FULL
                        if c not in ("devices", "check_free", "start_and_validate")]
    assert outcome.prepared_only and outcome.answers == []


def test_a_refused_unit_stops_the_restore_before_any_session(
        recorded: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any) -> Any:
        recorded.append("refusals")
        raise OperationFailed("admission", "unit-0: refused")

    monkeypatch.setattr(restore_module, "refuse_or_replay", refuse)
    with pytest.raises(OperationFailed, match="unit-0: refused"):
        _restore(recorded)
    assert recorded == ["target", "locks", "facts", "place", "devices", "refusals",
                        "locks-released"]


def test_refusals_fail_the_restore_unless_the_fallback_replays(
        monkeypatch: pytest.MonkeyPatch) -> None:
    issue = ValidationIssue(path="launch.units[0]", message="gpu model differs")
    monkeypatch.setattr(restore_target, "admission_refusals",
                        lambda *_: {"unit-0": [issue]})
    t: Any = SimpleNamespace(artifact=None, launch=None, policy=None)
    with pytest.raises(OperationFailed, match="gpu model differs") as refused:
        restore_target.refuse_or_replay(t, {}, "none")
    assert refused.value.code == "admission"
    assert restore_target.refuse_or_replay(t, {}, "replay") == {"unit-0": [issue]}
    monkeypatch.setattr(restore_target, "admission_refusals", lambda *_: {})
    assert restore_target.refuse_or_replay(t, {}, "none") == {}


def test_a_warm_restore_refuses_units_that_would_be_replayed() -> None:
    """Before any unit is touched: nothing recorded, nothing started."""
    touched: list[Any] = []
    ctx = OperationContext("restore", journal=touched.append)
    runs: Any = [SimpleNamespace(placed=SimpleNamespace(unit_id="unit-1"),
                                 replay_reason="admission")]
    t: Any = SimpleNamespace(warm=True)
    with pytest.raises(OperationFailed, match="re-created natively: unit-1") as refused:
        asyncio.run(restore_module._start_and_validate(
            ctx, None, None, t, None, runs, ["unit-1"], None, 1.0))  # type: ignore[arg-type]
    assert refused.value.code == "warm-replay" and touched == []




def test_a_refusal_found_beside_the_staging_cancels_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pulled capsule's CRIU probe refuses while the objects still travel: the staging is
    cancelled (it would otherwise run for a minute), the cache locks are not released by
    this phase, the refusal is what the restore raises, and no unit is admitted after."""
    seen: list[str] = []

    async def staging(*_: Any, **__: Any) -> list[Any]:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append("staging cancelled")
            raise
        return []

    async def probe(_ctx: Any, _hosts: Any, _artifact: Any, some: list[Any], *_: Any,
                    **__: Any) -> None:
        seen.append(f"admit {[r.placed.unit_id for r in some]}")
        if some:
            refusal = CriuProbeRefused("host-1", "unit-0", "criu-probe", "vDSO")
            raise OperationFailed("admit-failed", str(refusal)) from refusal

    monkeypatch.setattr(restore_module, "_stage", staging)
    monkeypatch.setattr(restore_module, "_load_and_probe", probe)
    monkeypatch.setattr(restore_module, "ProbeCache", lambda _root: None)
    locks = SimpleNamespace(release_cache=lambda: seen.append("cache released"))
    pulled = SimpleNamespace(placed=SimpleNamespace(unit_id="unit-0"),
                             capsule_meta=SimpleNamespace(pushed=True))
    t: Any = SimpleNamespace(source=None, per_host={}, sets={}, artifact=None,
                             policy=SimpleNamespace(compatibility=SimpleNamespace(kernel="x")))
    with pytest.raises(OperationFailed, match="criu-probe"):
        asyncio.run(asyncio.wait_for(restore_module._stage_and_admit(
            OperationContext("restore"), None, SimpleNamespace(root=None), t,  # type: ignore[arg-type]
            [pulled], {}, {}, locks, "none"), 10))  # type: ignore[arg-type]
    assert seen == ["admit ['unit-0']", "staging cancelled"]


def test_a_cancelled_staging_removes_what_it_half_wrote_on_every_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every host's transfers end first, then each host's partial objects go, also for a
    source whose partials a failed retry would resume (a registry's)."""
    seen: list[str] = []

    async def stage_host(host: str, *_: Any, **__: Any) -> Any:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)
            seen.append(f"{host} transfer ended")
            raise

    async def discard(host: str, data_dir: str, objects: list[str]) -> None:
        seen.append(f"{host} partials of {objects} in {data_dir} removed")

    monkeypatch.setattr(restore_module, "stage_host", stage_host)
    monkeypatch.setattr(restore_module, "discard_partial_objects", discard)
    hosts: Any = SimpleNamespace(host=lambda n: n, entries={
        n: SimpleNamespace(data_dir=f"/data/{n}") for n in ("host-0", "host-1")})
    ctx = OperationContext("restore")

    async def cancelled() -> None:
        surveys: Any = {n: asyncio.sleep(0) for n in ("host-0", "host-1")}
        task = asyncio.ensure_future(restore_module._stage(
            hosts, SimpleNamespace(keeps_partial=lambda o: True),  # type: ignore[arg-type]
            {"host-0": ["a"], "host-1": ["b"]}, {"host-0": [], "host-1": []}, ctx, surveys))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    assert sorted(seen[:2]) == ["host-0 transfer ended", "host-1 transfer ended"]
    assert sorted(seen[2:]) == ["host-0 partials of ['a'] in /data/host-0 removed",
                                "host-1 partials of ['b'] in /data/host-1 removed"]


def test_a_failed_registry_staging_keeps_only_the_partials_a_retry_resumes(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """A pull refused on one host fails its staging while the replay plan that the store sends
    beside it is half-way: the plan's partial file goes (nothing resumes it), the pulled
    blobs' stay for the retry; a host whose staging ended keeps everything."""
    digest = "sha256:" + "ab" * 32
    blob = ArtifactObject(role="weights", owner="worker/w0", path=payload_path(digest),
                          bytes=10, sha256=digest)
    plan_digest = "sha256:" + "cd" * 32
    plan = ArtifactObject(role=ROLE_REPLAY_PLAN, owner="worker/w0",
                          path=f"objects/replay/{plan_digest[7:]}.json", bytes=10,
                          sha256=plan_digest)
    removed: dict[str, list[str]] = {}

    async def stage_host(host: str, *_: Any, **__: Any) -> Any:
        if host == "host-0":
            raise OSError("unauthorized")
        return SimpleNamespace(host=host)

    async def discard(host: str, data_dir: str, objects: list[ArtifactObject]) -> None:
        removed[host] = [o.role for o in objects]

    monkeypatch.setattr(restore_module, "stage_host", stage_host)
    monkeypatch.setattr(restore_module, "discard_partial_objects", discard)
    hosts: Any = SimpleNamespace(host=lambda n: n, entries={
        n: SimpleNamespace(data_dir=f"/data/{n}") for n in ("host-0", "host-1")})
    source = RegistrySource(RegistryAccess("registry.test:5000", insecure=True), "repo",
                            store=LocalStore(tmp_path / "store"))

    async def staged() -> None:
        surveys: Any = {n: asyncio.sleep(0) for n in ("host-0", "host-1")}
        await restore_module._stage(hosts, source, {"host-0": [blob, plan],
                                                    "host-1": [blob, plan]},
                                    {"host-0": [], "host-1": []},
                                    OperationContext("restore"), surveys)

    with pytest.raises(OperationFailed, match="host host-0: step stage: unauthorized"):
        asyncio.run(staged())
    assert removed == {"host-0": [ROLE_REPLAY_PLAN]}


def test_only_a_probe_verdict_stops_the_staging() -> None:
    """A probe that ran and said no stops the staging; a probe that could not run (a lost
    host, a Docker error) and any other admission failure leave it to end and report."""
    def admit_failed(cause: Exception) -> OperationFailed:
        try:
            raise OperationFailed("admit-failed", str(cause)) from cause
        except OperationFailed as exc:
            return exc

    verdict = CriuProbeRefused("host-1", "unit-0", "criu-probe", "criu check exited 1")
    could_not_run = CriuProbeFailed("host-1", "unit-0", "criu-probe", "cannot run criu check")
    assert restore_module.probe_refused(admit_failed(verdict))
    assert restore_module.probe_refused(verdict)
    assert not restore_module.probe_refused(admit_failed(could_not_run))
    assert not restore_module.probe_refused(admit_failed(OSError("no route to host-3")))
