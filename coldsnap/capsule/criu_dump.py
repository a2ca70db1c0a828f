"""The CRIU dump of a unit's engine tree (`dump`), and what it runs inside the capsule beside
`criu dump` itself: the search for what CRIU cannot dump (io_uring), the archives of the unit's
/dev/shm and writable paths taken while the tree is frozen, and the options a unit's dump needs
(which its restore repeats)."""

from __future__ import annotations

import posixpath
import shlex
import time

import structlog

from coldsnap.capsule.criu_log import criu_errors
from coldsnap.capsule.engine_steps import return_to_serving
from coldsnap.capsule.errors import CapsuleError, DumpFailed
from coldsnap.capsule.handle import DumpResult, UnitHandle, fail
from coldsnap.capsule.images import clear_dump
from coldsnap.capsule.session import LONG_DOCKER_CALL, CapsuleSession
from coldsnap.capsule.spec import (
    CRIU,
    CRIU_IMAGES_DIR,
    CRIU_WORK_DIR,
    ENGINE_LOG,
    SH,
    SHM_DIR,
    SHM_IMAGE,
    UnitSpec,
    writable_image,
)
from coldsnap.engines import adapter_for

log = structlog.get_logger("coldsnap.capsule")

# The dump's exec: $1 the engine's PID, $2 the images, $3 CRIU's work directory, $4 its action
# script (criu_action_runner), then the flags the unit's dump needs (criu_flags). First every
# process of the container is searched for an io_uring instance, which CRIU cannot dump
# ("Unknown shit 600 (anon_inode:[io_uring])", nothing more): found, the exec names each
# holder and exits IO_URING_HELD before CRIU freezes anything.
IO_URING_HELD = 95
DUMP_SCRIPT = f"""pid=$1 images=$2 work=$3 action=$4
shift 4
held=
for f in /proc/[0-9]*/fd/*; do
  t=$(readlink "$f" 2>/dev/null) || continue
  case "$t" in *io_uring*) p=${{f#/proc/}}; p=${{p%%/*}}
    held="$held
io_uring $p $(cat "/proc/$p/comm" 2>/dev/null)";;
  esac
done
[ -z "$held" ] || {{ echo "$held"; exit {IO_URING_HELD}; }}
exec {CRIU} dump -t "$pid" -D "$images" -W "$work" --leave-running -o dump.log \
  --action-script "$action" "$@"
"""
# CRIU runs its action script at each stage: the capsule's own capsule-init (criu_action_runner,
# in the read-only rootfs), which runs the commands the dump's exec hands it in its
# environment (CRIU_ACTION_ENV) with `sh -c`; never a file in a directory that the engine
# writes. The tree is still frozen at post-dump:
# the unit's /dev/shm and its writable paths (spec.LABEL_WRITABLE) are archived then, into
# the image set, exactly as the images reference them (sparse files stay sparse). An empty
# /dev/shm leaves no file. What other mounts put inside a writable path (the CRIU images and
# work directory, the engine log, the request's mounts) is not archived. A failure fails the
# dump.
CRIU_ACTION_ENV = "COLDSNAP_CRIU_ACTION"


def criu_action_runner(spec: UnitSpec) -> str:
    """The program CRIU runs as its action script: the capsule's capsule-init."""
    return spec.init_command[0]


def post_dump_action(handle: UnitHandle) -> str:
    """The commands the action script runs for a unit's dump (CRIU_ACTION_ENV)."""
    lines = ['[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0',
             f'if [ -n "$(ls -A {SHM_DIR})" ]; then tar -C {SHM_DIR} --numeric-owner -cSf '
             f'{CRIU_IMAGES_DIR}/{SHM_IMAGE} . || exit 1; fi']
    inner = [CRIU_IMAGES_DIR, CRIU_WORK_DIR, ENGINE_LOG,
             *(m.target for m in handle.spec.container_mounts())]
    for path in handle.writable:
        skip = [f"--exclude=./{posixpath.relpath(m, path)}" for m in inner
                if m != path and m.startswith(path.rstrip("/") + "/")]
        lines.append(shlex.join(["tar", "-C", path, "--numeric-owner", "-cSf",
                                 f"{CRIU_IMAGES_DIR}/{writable_image(path)}", *skip, "."])
                     + " || exit 1")
    return "\n".join(lines) + "\n"


