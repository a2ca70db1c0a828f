"""What a CRIU dump inside a capsule runs, beside `criu dump` itself: the search for what CRIU
cannot dump (io_uring), the archive of the unit's /dev/shm taken while the tree is frozen, and
the options a unit's dump needs (which its restore repeats)."""

from __future__ import annotations

from coldsnap.capsule.spec import CRIU_IMAGES_DIR, SHM_DIR, SHM_IMAGE, UnitSpec

# The dump's exec: $1 the engine's PID, $2 the images, $3 CRIU's work directory, $4 the text
# of its action script, then the flags the unit's dump needs (criu_flags). First every
# process of the container is searched for an io_uring instance, which CRIU cannot dump
# ("Unknown shit 600 (anon_inode:[io_uring])", nothing more): found, the exec names each
# holder and exits IO_URING_HELD before CRIU freezes anything.
IO_URING_HELD = 95
DUMP_SCRIPT = f"""pid=$1 images=$2 work=$3
action=$work/post-dump.sh
printf '%s' "$4" > "$action" && chmod 0700 "$action" || exit 1
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
exec criu dump -t "$pid" -D "$images" -W "$work" --leave-running -o dump.log \
  --action-script "$action" "$@"
"""
# CRIU runs its action script (a file: written into its work directory, which no commit
# carries) at each stage, the tree still frozen at post-dump: the unit's /dev/shm is archived
# then, into the image set, exactly as the images reference it (sparse files stay sparse). An
# empty /dev/shm leaves no file. A failure fails the dump.
SHM_CAPTURE = ('#!/bin/sh\n'
               f'[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
               f'[ -n "$(ls -A {SHM_DIR})" ] || exit 0\n'
               f'exec tar -C {SHM_DIR} --numeric-owner -cSf {CRIU_IMAGES_DIR}/{SHM_IMAGE} .\n')


def criu_flags(spec: UnitSpec) -> list[str]:
    """The CRIU options a unit's dump needs, and its restore repeats (from the accelerator
    that the capsule manifest records). A drained engine (on the CPU) never closed its
    connections: vLLM's processes keep loopback TCP connections between them, which CRIU takes
    only with --tcp-established (restored in repair mode; loopback exists on every host), and
    it maps POSIX semaphores whose files it has deleted from /dev/shm, which CRIU takes only
    with --link-remap (linked back under /dev/shm as link_remap.N, in the tmpfs archive). A
    sleeping engine closes its cross-worker connections, so an established one there is a
    fault that must fail the dump."""
    return ["--tcp-established", "--link-remap"] if spec.drains else []


def io_uring_refusal(stdout: str) -> str:
    """The message for an engine that holds an io_uring instance at dump time."""
    held = sorted({" ".join(ln.split()[1:3]) for ln in stdout.splitlines()
                   if ln.startswith("io_uring ")})
    return ("the engine holds an io_uring instance, which CRIU cannot checkpoint (process "
            + ", ".join(f"{h.split()[0]} ({' '.join(h.split()[1:]) or '?'})" for h in held)
            + "). coldsnapd's launcher answers io_uring_setup with ENOSYS so that engines "
            "fall back to epoll: this engine was started without that seccomp filter (a unit "
            "launcher other than `capsule-init launch`?)")
