"""Host facts: what a host is (arch, kernel, Docker, NVIDIA driver and GPUs, free space).

One round trip per host: a Python snippet runs on the host and answers in JSON. GPU facts come
from nvidia-ml-py *on the host*; when the host has no `pynvml` module, this side's copy of
the module's source is sent along on stdin (it is pure Python over the driver's libnvidia-ml),
so nothing has to be installed there. A host marked `simulated: true` in the inventory
reports the inventory's GPUs instead, flagged `simulated: true`; a real host never falls back
to simulation.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from coldsnap.admission import GpuFact, HostFacts
from coldsnap.hosts.base import Host, HostError, HostUnreachable
from coldsnap.hosts.inventory import HostEntry

if TYPE_CHECKING:
    from coldsnap.hosts.pool import HostPool

PROBE_SCRIPT = r"""
import json, os, socket, sys, types
cfg = json.loads(sys.stdin.readline())
notes = []
u = os.uname()
facts = {"arch": u.machine, "kernel": u.release, "notes": notes,
         "docker": None, "nvidia_driver": None, "gpus": [], "data_dir_free_bytes": None}
p = cfg["data_dir"]
while p and not os.path.exists(p):
    p = os.path.dirname(p)
st = os.statvfs(p or "/")
facts["data_dir_free_bytes"] = st.f_bavail * st.f_frsize
if p != cfg["data_dir"]:
    notes.append("data_dir does not exist yet; free space is that of " + p)
sock = cfg.get("docker_socket")
if sock:
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(sock)
        s.sendall(b"GET /version HTTP/1.0\r\nHost: docker\r\n\r\n")
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.close()
        head, _, body = data.partition(b"\r\n\r\n")
        if b" 200 " not in head.split(b"\r\n")[0]:
            notes.append("docker: " + head.split(b"\r\n")[0].decode(errors="replace"))
        else:
            facts["docker"] = json.loads(body)["Version"]
    except (OSError, ValueError, KeyError) as e:
        notes.append("docker: cannot query %s: %s" % (sock, e))
if cfg["nvml"]:
    try:
        import pynvml
    except ImportError:
        pynvml = types.ModuleType("pynvml")
        sys.modules["pynvml"] = pynvml  # the module looks itself up while loading
        exec(compile(sys.stdin.read(), "pynvml.py", "exec"), pynvml.__dict__)
    def s_(v):
        return v.decode() if isinstance(v, bytes) else v
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        if e.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
            notes.append("no NVIDIA driver")
        elif e.value == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
            notes.append("no NVIDIA driver (installed but not loaded)")
        else:
            notes.append("NVML: %s" % e)
    else:
        try:
            facts["nvidia_driver"] = s_(pynvml.nvmlSystemGetDriverVersion())
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                try:
                    mem = pynvml.nvmlDeviceGetMemoryInfo(h).total
                except pynvml.NVMLError:
                    mem = None  # unified-memory parts may not report device memory
                facts["gpus"].append({"index": i, "name": s_(pynvml.nvmlDeviceGetName(h)),
                                      "uuid": s_(pynvml.nvmlDeviceGetUUID(h)),
                                      "compute_capability": "%d.%d" % (major, minor),
                                      "memory_bytes": mem, "simulated": False})
        except pynvml.NVMLError as e:
            notes.append("NVML: %s" % e)
        finally:
            pynvml.nvmlShutdown()
