"""How many bytes a unit's dump will write on its host, estimated while the engine runs, so
that a capture can refuse a host without the room before anything is frozen or written.

What `criu_dump.dump` puts in the host's dump directory is, nearly all of it, the memory of
the engine tree (each process's anonymous pages, the shared memory it maps) and the archives
of the unit's /dev/shm and writable paths (`post_dump_action`); CRIU's own metadata images are
small beside them. So the estimate reads, inside the container: every process of the tree
rooted at the engine's PID, its `Anonymous` and `Pss_Shmem` from /proc/PID/smaps_rollup
(Pss: memory shared between the tree's processes is counted once, as CRIU writes it once), and
`du -skx` of /dev/shm and of each writable path (-x: the mounts inside a writable path, which
the archive leaves out, are other filesystems). Pages the engine has swapped out are not
counted: CRIU reads them back into the dump, but the test and CPU engines run unswapped.

Less what the engine releases before the dump, as far as the capture knows it: a unit whose
quiesce releases its weights (`UnitSpec.release_weights`) drops about its workers' payloads,
whose sizes are read on the host. Its KV cache, which the quiesce drops too, has no size the
capture knows: it stays in the estimate, which then errs high. Memory that `cuda-checkpoint`
brings from a GPU into the process is not host memory before the dump and is not seen here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.handle import UnitHandle, fail
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import SH, SHM_DIR

# $1 the engine's PID, then the paths to measure. Only sh builtins for the process tree
# (a capsule's rootfs need not have awk): the tree is grown from the root by PPid until no
# process joins. Prints "memory KIB" then "path KIB" per path ("path -" when du failed).
SIZE_SCRIPT = r"""root=$1
shift
pp=
for s in /proc/[0-9]*/status; do
  p=${s#/proc/}; p=${p%/status}
  while read -r k v _; do
    [ "$k" = PPid: ] && { pp="$pp $p:$v"; break; }
  done < "$s" 2>/dev/null
done
tree=" $root "
grew=1
while [ $grew = 1 ]; do
  grew=0
  for e in $pp; do
    p=${e%%:*}; q=${e#*:}
    case "$tree" in *" $p "*) continue;; esac
    case "$tree" in *" $q "*) tree="$tree$p "; grew=1;; esac
  done
done
kib=0
for p in $tree; do
  while read -r k v _; do
    case "$k" in Anonymous:|Pss_Shmem:) kib=$((kib + v));; esac
  done < "/proc/$p/smaps_rollup" 2>/dev/null
done
echo "memory $kib"
for d in "$@"; do
  k=$(du -skx -- "$d" 2>/dev/null) && echo "$d ${k%%[!0-9]*}" || echo "$d -"
done
"""


@dataclass(frozen=True)
class DumpEstimate:
    """The parts of a unit's dump, in bytes."""

    unit_id: str
    memory: int  # the engine tree's anonymous and shared memory
    files: dict[str, int]  # /dev/shm and each writable path -> the bytes they hold
    released: int = 0  # what the quiesce releases: the weights, when it releases them

    @property
    def total(self) -> int:
        return max(0, self.memory - self.released) + sum(self.files.values())


def parse_sizes(unit_id: str, stdout: str) -> DumpEstimate:
    """SIZE_SCRIPT's answer; ValueError for anything else (a path du could not read
    included: an estimate that leaves out a part is not one)."""
    memory: int | None = None
    files: dict[str, int] = {}
    for line in stdout.splitlines():
        path, _, kib = line.rpartition(" ")
        if not kib.isdigit():
            raise ValueError(f"cannot measure {path or line!r}")
        if path == "memory" and memory is None:
            memory = int(kib) * 1024
        else:
            files[path] = int(kib) * 1024
    if memory is None:
        raise ValueError("no memory figure in the answer")
    return DumpEstimate(unit_id, memory, files)


async def estimate_dump(s: CapsuleSession, handle: UnitHandle) -> DumpEstimate:
    """The bytes `dump` will write for this running unit (see the module docstring); a
    CapsuleError when the container cannot say."""
    step = "space"
    container = await s.container(handle.container_id, handle.unit, step)
    assert handle.engine_pid is not None
    out = await s.exec(container, [SH, "-c", SIZE_SCRIPT, "sh", str(handle.engine_pid),
                                   SHM_DIR, *handle.writable], timeout_s=120)
    if not out.ok:
        raise fail(s, handle.unit, step, f"measuring the engine's memory failed: {out.tail()}",
                   CapsuleError)
    try:
        estimate = parse_sizes(handle.unit, out.stdout)
    except ValueError as exc:
        raise fail(s, handle.unit, step, f"measuring the engine's memory: {exc}",
                   CapsuleError) from None
    if not handle.spec.release_weights:
        return estimate
    return replace(estimate, released=await _payload_bytes(s, handle, step))


async def _payload_bytes(s: CapsuleSession, handle: UnitHandle, step: str) -> int:
    """The bytes of the unit's workers' payloads on the host (a file or a directory each)."""
    paths = sorted({w.payload_path for w in handle.spec.workers if w.payload_path})
    if not paths:
        return 0
    res = await s.target.host.run(["du", "-sbLl", "--", *paths], timeout=60, check=False)
    lines = res.stdout.decode(errors="replace").splitlines() if res.ok else []
    sizes = [ln.split("\t", 1)[0] for ln in lines]
    if len(sizes) != len(paths) or not all(n.isdigit() for n in sizes):
        raise fail(s, handle.unit, step, "cannot read the size of its workers' payloads: "
                   f"{res.stderr.decode(errors='replace').strip()[-500:]}", CapsuleError)
    return sum(int(n) for n in sizes)


__all__ = ["SIZE_SCRIPT", "DumpEstimate", "estimate_dump", "parse_sizes"]
