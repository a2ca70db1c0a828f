"""CRIU restore of a unit's engine tree inside its fresh container, in one exec: the unit's
/dev/shm put back, the placement seeded, CRIU (lazy pages or full), the PID check and, given
the device map, each worker's GPU state restored and unlocked."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from coldsnap.capsule.criu_dump import criu_flags
from coldsnap.capsule.criu_log import criu_errors
from coldsnap.capsule.errors import RestoreFailed
from coldsnap.capsule.gpu_checkpoint import CUDA_CHECKPOINT, device_map_args
from coldsnap.capsule.handle import UnitHandle, fail
from coldsnap.capsule.placement import PLACEMENT_ARG_MAX, placement_bytes, seed_placement
from coldsnap.capsule.session import LONG_DOCKER_CALL, CapsuleSession
from coldsnap.capsule.socket_images import PROGRAM as REWRITE_PROGRAM
from coldsnap.capsule.spec import (
    CRIU,
    CRIU_IMAGES_DIR,
    CRIU_WORK_DIR,
    ENGINE_LOG,
    ENGINE_LOG_MODE,
    PLACEMENT_FILE,
    PYTHON,
    RUNTIME_DIR,
    SH,
    SHM_DIR,
    SHM_IMAGE,
    writable_image,
)
from coldsnap.formats.capsule import CriuImageSet

log = structlog.get_logger("coldsnap.capsule")


@dataclass(frozen=True)
class RestoreResult:
    unit_id: str
    seconds: float  # the in-container `criu restore` alone



# The exec's arguments: $1 the images (mounted read-only), $2 CRIU's work directory (its logs,
# the lazy-pages socket), $3 the PIDs that must run afterwards, $4 cuda-checkpoint, $5 the
# workers whose GPU state is restored in the same exec (empty: left checkpointed), $6 the
# placement the engine reads on wake (empty: none to write), $7 the CRIU options its dump used
# (criu_flags of the unit as captured: fixed words, split on purpose), and the rest the
# --device-map arguments.
_ARGS = ('images=$1 work=$2 pids=$3 cuda=$4 workers=$5 placement=$6 criu_flags=$7\n'
         'shift 7\n')
# Written before CRIU brings the engine back, so no reader can see half of it. A Docker
# `put_archive` beside the exec did the same, but its work in dockerd (a process started in
# the container's root) slowed the restore beside it by about 0.1 s on a 2-CPU host.
_SEED_FAILED = 96
_SEED = (f'[ -z "$placement" ] || (umask 077 && mkdir -p {RUNTIME_DIR} && '
         f'printf %s "$placement" > {RUNTIME_DIR}/{PLACEMENT_FILE}) || exit {_SEED_FAILED}\n')
# The engine's stdout is reopened on ENGINE_LOG, which CRIU accepts only with the mode it dumped:
# the rootfs's own file gets it here; a host's workload.log_path mounted there is the user's,
# never chmod-ed (coldsnap.capsule.containers.ensure_host_file checks its mode instead).
_PREPARE = 'mkdir -p "$work"\n'
_PREPARE_LOG = f': >> {ENGINE_LOG} && chmod {ENGINE_LOG_MODE} {ENGINE_LOG}\n'
# The unit's /dev/shm as the dump left it (SHM_IMAGE, when the engine had anything there):
# emptied, then put back exactly, before every restore. CRIU reopens those files by path and
# deletes the link-remap files it made at dump once a restore succeeds, so a second restore
# from the same images needs them back as well.
_SHM_FAILED = 93
_SHM_RESTORE = (f'if [ -f "$images/{SHM_IMAGE}" ]; then\n'
                f'  find {SHM_DIR} -mindepth 1 -delete && tar -C {SHM_DIR} --numeric-owner '
                f'-xSpf "$images/{SHM_IMAGE}" || exit {_SHM_FAILED}\n'
                'fi\n')


def _writable_restore(handle: UnitHandle) -> str:
    """Each writable path of the container (a volume holding the image's content) gets what
    the dump archived of it, over that content."""
    return "".join(
        f'[ ! -f "$images/{writable_image(p)}" ] || tar -C {shlex.quote(p)} --numeric-owner '
        f'-xSpf "$images/{writable_image(p)}" || exit {_SHM_FAILED}\n'
        for p in handle.writable)
# Lazy restore: a `criu lazy-pages` daemon in the fresh container serves the tree's memory from
# the images on first touch (userfaultfd) and pushes the rest in the background, so the tree
# runs again before all of its memory is read back. The daemon's stdio goes to a file: with
# the exec's pipes it would hold the exec open until it exits.
_LAZY_RESTORE = f"""set -e
setsid {CRIU} lazy-pages -D "$images" -W "$work" -o lazy-pages.log </dev/null \\
  >>"$work/lazy-pages.out" 2>&1 &
i=0
until [ -S "$work/lazy-pages.socket" ]; do
  i=$((i + 1)); [ "$i" -le 1000 ] || {{ echo "lazy-pages daemon did not start" >&2; exit 97; }}
  sleep 0.01
done
{CRIU} restore -D "$images" -W "$work" -d --lazy-pages -o restore.log $criu_flags
set +e
"""
# A moved restore of an engine that keeps its sessions: the image set's socket entries are
# rewritten with the workload's address map (coldsnap.capsule.socket_images, run by the
# capsule's python3) into a copy in the work directory, every other file a symlink to the
# read-only original, which never changes (the same artifact restores again anywhere).
_REWRITE_FAILED = 95
_REWRITE = ('if [ -n "${COLDSNAP_ADDRESS_MAP:-}" ]; then\n'
            f'  {" ".join(PYTHON)} -c "$COLDSNAP_REWRITE_PROGRAM" rewrite "$images" "$work/images" '
            '"$COLDSNAP_ADDRESS_MAP" >"$work/rewrite.out" 2>&1 '
            f'|| {{ cat "$work/rewrite.out"; exit {_REWRITE_FAILED}; }}\n'
            '  images="$work/images"\n'
            'fi\n')
_FULL_RESTORE = (f'{CRIU} restore -D "$images" -W "$work" -d -o restore.log $criu_flags '
                 '|| exit $?\n')
_CHECK_PIDS = """gone=
for p in $pids; do test -d "/proc/$p" || { echo "missing $p"; gone=1; }; done
[ -z "$gone" ] || exit 0
"""
# Each worker's GPU state restored with the device map, then unlocked: all workers at once,
# each one's output in a file of its own; a failed one is named ("gpu-failed PID") with the
# tail of its output. In the restore's exec because an exec is a round trip to dockerd, and
# nothing needs every unit's tree back before any unit's GPUs.
_GPU_RESTORE = """running=
for p in $workers; do
  { "$cuda" --action restore --pid "$p" "$@" && "$cuda" --action unlock --pid "$p"; } \\
    >"$work/gpu-$p.out" 2>&1 &
  running="$running $!:$p"
done
rc=0
for job in $running; do
  wait "${job%%:*}" && continue
  rc=98; echo "gpu-failed ${job#*:}"; tail -c 400 "$work/gpu-${job#*:}.out"; echo
done
exit $rc
"""
_GPU_FAILED = 98

# A lazy restore pays for its page server (a process to start and a socket to wait for, about
# 50 ms here) and for a fault round trip at each first touch; it gains only when the images
# hold far more memory than the engine touches at once. A snapshot whose weights were
# released holds tens of MiB per worker: read back whole, it restored faster in the same runs.
LAZY_RESTORE_MIN_BYTES = 256 << 20


def lazy_restore_pays(images: CriuImageSet) -> bool:
    """Whether a unit's CRIU images are large enough for a lazy restore to pay."""
    return images.total_bytes >= LAZY_RESTORE_MIN_BYTES


async def criu_restore(s: CapsuleSession, handle: UnitHandle, *, lazy: bool = True,
                       gpus: Mapping[str, str] | None = None,
                       placement: Mapping[str, Any] | None = None,
                       address_map: Mapping[str, str] | None = None,
                       leave_stopped: bool = False) -> RestoreResult:
    """CRIU restore of the engine tree inside the fresh container. Afterwards the tree runs
    with its original PIDs and its intake closed; its GPUs are still checkpointed, unless
    `gpus` (captured device -> destination device) is given: then each worker's GPU state is
    restored with that map and unlocked in the same exec (`restore_gpus`, without the second
    round trip). `placement`, when given, is written where the engine reads it on wake, in
    the same exec and before CRIU runs (`seed_placement` without a Docker call of its own).

    `lazy` (default) restores with userfaultfd-backed lazy pages; `criu check --feature
    uffd-noncoop` in the capsule says whether the kernel allows it.

    `address_map` (old host address -> new, the whole workload's; empty or None: in place)
    rewrites the image set's sockets first, on a copy. `leave_stopped`: the tree is restored
    stopped, and runs only once `continue_tree` sends it SIGCONT (a workload whose units keep
    their sessions is released together, once every unit exists)."""
    step = "criu-restore"
    container = await s.container(handle.container_id, handle.unit, step)
    want = [p for p in [handle.engine_pid, *handle.worker_pids.values()] if p is not None]
    # A CPU engine's workers hold no GPU state: there is nothing to restore or unlock.
    cpu = handle.spec.accelerator == "cpu"
    workers = dict(handle.worker_pids) if gpus is not None and not cpu else {}
    seed = ""
    if placement is not None:
        data = placement_bytes(placement)
        if len(data) > PLACEMENT_ARG_MAX:
            # Too long for one argument (the kernel caps each at 128 KiB): its own Docker call.
            await seed_placement(s, handle, placement)
        else:
            seed = data.decode()
    t0 = time.monotonic()
    # Restore, the PID check and the GPU restore in one exec: each exec costs tens of ms.
    script = (_ARGS + _PREPARE + ("" if handle.spec.log_path else _PREPARE_LOG)
              + _SHM_RESTORE + _writable_restore(handle) + _SEED
              + (_REWRITE if address_map else "")
              + (_LAZY_RESTORE if lazy else _FULL_RESTORE)
              + _CHECK_PIDS + (_GPU_RESTORE if workers else ""))
    out = await s.exec(container, [
        SH, "-c", script, "sh", CRIU_IMAGES_DIR, CRIU_WORK_DIR, " ".join(map(str, want)),
        CUDA_CHECKPOINT, " ".join(map(str, workers.values())), seed,
        " ".join([*criu_flags(handle.spec), *(["--leave-stopped"] if leave_stopped else [])]),
        *device_map_args(gpus)],
        timeout_s=LONG_DOCKER_CALL,
        env={"COLDSNAP_ADDRESS_MAP": json.dumps(dict(address_map), sort_keys=True),
             "COLDSNAP_REWRITE_PROGRAM": REWRITE_PROGRAM} if address_map else None)
    seconds = time.monotonic() - t0
    if out.exit_status == _SHM_FAILED:
        raise fail(s, handle.unit, "shm", f"cannot put {SHM_DIR} or the writable paths "
                   f"{', '.join(handle.writable)} back: {out.tail(300)}", RestoreFailed)
    if out.exit_status == _REWRITE_FAILED:
        raise fail(s, handle.unit, "rewrite-sockets", f"cannot rewrite the image set's sockets "
                   f"with {dict(address_map or {})}: {out.tail(600)}", RestoreFailed)
    if out.exit_status == _SEED_FAILED:
        raise fail(s, handle.unit, "placement", f"cannot write {RUNTIME_DIR}/{PLACEMENT_FILE}: "
                   f"{out.tail(300)}", RestoreFailed)
    failed = {int(ln.split()[1]) for ln in out.stdout.splitlines()
              if ln.startswith("gpu-failed ") and ln.split()[1].isdigit()}
    if out.exit_status == _GPU_FAILED and failed:
        names = ", ".join(f"worker {w} (pid {p})" for w, p in workers.items() if p in failed)
        raise fail(s, handle.unit, "gpu-restore", f"{names}: {out.tail(800)}", RestoreFailed)
    if not out.ok:
        why = await criu_errors(s, container, f"{CRIU_WORK_DIR}/restore.log")
        raise fail(s, handle.unit, step, f"criu restore exited {out.exit_status}:\n{why}",
                   RestoreFailed)
    missing = [ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("missing ")]
    if missing:
        raise fail(s, handle.unit, step, f"restored, but processes {missing} are not running",
                   RestoreFailed)
    log.info("capsule.restored", host=s.host, unit=handle.unit, step=step,
             seconds=round(seconds, 3), gpus=bool(workers))
    return RestoreResult(handle.unit, seconds)


# SIGCONT to every process of the container but this exec's own shell: the restored tree
# (left stopped) and its init, which ignores it.
_CONTINUE = ('for p in /proc/[0-9]*; do p=${p#/proc/}; '
             '[ "$p" = $$ ] || kill -CONT "$p" 2>/dev/null; done\n')


async def continue_tree(s: CapsuleSession, handle: UnitHandle, *,
                        timeout_s: float = 30.0) -> None:
    """Let a tree restored with `leave_stopped` run."""
    step = "release-sessions"
    container = await s.container(handle.container_id, handle.unit, step)
    out = await s.exec(container, [SH, "-c", _CONTINUE], timeout_s=timeout_s)
    if not out.ok:
        raise fail(s, handle.unit, step, f"SIGCONT to the restored tree: {out.tail(300)}",
                   RestoreFailed)
