"""The service's jobs in flight: admission, conflicts, the queue, cancellation and the drain.

Two jobs conflict when they share a (host, unit), a GPU or a listen port of one host (for the
jobs that start units), or a capture id (`Touches.shared_with`). A job
waits until no running job and no job queued before it conflicts with it (first come, first
served: a later job never overtakes an earlier one on the same units); jobs on disjoint units
run at once. With `wait: false` a job that would wait is refused instead, and nothing of it is
recorded: its id stays free. The check looks each of the job's keys up in an index of the jobs
holding it (coldsnap.service.conflicts): its cost does not grow with the queue.

The queue is bounded by the policy's `queue` caps: a uid's jobs queued or running
(`max_per_uid`, root exempt) and everyone's (`max_total`). A submission past either is answered
429 naming the cap, before anything of it is read, and again at its admission (the count
may have grown while it was prepared).

A submission is decoded and prepared (its artifact file read, references resolved, store
objects hashed) in a small pool of threads of its own, never on the loop: a slow or hostile
input delays only its own answer. A submission that imports a published artifact from a
registry is prepared in a second pool (IMPORT_THREADS): a slow registry holds only imports.
Its admission (the checks above, the claim of its id, its place in the queue) then runs one
submission at a time, in the order they were prepared.

The job store is the service's memory of its jobs, not their truth: each operation's outcome
and receipt are its ledger record's (coldsnap.runner.ledger). A write to the store that fails
("database is locked", a full disk) is said in the journal and never holds a job: a job still
starts, and still ends (its followers get its end, it leaves the active set); the row's end is
written again at the next job's admission or end. A job whose row cannot be added is not
accepted, and its id is given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from coldsnap.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from coldsnap.formats.redaction import redact, secret_values
from coldsnap.formats.service_policy import ServicePolicy
from coldsnap.logs import get_logger
from coldsnap.runner.claim import Claim, claim, release
from coldsnap.runner.ledger import state_of
from coldsnap.runner.operation_kinds import OPERATIONS
from coldsnap.runner.prepared import AlreadyDone, Prepared, Refused
from coldsnap.runner.service_api import JobState
from coldsnap.service.conflicts import ConflictIndex
from coldsnap.service.job import Ended, Job
from coldsnap.service.job_store import JobStore
from coldsnap.service.metrics import Metrics
from coldsnap.service.output import JobOutput
from coldsnap.service.submission import (
    Submission,
    SubmissionInvalid,
    decode_submission,
    imports_from_registry,
    parse_submission,
)
from coldsnap.service.submitter_checks import shares_artifacts, submission_refusals

# After the drain's grace period, how long the cancelled jobs' rollbacks may take (each
# rollback bounds itself at about 150 s; this is the backstop).
ROLLBACK_BACKSTOP_S = 300.0

# How many ended jobs' lines stay in memory for late followers.
KEEP_OUTPUTS = 100

# How long a drained service stays up for a client to fetch the artifact of a capture that
# ended during the drain (its end item said so; the client writes the request's `output`).
ARTIFACT_GRACE_S = 10.0

# Submissions prepared at once (each may read an artifact file and hash store objects); a
# pool of their own, so that they never take the threads the running jobs use.
SUBMISSION_THREADS = 4
# Submissions whose artifact is a registry reference are prepared in a pool of their own: an
# import waits on a remote registry (up to its deadline), and must not hold the threads that
# every other submission's intake needs.
IMPORT_THREADS = 2

Reply = tuple[int, dict[str, Any]]


def _journal() -> Any:
    # Made when used: a logger bound at import would keep the logging configuration of
    # before `serve` configured it (the service's journal is its stderr).
    return get_logger(component="scheduler")


class _Refusal(Exception):
    """A submission refused while it was prepared, with the reply that says why."""

    def __init__(self, status: int, doc: dict[str, Any]) -> None:
        super().__init__(status)
        self.reply: Reply = (status, doc)


def _queue_full(policy: ServicePolicy, uid: int, mine: int, total: int) -> Reply | None:
    """The 429 reply when one more job of `uid` would pass a cap of `policy.queue`, or None.
    `mine`, `total`: the jobs of `uid`, and of everyone, queued or running now."""
    caps = policy.queue
    if total >= caps.max_total:
        why = (f"queue.max_total: coldsnapd holds {total} jobs queued or running, its policy's "
               f"cap ({caps.max_total}); submit again when some have ended")
    elif uid != 0 and mine >= caps.max_per_uid:
        why = (f"queue.max_per_uid: uid {uid} has {mine} jobs queued or running, the policy's "
               f"cap per uid ({caps.max_per_uid}); submit again when some have ended")
    else:
        return None
    return 429, {"error": why, "exit_status": EXIT_FAILED}


def _shutting_down() -> Reply:
    return 503, {"error": "coldsnapd is shutting down and accepts no job",
                 "exit_status": EXIT_FAILED}


class Scheduler:
    def __init__(self, store: JobStore, metrics: Metrics, *, inventory: Path, store_root: Path,
                 on_change: Callable[[], None] = lambda: None,
                 policy: ServicePolicy | None = None) -> None:
        self.jobs = store
        # What a submission may name (coldsnap.formats.service_policy); without a policy
        # file only root submits, unrestricted.
        self.policy = policy if policy is not None else ServicePolicy.root_only()
        self.metrics = metrics
        self.inventory = inventory
        self.store_root = store_root
        self.on_change = on_change
        self.active: dict[str, Job] = {}  # queued and running, in submission order
        self.conflicts = ConflictIndex()  # what each of `active` holds, for the queue's order
        self.per_uid: dict[int, int] = {}  # how many of `active` each uid submitted
        self.outputs: dict[str, JobOutput] = {}  # every job this process ran, to follow
        # A succeeded capture's artifact document, until its output is let go; the jobs whose
        # client writes it to an `output`, and those of them it has not fetched yet.
        self.artifacts: dict[str, dict[str, Any]] = {}
        self.wants_artifact: set[str] = set()
        self.unfetched: set[str] = set()
        self._all_fetched = asyncio.Event()
        self._all_fetched.set()
        self.recovering = True
        self.draining = False
        self.unclean: list[str] = []  # jobs that did not end cleanly (drain exit status)
        self._threads = ThreadPoolExecutor(SUBMISSION_THREADS, thread_name_prefix="submission")
        self._imports = ThreadPoolExecutor(IMPORT_THREADS, thread_name_prefix="import")
        self._admitting = asyncio.Lock()
        # Starts and ends of jobs that the job store could not write yet, by job id, in
        # order (written again later; a job's end replaces its unwritten start).
        self.unrecorded: dict[str, Callable[[], None]] = {}

    @property
    def running(self) -> list[Job]:
        return [j for j in self.active.values() if j.running]

    @property
    def queued(self) -> list[Job]:
        return [j for j in self.active.values() if not j.running]

    def status_line(self) -> str:
        state = "draining; " if self.draining else "recovering; " if self.recovering else ""
        return f"{state}{len(self.running)} job(s) running, {len(self.queued)} queued"

    async def submit(self, body: bytes, uid: int) -> Reply:
        """Admit one submission (the POST body). What reads the user's input (decoding,
        the operation's `prepare`: its artifact file, references, hashes of store objects)
        runs in the submission threads, so that no input stalls the loop and the jobs on it;
        what orders jobs (conflicts, the queue) runs on the loop."""
        if self.draining:
            return _shutting_down()
        # Before anything of it is read: a full queue costs a flood nothing but this count.
        full = _queue_full(self.policy, uid, self.per_uid.get(uid, 0), len(self.active))
        if full is not None:
            return full
        loop = asyncio.get_running_loop()
        output = JobOutput(loop)
        try:
            sub = await loop.run_in_executor(self._threads, self._parse, body, output, uid)
            pool = self._imports if imports_from_registry(sub) else self._threads
            prepared = await loop.run_in_executor(pool, self._prepare, sub, output, uid)
        except _Refusal as refusal:
            return refusal.reply
        key = prepared.key
        # One admission at a time from here: the checks below stay true until the job is in
        # `active` (jobs that end meanwhile only make them looser).
        async with self._admitting:
            if self.draining:
                return _shutting_down()
            if key.operation_id in self.active:
                return 409, {"error": f"job {key.operation_id} is already queued or running",
                             "exit_status": EXIT_BAD_INPUT}
            full = _queue_full(self.policy, uid, self.per_uid.get(uid, 0), len(self.active))
            if full is not None:
                return full
            blockers = self.conflicts.waits_for(prepared.touches)
            if blockers and not sub.wait:
                return 409, {"error": f"{sub.operation} {key.operation_id} would wait for "
                                      f"{blockers}; refused (wait: false)",
                             "exit_status": EXIT_BAD_INPUT}
            try:
                held = await loop.run_in_executor(self._threads, claim, prepared,
                                                  sub.outputs())
            except Refused as exc:
                return 400, {"error": str(exc), "exit_status": EXIT_BAD_INPUT}
            except AlreadyDone as done:
                return 200, {"already": done.receipt.to_json(), "exit_status": EXIT_OK}
            try:
                job = self._admit(sub, prepared, held, uid, output)
            except (sqlite3.Error, OSError) as exc:
                release(prepared, held)
                _journal().error("jobs.add-failed", job=key.operation_id, error=str(exc))
                return 503, {"error": f"coldsnapd could not record {sub.operation} "
                                      f"{key.operation_id} in its job store ({exc}); nothing "
                                      "ran and the id is free to submit again",
                             "exit_status": EXIT_FAILED}
            if sub.request is not None and sub.request.output:
                self.wants_artifact.add(job.id)
        return 201, {"job": job.id, "state": "running" if job.running else "queued",
                     "waiting_for": job.waiting_for}

    def _parse(self, body: bytes, output: JobOutput, uid: int) -> Submission:
        """In a submission thread: the submission, held to the policy, or _Refusal with the
        reply that says why not."""
        try:
            sub = parse_submission(decode_submission(body))
        except SubmissionInvalid as exc:
            raise _Refusal(400, {"error": "invalid submission", "lines": exc.lines,
                                 "exit_status": EXIT_BAD_INPUT}) from None
        refusals = submission_refusals(self.policy, sub, uid)
        if refusals:
            raise _Refusal(400, {"error": "refused by the service's policy", "lines": refusals,
                                 "exit_status": EXIT_BAD_INPUT})
        output.secrets = secret_values(sub.request.canonical()) if sub.request else ()
        return sub

    def _prepare(self, sub: Submission, output: JobOutput, uid: int) -> Prepared:
        """In a submission thread (an import thread for a registry reference): the
        submission's prepared operation, or _Refusal with the reply that says why not."""
        # Why the operation cannot run is sent back, as the CLI would print it.
        try:
            return OPERATIONS[sub.operation].prepare(
                sub.run_options(self.inventory, self.store_root, uid=uid, policy=self.policy,
                                shares_artifacts=shares_artifacts(self.policy, uid)),
                sub.request)
        except Refused as exc:
            output.write("stderr", f"coldsnapd: {exc}\n")
        except Exception as exc:  # an inventory or store the service cannot read
            output.write("stderr", f"coldsnapd: {type(exc).__name__}: {exc}\n")
        output.end({})
        raise _Refusal(400, {"error": "refused", "lines": output.lines(),
                             "exit_status": EXIT_BAD_INPUT})

    def _admit(self, sub: Submission, prepared: Prepared, held: Claim, uid: int,
               output: JobOutput) -> Job:
        job = Job(prepared, held, uid, output, self._ended,
                  verbose=bool(sub.options.get("verbose")))
        t = prepared.touches
        self._write_unrecorded()
        # Stored redacted: the job store is what job views show. The sha256 is the full
        # request's, computed when it was parsed.
        self.jobs.add(id=job.id, operation=sub.operation,
                      request=redact(sub.request.canonical()) if sub.request else None,
                      request_sha256=prepared.key.request_sha256,
                      options={**sub.options, "engine": prepared.engine,
                               "snapshot_driver": prepared.snapshot_driver,
                               "id_generated": prepared.id_generated},
                      uid=uid, units=t.units, captures=t.captures)
        self.active[job.id] = job
        self.conflicts.add(job.id, t)
        self.per_uid[uid] = self.per_uid.get(uid, 0) + 1
        self.outputs[job.id] = output
        # A job admitted last changes what no earlier job waits for: only it is looked at.
        self._start_or_wait(job)
        self.on_change()
        if self.draining and not job.running:  # the drain began while its id was claimed
            job.cancel(signal.SIGTERM, "coldsnapd is shutting down")
        return job

    def pump(self) -> None:
        """Start every queued job that waits for nothing; say what the others wait for."""
        for job in self.queued:
            self._start_or_wait(job)
        self.on_change()

    def _start_or_wait(self, job: Job) -> None:
        """Start the queued `job` when it waits for nothing, else say what it waits for."""
        if job.cancel_signal is not None:
            return
        waits = "crash recovery" if self.recovering else \
            self.conflicts.waits_for(job.prepared.touches, job.id)
        if waits is None:
            started_ns = time.time_ns()

            def started(job_id: str = job.id, ns: int = started_ns) -> None:
                self.jobs.started(job_id, ns)

            # Written again later when refused: after a crash, recovery rolls back the
            # jobs whose row says running.
            if not self._write("started", job.id, started):
                self.unrecorded[job.id] = started
            job.waiting_for = None
            job.start()
        elif waits != job.waiting_for:
            job.waiting_for = waits
            self._write("waiting", job.id, self.jobs.waiting, job.id, waits)
            job.say(f"{job.prepared.operation} {job.id} waits for {waits}")

    def _ended(self, job: Job, ended: Ended) -> None:
        receipt = ended.receipt
        error = receipt.error
        state: JobState = state_of(receipt)
        self._write_unrecorded()

        def finished() -> None:
            self.jobs.finished(job.id, state, exit_status=ended.exit_status,
                               error_code=error.code if error else None)

        self.unrecorded.pop(job.id, None)
        if not self._write("finished", job.id, finished):
            self.unrecorded[job.id] = finished
        if any(u.outcome == "failed" for u in ended.ctx.record.rollback or ()):
            self.unclean.append(job.id)
        self.metrics.job_ended(receipt, ended.ctx)
        end: dict[str, Any] = {"exit_status": ended.exit_status, "receipt": receipt.to_json()}
        if ended.artifact is not None:
            # The client writes it to the request's `output`, as its user: it asks for it
            # (GET /v1/jobs/ID/artifact, the submitter's and root's only), since the document
            # holds the request's environment, which no job view shows.
            self.artifacts[job.id] = ended.artifact
            end["artifact"] = True
            if job.id in self.wants_artifact:
                self.unfetched.add(job.id)
                self._all_fetched.clear()
        self.wants_artifact.discard(job.id)
        job.output.end(end)
        if self.active.pop(job.id, None) is not None:
            self.conflicts.remove(job.id)
            left = self.per_uid.get(job.uid, 1) - 1
            if left > 0:
                self.per_uid[job.uid] = left
            else:
                self.per_uid.pop(job.uid, None)
        # Followers of older jobs get their end from the job store; their lines are let go.
        ended_ids = [i for i in self.outputs if i not in self.active]
        for old in ended_ids[:max(len(ended_ids) - KEEP_OUTPUTS, 0)]:
            del self.outputs[old]
            self.artifacts.pop(old, None)
            self.artifact_fetched(old)
        self.pump()

    def _write(self, what: str, job_id: str, write: Callable[..., None], *args: Any) -> bool:
        """One write to the job store; False, said in the journal, when it failed."""
        try:
            write(*args)
        except (sqlite3.Error, OSError) as exc:
            _journal().error("jobs.write-failed", job=job_id, write=what, error=str(exc))
            return False
        return True

    def _write_unrecorded(self) -> None:
        """Write again what the job store refused before; stop at the first refusal (each
        may wait for the store's busy timeout)."""
        for job_id, write in list(self.unrecorded.items()):
            if not self._write("again", job_id, write):
                return
            del self.unrecorded[job_id]

    def cancel(self, job_id: str, uid: int, sig: signal.Signals) -> Reply:
        job = self.active.get(job_id)
        row = self.jobs.get(job_id) if job is None else None
        # Another user's job is answered as absent, as `jobs show` answers it.
        owner = job.uid if job is not None else row.uid if row is not None else None
        if owner is None or uid not in (0, owner):
            return 404, {"error": f"no job {job_id}"}
        if job is None:
            assert row is not None
            return 409, {"error": f"job {job_id} already ended: {row.state}"}
        return 202, {"message": job.cancel(sig, f"cancel asked by uid {uid}")}

    async def drain(self, grace_s: float, hurry: asyncio.Event | None = None) -> bool:
        """Stop taking jobs, cancel the queued ones, give the running ones `grace_s` to end
        (less when `hurry` is set meanwhile), then cancel them: their rollback is shielded
        and bounded. True when every job ended and no rollback failed."""
        self.draining = True
        self.on_change()
        for job in self.queued:
            job.cancel(signal.SIGTERM, "coldsnapd is shutting down")
        deadline = time.monotonic() + grace_s
        while self.running and time.monotonic() < deadline and not (hurry and hurry.is_set()):
            tasks = [j.task for j in self.running if j.task is not None]
            await asyncio.wait(tasks, timeout=min(1.0, max(deadline - time.monotonic(), 0)))
        for job in self.running:
            job.cancel(signal.SIGTERM, "coldsnapd is shutting down (its drain period is over)")
        tasks = [j.task for j in self.running if j.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=ROLLBACK_BACKSTOP_S)
            self.unclean.extend(t.get_name() for t in pending)
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._imports.shutdown(wait=False, cancel_futures=True)
        # A capture that ended meanwhile: its client fetches the artifact after the end item.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_fetched.wait(), ARTIFACT_GRACE_S)
        return not self.unclean and not self.active

    def artifact_fetched(self, job_id: str) -> None:
        """The client of `job_id` has its artifact (or it is let go): nothing to wait for."""
        self.unfetched.discard(job_id)
        if not self.unfetched:
            self._all_fetched.set()
