"""Host facts: what a host is (arch, kernel, Docker, NVIDIA driver and GPUs, free space, its
network interfaces and their addresses).

One round trip per host, one light command: `sh` reads uname, the interfaces (`ip -o link`,
`ip -o addr`; without `ip`, /sys/class/net), the free space of `data_dir`
(`stat -f`, the statvfs figures) and Docker's version from its socket (`curl`, else the
`docker` CLI). Only a real host's GPU part needs more: nvidia-ml-py *on the host*, run by
python3 in the same command; when the host has no `pynvml` module, this side's copy of the
module's source is sent along on stdin (it is pure Python over the driver's libnvidia-ml), so
nothing has to be installed there. A host marked `simulated: true` in the inventory reports
the inventory's GPUs instead, flagged `simulated: true`, and runs no python at all; a real
host never falls back to simulation.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from coldsnap.admission import GpuFact, HostFacts
from coldsnap.hosts.base import Host, HostError, HostUnreachable
from coldsnap.hosts.inventory import HostEntry
from coldsnap.network_admission import InterfaceFact

if TYPE_CHECKING:
    from coldsnap.hosts.pool import HostPool

# argv: data_dir, docker socket ("" for none), 1 when NVML must be asked. Every section of the
# answer starts with a line "@@<name>"; the parser below reads them.
PROBE_SH = r"""
echo "@@arch $(uname -m)"
echo "@@kernel $(uname -r)"
b=; { read -r b </proc/sys/kernel/random/boot_id; } 2>/dev/null
echo "@@boot-id $b"
echo "@@hostname $(uname -n)"
# The host's network as its units see it (they share it): netlink when `ip` is there, which
# answers for this namespace whatever /sys shows; else /sys's names and states, no addresses.
if command -v ip >/dev/null 2>&1; then
  echo "@@ip-link"; ip -o link show 2>/dev/null
  echo "@@ip-addr"; ip -o addr show 2>/dev/null
else
  echo "@@sys-net"
  for d in /sys/class/net/*; do
    [ -e "$d" ] || continue
    s=; f=
    { read -r s <"$d/operstate"; } 2>/dev/null
    { read -r f <"$d/flags"; } 2>/dev/null
    echo "${d##*/} $s $f"
  done
