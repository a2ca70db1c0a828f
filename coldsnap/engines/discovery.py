"""Worker discovery: which process of a unit is which worker, read from the host itself.

The accelerator-owning processes of a unit are found the way an operator finds them: on a real
host, the processes that hold `/dev/nvidia<N>` open; on a simulated host, the processes the
cuda-checkpoint simulator's driver state knows, read through the simulation seam
(coldsnap.engines.simulated_gpus, the only module that knows the simulator's files).
Each one's `RANK`, `LOCAL_RANK` and `WORLD_SIZE` come from its environment as the kernel shows
it (`/proc/PID/environ`). Nothing is asked of the engine.

Matching, per GPU process: a `RANK` must be the world rank of one of the unit's workers (and
`WORLD_SIZE` the world's size), otherwise the unit is refused; without `RANK`, `LOCAL_RANK`
names the process slot; without either (vLLM's multiprocessing workers), processes are taken
in PID order as process slots 0, 1, ... On a simulated host each process's devices must also be
the ones its worker's device slots select (simulated_gpus.device_mismatch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from coldsnap.engines import simulated_gpus
from coldsnap.engines.base import optional_int
from coldsnap.hosts.base import Host

# One host command for every PID: its PID inside the container (last NSpid field), the rank
# variables of its environment (nothing else of it leaves the host), the NVIDIA device files
# it holds open and, on a simulated host, simulated_gpus.PROBE_LINES (its driver state file).
_PROBE = r"""
for p in "$@"; do
  [ -d "/proc/$p" ] || continue
  echo "@@ $p"
  grep '^NSpid:' "/proc/$p/status" 2>/dev/null
  printf 'cmd '; head -c 200 "/proc/$p/cmdline" 2>/dev/null | tr '\0\n' '  '; echo
  tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -E '^(RANK|LOCAL_RANK|WORLD_SIZE)=' || true
  for f in /proc/$p/fd/*; do
    t=$(readlink "$f" 2>/dev/null) || continue
    case "$t" in /dev/nvidia[0-9]*) echo "dev $t" ;; esac
  done
""" + simulated_gpus.PROBE_LINES + """done
true
"""


class WorkerLike(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def process_slot(self) -> int: ...
    @property
    def device_slots(self) -> tuple[int, ...]: ...


class DiscoveryError(Exception):
    """The unit's processes do not match its declared workers; the message says how."""


@dataclass
class ProcessFacts:
    host_pid: int
    pid: int  # inside the container's PID namespace
    env: dict[str, str] = field(default_factory=dict)
    device_files: list[str] = field(default_factory=list)
    simulated_devices: list[str] | None = None  # None: the simulator does not know it
    # The start of its command line, where setproctitle puts a title (`VLLM::Worker_TP0`).
    title: str = ""

    @property
    def holds_gpu(self) -> bool:
        return bool(self.device_files) or self.simulated_devices is not None


def parse_probe(text: str) -> list[ProcessFacts]:
    procs: list[ProcessFacts] = []
    cur: ProcessFacts | None = None
    for line in text.splitlines():
        if line.startswith("@@ "):
            host_pid = int(line[3:].strip())
            cur = ProcessFacts(host_pid, host_pid)
            procs.append(cur)
        elif cur is None:
            continue
        elif line.startswith("NSpid:"):
            cur.pid = int(line.split()[-1])
        elif line.startswith("cmd "):
            cur.title = line[4:].strip()
        elif line.startswith("dev "):
            cur.device_files.append(line[4:].strip())
        elif line.startswith(simulated_gpus.PROBE_TAG):
            cur.simulated_devices = simulated_gpus.state_devices(
                line[len(simulated_gpus.PROBE_TAG):])
        elif "=" in line:
            key, _, value = line.partition("=")
            cur.env[key] = value
    return procs


async def read_processes(host: Host, host_pids: Sequence[int], *, simulated: bool,
                         timeout: float = 30.0) -> list[ProcessFacts]:  # noqa: ASYNC109
    pids = [str(int(p)) for p in host_pids]
    res = await host.run(
        ["env", *simulated_gpus.probe_env(simulated), "sh", "-c", _PROBE, "sh", *pids],
        timeout=timeout, output_limit=16 << 20)  # a few KiB per process, environment included
    return parse_probe(res.stdout.decode(errors="replace"))


def _int_var(proc: ProcessFacts, name: str) -> int | None:
    return optional_int(proc.env.get(name), lambda raw: DiscoveryError(
        f"process {proc.pid} has {name}={raw!r}, not a number"))


def match_workers(procs: Sequence[ProcessFacts], workers: Sequence[WorkerLike],
                  unit_devices: Sequence[str], *, simulated: bool) -> dict[str, int]:
    """worker id -> PID inside the container, or DiscoveryError."""
    gpu = sorted((p for p in procs if p.holds_gpu), key=lambda p: p.pid)
    if len(gpu) != len(workers):
        raise DiscoveryError(f"{len(gpu)} GPU processes in the unit, it declares "
                             f"{len(workers)} workers")
    by_rank = {w.global_rank: w for w in workers}
    by_slot = {w.process_slot: w for w in workers}
    found: dict[str, ProcessFacts] = {}
    unranked: list[ProcessFacts] = []
    for proc in gpu:
        rank = _int_var(proc, "RANK")
        world = _int_var(proc, "WORLD_SIZE")
        slot = _int_var(proc, "LOCAL_RANK")
        worker: WorkerLike | None = None
        if rank is not None:
            worker = by_rank.get(rank)
            if worker is None:
                raise DiscoveryError(
                    f"process {proc.pid} has RANK={rank}, but the world group gives this "
                    f"unit's workers ranks {sorted(by_rank)}")
            if slot is not None and slot != worker.process_slot:
                raise DiscoveryError(
                    f"process {proc.pid} (RANK={rank}, worker {worker.id}) has LOCAL_RANK="
                    f"{slot}, the worker's process slot is {worker.process_slot}")
        elif slot is not None:
            worker = by_slot.get(slot)
            if worker is None:
                raise DiscoveryError(f"process {proc.pid} has LOCAL_RANK={slot}, no worker of "
                                     f"the unit has that process slot")
        if worker is not None and world is not None and world != worker.world_size:
            raise DiscoveryError(f"process {proc.pid} has WORLD_SIZE={world}, the world group "
                                 f"has {worker.world_size} workers")
        if worker is None:
            unranked.append(proc)
            continue
        if worker.id in found:
            raise DiscoveryError(f"processes {found[worker.id].pid} and {proc.pid} both claim "
                                 f"worker {worker.id}")
        found[worker.id] = proc
    rest = sorted((w for w in workers if w.id not in found), key=lambda w: w.process_slot)
    for worker, proc in zip(rest, unranked, strict=True):
        found[worker.id] = proc
    if simulated:
        for worker in workers:
            proc = found[worker.id]
            why = simulated_gpus.device_mismatch(worker.id, proc.pid, proc.simulated_devices,
                                                 worker.device_slots, unit_devices)
            if why is not None:
                raise DiscoveryError(why)
    return {wid: p.pid for wid, p in found.items()}


def match_cpu_workers(procs: Sequence[ProcessFacts], workers: Sequence[WorkerLike],
                      titles: Sequence[str]) -> dict[str, int]:
    """worker id -> PID inside the container, for an engine on the CPU: no process holds a
    GPU, so the workers are the engine's own processes with the first of `titles` that any
    of them carries (vLLM: its `VLLM::Worker` processes, else `VLLM::EngineCore`), taken in
    PID order as process slots 0, 1, ..."""
    for title in titles:
        found = sorted((p for p in procs if p.title.startswith(title)), key=lambda p: p.pid)
        if found:
            break
    else:
        raise DiscoveryError(f"no process of the unit is titled {' or '.join(titles)} (an "
                             "engine on the CPU: its workers are its engine processes)")
    if len(found) != len(workers):
        raise DiscoveryError(f"{len(found)} {title} processes in the unit, it declares "
                             f"{len(workers)} workers")
    ordered = sorted(workers, key=lambda w: w.process_slot)
    return {w.id: p.pid for w, p in zip(ordered, found, strict=True)}


async def discover_cpu_workers(host: Host, host_pids: Sequence[int],
                               workers: Sequence[WorkerLike],
                               titles: Sequence[str]) -> dict[str, int]:
    procs = await read_processes(host, host_pids, simulated=False)
    return match_cpu_workers(procs, workers, titles)


async def discover_workers(host: Host, host_pids: Sequence[int], workers: Sequence[WorkerLike],
                           unit_devices: Sequence[str], *, simulated: bool) -> dict[str, int]:
    procs = await read_processes(host, host_pids, simulated=simulated)
    return match_workers(procs, workers, unit_devices, simulated=simulated)