def criu_flags(spec: UnitSpec) -> list[str]:
    """The CRIU options a unit's dump needs, and its restore repeats (from the accelerator
    that the capsule manifest records). A drained engine (on the CPU) never closed its
    connections: vLLM's processes keep loopback TCP connections between them, which CRIU takes
    only with --tcp-established (restored in repair mode; loopback exists on every host), and
    it maps POSIX semaphores whose files it has deleted from /dev/shm, which CRIU takes only
    with --link-remap (linked back under /dev/shm as link_remap.N, in the tmpfs archive). A
    sleeping engine closes its cross-worker connections, so an established one there is a
    fault that must fail the dump.

    An engine that keeps its sessions across a move (its adapter's crossing "sessions")
    carries connections to other hosts: coldsnapd locks the network of every unit of the
    workload itself before any is dumped or restored (coldsnap.capsule.netlock) and releases
    them together, so CRIU's own lock, which holds one unit only for its own dump, is
    skipped."""
    flags = ["--tcp-established", "--link-remap"] if spec.drains else []
    if keeps_sessions(spec):
        flags += ["--network-lock", "skip"]
    return flags


def keeps_sessions(spec: UnitSpec) -> bool:
    """Whether the unit's engine keeps its TCP connections across a checkpoint."""
    return adapter_for(spec.engine).crossing(spec.accelerator) == "sessions"


def io_uring_refusal(stdout: str) -> str:
    """The message for an engine that holds an io_uring instance at dump time."""
    held = sorted({" ".join(ln.split()[1:3]) for ln in stdout.splitlines()
                   if ln.startswith("io_uring ")})
    return ("the engine holds an io_uring instance, which CRIU cannot checkpoint (process "
            + ", ".join(f"{h.split()[0]} ({' '.join(h.split()[1:]) or '?'})" for h in held)
            + "). coldsnapd's launcher answers io_uring_setup with ENOSYS so that engines "
            "fall back to epoll: this engine was started without that seccomp filter (a unit "
            "launcher other than `capsule-init launch`?)")


async def dump(s: CapsuleSession, handle: UnitHandle) -> DumpResult:
    """CRIU dump of the engine tree into the host directory mounted at CRIU_IMAGES_DIR,
    leaving the tree running (quiesced, GPUs checkpointed) so that a later failure elsewhere
    can still roll it back. CRIU's log goes to CRIU_WORK_DIR, removed afterwards so that the
    capsule's rootfs diff does not carry it.

    On failure the partial images are deleted, the unit is returned to serving and
    DumpFailed carries CRIU's own error lines."""
    step = "dump"
    container = await s.container(handle.container_id, handle.unit, step)
    assert handle.engine_pid is not None
    if handle.images_dir is None:
        raise fail(s, handle.unit, step, "the container has no host directory for its CRIU "
                   "images (started for a capture?)", DumpFailed)
    await clear_dump(s.target.host, handle.images_dir)
    await s.exec(container, [SH, "-c", 'rm -rf "$1" && mkdir -p "$1"', "sh", CRIU_WORK_DIR])
    t0 = time.monotonic()
    out = await s.exec(container, [SH, "-c", DUMP_SCRIPT, "sh", str(handle.engine_pid),
                                   CRIU_IMAGES_DIR, CRIU_WORK_DIR,
                                   criu_action_runner(handle.spec), *criu_flags(handle.spec)],
                       timeout_s=LONG_DOCKER_CALL,
                       env={CRIU_ACTION_ENV: post_dump_action(handle)})
    seconds = time.monotonic() - t0
    if out.exit_status == IO_URING_HELD:
        why = io_uring_refusal(out.stdout)
    elif out.ok:
        why = ""
    else:
        why = await criu_errors(s, container, f"{CRIU_WORK_DIR}/dump.log")
    await s.exec(container, ["/bin/rm", "-rf", CRIU_WORK_DIR])
    if not out.ok:
        await clear_dump(s.target.host, handle.images_dir)
        detail = (why if out.exit_status == IO_URING_HELD
                  else f"criu dump exited {out.exit_status}:\n{why}")
        try:
            await return_to_serving(s, handle)
        except CapsuleError as exc:
            detail += f"\n(rollback failed: {exc.detail})"
        raise fail(s, handle.unit, step, detail, DumpFailed)
    du = await s.target.host.run(["du", "-sb", "--", handle.images_dir], timeout=60,
                                 check=False)
    first = du.stdout.split()[:1]
    size = int(first[0]) if du.ok and first and first[0].isdigit() else 0  # only logged
    log.info("capsule.dumped", host=s.host, unit=handle.unit, step=step, bytes=size,
             seconds=round(seconds, 3))
    return DumpResult(handle.unit, size, seconds)