fi
p=$1
while [ -n "$p" ] && [ ! -e "$p" ]; do p=${p%/*}; done
[ -n "$p" ] || p=/
echo "@@free-path $p"
echo "@@free $(stat -f -c '%a %S' -- "$p")"
if [ -n "$2" ]; then
  echo "@@docker-instance $(stat -L -c '%i %Z' -- "$2" 2>/dev/null)"
  if command -v curl >/dev/null 2>&1; then
    echo "@@docker-http"
    curl -sS --max-time 10 --unix-socket "$2" -w '
@@docker-status %{http_code}
'       http://docker/version 2>&1 || echo "@@docker-failed"
  elif command -v docker >/dev/null 2>&1; then
    echo "@@docker-cli"
    docker -H "unix://$2" version --format '{{.Server.Version}}' 2>&1 || echo "@@docker-failed"
  else
    echo "@@docker-none"
  fi
fi
if [ "$3" = 1 ]; then
  echo "@@nvml"
  python3 -I -S -c "$4" 2>&1 || echo "@@nvml-failed"
fi
true
"""

# Run by python3 on a real host only: the GPU facts from NVML, as one JSON line.
NVML_SCRIPT = r"""
import json, sys, types
notes = []
facts = {"nvidia_driver": None, "gpus": [], "notes": notes}
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
print(json.dumps(facts))
"""


class ProbeGarbage(ValueError):
    """The probe's answer is not what the probe command prints."""


def _sections(text: str) -> dict[str, list[str]]:
    """"@@name rest" lines open sections; a section holds its rest and the lines after it."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("@@"):
            name, _, rest = line[2:].partition(" ")
            current = out.setdefault(name, [])
            current.append(rest)
        elif current is not None:
            current.append(line)
    return out


def _first(sections: dict[str, list[str]], name: str) -> str | None:
    """A one-line section's text; None when it is absent or empty (a host without
    /proc/sys/kernel/random/boot_id, a socket stat could not read)."""
    lines = sections.get(name) or [""]
    return lines[0].strip() or None


def _docker(sections: dict[str, list[str]], socket: str, notes: list[str]) -> str | None:
    failed = "docker-failed" in sections
    if "docker-http" in sections:
        body = "\n".join(sections["docker-http"][1:]).strip()
        status = (sections.get("docker-status") or ["000"])[0].strip()
        if failed or status == "000":
            notes.append(f"docker: cannot query {socket}: {body or 'no answer'}")
        elif status != "200":
            notes.append(f"docker: HTTP {status}")
        else:
            try:
                return str(json.loads(body)["Version"])
            except (ValueError, KeyError, TypeError):
                notes.append(f"docker: cannot query {socket}: unexpected answer {body[:200]!r}")
    elif "docker-cli" in sections:
        lines = [x for x in sections["docker-cli"][1:] if x.strip()]
        if failed or len(lines) != 1:
            notes.append(f"docker: cannot query {socket}: {' '.join(lines)[:300]}")
        else:
            return lines[0].strip()
    elif "docker-none" in sections:
        notes.append(f"docker: cannot query {socket}: neither curl nor docker on the host")
    return None


_LINK = re.compile(r"^\d+:\s+([^:@\s]+)(?:@\S*)?:\s+<([^>]*)>")
_ADDR = re.compile(r"^\d+:\s+([^:@\s]+)(?:@\S*)?\s+inet6?\s+([0-9A-Fa-f.:]+)(?:/\d+)?\s")


def parse_interfaces(sec: dict[str, list[str]]) -> list[InterfaceFact] | None:
    """The interfaces the probe listed, in its order; None when it listed none (an older
    probe's answer, or a host whose network could not be read)."""
    if "ip-link" in sec:
        links: dict[str, bool] = {}
        for line in sec["ip-link"][1:]:
            m = _LINK.match(line)
            if m:
                flags = set(m.group(2).split(","))
                # Administratively up and with a carrier: NO-CARRIER lacks LOWER_UP.
                links[m.group(1)] = "UP" in flags and "LOWER_UP" in flags
        addrs: dict[str, list[str]] = {n: [] for n in links}
        for line in sec.get("ip-addr", [""])[1:]:
            m = _ADDR.match(line)
            if m and m.group(1) in addrs:
                addrs[m.group(1)].append(m.group(2))
        return [InterfaceFact(n, up, tuple(addrs[n])) for n, up in links.items()] or None
    if "sys-net" in sec:
        out = []
        for line in sec["sys-net"][1:]:
            parts = line.split()
            if not parts:
                continue
            state = parts[1] if len(parts) > 1 else ""
            try:
                admin_up = bool(int(parts[2], 16) & 1) if len(parts) > 2 else False
            except ValueError:
                admin_up = False
            out.append(InterfaceFact(parts[0], admin_up and state in ("up", "unknown")))
        return out or None
    return None


def parse_probe_output(text: str, data_dir: str, docker_socket: str | None) -> dict[str, Any]:
    """The probe command's answer as facts: arch, kernel, boot_id, data_dir_free_bytes,
    docker, docker_instance, nvidia_driver, gpus (NVML's, when it ran), notes."""
    sec = _sections(text)
    try:
        arch, kernel = sec["arch"][0].strip(), sec["kernel"][0].strip()
        path = sec["free-path"][0]
        avail, frsize = (int(x) for x in sec["free"][0].split())
    except (KeyError, IndexError, ValueError):
        raise ProbeGarbage(text[:300]) from None
    notes: list[str] = []
    if path != data_dir:
        notes.append("data_dir does not exist yet; free space is that of " + path)
    facts: dict[str, Any] = {"arch": arch, "kernel": kernel, "notes": notes,
                             "boot_id": _first(sec, "boot-id"),
                             "docker_instance": _first(sec, "docker-instance"),
                             "hostname": _first(sec, "hostname"),
                             "interfaces": parse_interfaces(sec),
                             "data_dir_free_bytes": avail * frsize, "nvidia_driver": None,
                             "gpus": [],
                             "docker": _docker(sec, docker_socket, notes) if docker_socket
                             else None}
    if "nvml" in sec:
        answer = "\n".join(sec["nvml"][1:]).strip()
        try:
            nvml = json.loads(answer.splitlines()[-1]) if answer else None
        except ValueError:
            nvml = None
        if not isinstance(nvml, dict) or "nvml-failed" in sec:
            notes.append(f"NVML: the GPU query failed: {answer[-300:]}")
        else:
            facts["nvidia_driver"] = nvml["nvidia_driver"]
            facts["gpus"] = nvml["gpus"]
            notes.extend(nvml["notes"])
    return facts


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
    # This boot of the host's kernel, and its dockerd's socket as "inode ctime" (a restarted
    # dockerd makes a new one): what a remembered CRIU probe is valid for (probe_cache).
    boot_id: str | None = None
    docker: str | None = None
    docker_instance: str | None = None
    nvidia_driver: str | None = None
    gpus: list[ProbedGpu] = field(default_factory=list)
    simulated: bool = False
    data_dir_free_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    hostname: str | None = None
    # None: the probe could not list them (placement admission then checks nothing of them).
    interfaces: list[InterfaceFact] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def admission_facts(self) -> HostFacts:
        """What admission and placement decide on (coldsnap.admission.HostFacts)."""
        return HostFacts(arch=self.arch or "", kernel=self.kernel or "",
                         driver_version=self.nvidia_driver or "",
                         gpus=tuple(GpuFact(g.uuid, g.name, g.compute_capability)
                                    for g in self.gpus),
                         boot_id=self.boot_id, docker=self.docker,
                         docker_instance=self.docker_instance, hostname=self.hostname,
                         interfaces=(None if self.interfaces is None
                                     else tuple(self.interfaces)))


@functools.cache
def _pynvml_source() -> bytes:
    spec = importlib.util.find_spec("pynvml")
    if spec is None or spec.origin is None:
        raise RuntimeError("nvidia-ml-py is not installed on the control node")
    with open(spec.origin, "rb") as f:
        return f.read()


def probe_command(entry: HostEntry) -> list[str]:
    """The argv run on the host (a real host's also reads pynvml's source on stdin)."""
    real_gpus = not entry.simulated
    return ["sh", "-c", PROBE_SH, "sh", entry.data_dir, entry.docker_socket or "",
            *(("1", NVML_SCRIPT) if real_gpus else ("0",))]


def _no_facts(entry: HostEntry, error: str, *, reachable: bool) -> HostProbe:
    """A probe that learnt nothing of the host but why (it did not answer, or not sense)."""
    return HostProbe(host=entry.name, reachable=reachable, error=error,
                     simulated=entry.simulated)


async def probe_host(
    host: Host,
    entry: HostEntry,
    *,
    timeout: float = 60.0,  # noqa: ASYNC109 (kills the probe)
) -> HostProbe:
    """Probe one host; unreachable is an answer, not an exception."""
    real_gpus = not entry.simulated
    stdin = _pynvml_source() if real_gpus else b""
    try:
        result = await host.run(probe_command(entry), input=stdin, timeout=timeout)
    except HostUnreachable as exc:
        return _no_facts(entry, exc.message, reachable=False)
    except HostError as exc:
        return _no_facts(entry, f"probe failed: {exc.message}", reachable=True)
    try:
        raw = parse_probe_output(result.stdout.decode(errors="replace"), entry.data_dir,
                                 entry.docker_socket)
    except ProbeGarbage:
        return _no_facts(entry, f"probe answered garbage: {result.stdout[:200]!r}",
                         reachable=True)
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
        boot_id=raw["boot_id"],
        docker=raw["docker"],
        docker_instance=raw["docker_instance"],
        nvidia_driver=driver,
        gpus=gpus,
        simulated=entry.simulated,
        data_dir_free_bytes=raw["data_dir_free_bytes"],
        notes=list(raw["notes"]),
        hostname=raw["hostname"],
        interfaces=raw["interfaces"],
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
            return _no_facts(entry, f"no answer within {timeout}s", reachable=False)

    return list(await asyncio.gather(*(one(h, e) for h, e in hosts)))


async def probe_pool(
    pool: HostPool,
    names: Iterable[str] | None = None,
    *,
    timeout: float = 60.0,  # noqa: ASYNC109 (per host)
) -> list[HostProbe]:
    """Probe a pool's hosts concurrently, in inventory order."""
    return await probe_hosts([(h, h.entry) for h in pool.hosts(names)], timeout=timeout)