json.dump(facts, sys.stdout)
"""


@dataclass(frozen=True)
class ProbedGpu:
    index: int
    name: str
    uuid: str
    compute_capability: str
    memory_bytes: int | None
    simulated: bool


@dataclass(frozen=True)
class HostProbe:
    host: str
    reachable: bool
    error: str | None = None
    arch: str | None = None
    kernel: str | None = None
    docker: str | None = None
    nvidia_driver: str | None = None
    gpus: list[ProbedGpu] = field(default_factory=list)
    simulated: bool = False
    data_dir_free_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def admission_facts(self) -> HostFacts:
        """What admission and placement decide on (coldsnap.admission.HostFacts)."""
        return HostFacts(arch=self.arch or "", kernel=self.kernel or "",
                         driver_version=self.nvidia_driver or "",
                         gpus=tuple(GpuFact(g.uuid, g.name, g.compute_capability)
                                    for g in self.gpus))


@functools.cache
def _pynvml_source() -> bytes:
    spec = importlib.util.find_spec("pynvml")
    if spec is None or spec.origin is None:
        raise RuntimeError("nvidia-ml-py is not installed on the control node")
    with open(spec.origin, "rb") as f:
        return f.read()


async def probe_host(
    host: Host,
    entry: HostEntry,
    *,
    timeout: float = 60.0,  # noqa: ASYNC109 (kills the probe)
) -> HostProbe:
    """Probe one host; unreachable is an answer, not an exception."""
    real_gpus = not entry.simulated
    cfg = {"data_dir": entry.data_dir, "docker_socket": entry.docker_socket, "nvml": real_gpus}
    stdin = json.dumps(cfg).encode() + b"\n"
    if real_gpus:
        stdin += _pynvml_source()
    try:
        # -I -S: no site-packages scan at start-up (a third of the run time on a small
        # host); pynvml, if needed, comes along on stdin anyway.
        result = await host.run(
            ["python3", "-I", "-S", "-c", PROBE_SCRIPT], input=stdin, timeout=timeout
        )
    except HostUnreachable as exc:
        return HostProbe(
            host=entry.name, reachable=False, error=exc.message, simulated=entry.simulated
        )
    except HostError as exc:
        return HostProbe(
            host=entry.name,
            reachable=True,
            error=f"probe failed: {exc.message}",
            simulated=entry.simulated,
        )
    try:
        raw = json.loads(result.stdout)
    except ValueError:
        return HostProbe(
            host=entry.name,
            reachable=True,
            simulated=entry.simulated,
            error=f"probe answered garbage: {result.stdout[:200]!r}",
        )
    if entry.simulated:
        gpus = [
            ProbedGpu(i, g.name, g.uuid, g.compute_capability, g.memory_bytes, simulated=True)
            for i, g in enumerate(entry.simulated_gpus or [])
        ]
        driver = entry.driver_version
    else:
        gpus = [ProbedGpu(**g) for g in raw["gpus"]]
        driver = raw["nvidia_driver"]
    return HostProbe(
        host=entry.name,
        reachable=True,
        arch=raw["arch"],
        kernel=raw["kernel"],
        docker=raw["docker"],
        nvidia_driver=driver,
        gpus=gpus,
        simulated=entry.simulated,
        data_dir_free_bytes=raw["data_dir_free_bytes"],
        notes=list(raw["notes"]),
    )


async def probe_hosts(
    hosts: Sequence[tuple[Host, HostEntry]],
    *,
    timeout: float = 60.0,  # noqa: ASYNC109 (per host: one slow host must not hide the others)
) -> list[HostProbe]:
    """Probe hosts concurrently, in the order given; one answer per host whatever happens."""

    async def one(h: Host, entry: HostEntry) -> HostProbe:
        try:
            async with asyncio.timeout(timeout):
                return await probe_host(h, entry, timeout=timeout)
        except TimeoutError:
            return HostProbe(
                host=entry.name,
                reachable=False,
                simulated=entry.simulated,
                error=f"no answer within {timeout}s",
            )

    return list(await asyncio.gather(*(one(h, e) for h, e in hosts)))


async def probe_pool(
    pool: HostPool,
    names: Iterable[str] | None = None,
    *,
    timeout: float = 60.0,  # noqa: ASYNC109 (per host)
) -> list[HostProbe]:
    """Probe a pool's hosts concurrently, in inventory order."""
    return await probe_hosts([(h, h.entry) for h in pool.hosts(names)], timeout=timeout)
