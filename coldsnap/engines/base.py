"""The engine adapter protocol: what coldsnapd needs from an inference engine, spoken only
through the engine's public HTTP surface.

An adapter knows one engine's surface (vLLM, SGLang): how to tell it is ready, how to quiesce
it before a checkpoint and resume it after, how to send the validation prompt, which TCP ports
it listens on (admission checks they are free), and where its command line says the model
lies (payload files are found from the request, never from a path the engine reports).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from coldsnap.hosts.base import Host
from coldsnap.hosts.http import HttpAnswer, http_request
from coldsnap.identity import flag_value

# How a unit's engine crosses a restore onto other addresses: "sessions" (its established
# connections between hosts are carried by CRIU, with every socket's addresses rewritten to
# the new hosts'), "reconnect" (it closes them before the checkpoint and dials its peers again
# on wake, from the placement), or None (neither: it cannot be restored onto other addresses).
Crossing = Literal["sessions", "reconnect"]


class EngineCallFailed(Exception):
    """The engine answered a lifecycle or validation call with something other than success
    (or did not answer); the message says which call and what came back, `status` the HTTP
    status it answered (None: no answer, or an answer without what the call needs)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class EngineEndpoint:
    """Where one unit's engine serves: `address:port` as seen from `host` itself."""

    host: Host
    address: str
    port: int
    # The engine's API key (`HttpEngine.api_key`), sent as a bearer token on every call:
    # older vLLM guards only /v1, newer vLLM and SGLang every path but the probes, and a
    # key on an open path is ignored. Never in a repr, a message or a log line.
    api_key: str | None = field(default=None, repr=False)

    async def call(self, method: str, target: str, body: Any = None, *,
                   timeout: float = 30.0) -> HttpAnswer:  # noqa: ASYNC109
        auth = (("Authorization", f"Bearer {self.api_key}"),) if self.api_key else ()
        return await http_request(self.host, self.address, self.port, method, target, body,
                                  timeout=timeout, extra_headers=auth)

    def __str__(self) -> str:
        return f"http://{self.address}:{self.port}"


def port_flag(command: Sequence[str], default: int) -> int:
    """The engine's serving port from `--port`, or the engine's default."""
    port = optional_int(flag_value(command, ("--port",)),
                        lambda v: ValueError(f"--port {v!r} is not a port number"))
    if port is None:
        return default
    if not 1 <= port <= 65535:
        raise ValueError(f"--port {port} is out of range")
    return port


def optional_int(value: str | None, refusal: Callable[[str], Exception]) -> int | None:
    """A number read from a command line or an environment: None when absent, else `value`
    as an int, or the error `refusal` makes of a value that is not one."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise refusal(value) from None


def master_port(command: Sequence[str], environment: dict[str, str] | None = None) -> int | None:
    """The rendezvous port the world's rank 0 listens on (`--master-port`, else MASTER_PORT)."""
    value = flag_value(command, ("--master-port",))
    if value is None and environment:
        value = environment.get("MASTER_PORT")
    return optional_int(value, lambda v: ValueError(f"--master-port {v!r} is not a port number"))


def master_addr(command: Sequence[str], environment: dict[str, str] | None = None) -> str | None:
    value = flag_value(command, ("--master-addr", "--master-address"))
    if value is None and environment:
        value = environment.get("MASTER_ADDR")
    return value


def requests_in_flight(metrics_text: str, names: Sequence[str]) -> int | None:
    """The sum of the Prometheus gauges `names` (every label set) in a /metrics answer; None
    when none of them is there."""
    total: float | None = None
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in names:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        total = (total or 0.0) + value
    return None if total is None else round(total)


@dataclass(frozen=True)
class KvRelease:
    """What an engine's KV release after a drain gave back (`EngineAdapter.release_kv_cache`):
    the bytes of KV space whose pages it discarded, and how many of them were in memory just
    before, which a snapshot taken now does not hold."""

    kv_bytes: int
    released_bytes: int


def kv_release(exit_code: int, stdout: str, stderr: str = "") -> KvRelease:
    """The KV release command's answer (`EngineAdapter.kv_release_argv`): one JSON line on
    stdout, {"kv_bytes", "released_bytes"} or {"error"}; EngineCallFailed for anything
    else, quoting the end of its stderr."""
    lines = stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise EngineCallFailed(f"the KV cache release answered {stdout.strip()[-300:]!r} "
                               f"(exit {exit_code}, stderr {stderr.strip()[-300:]!r}); does "
                               "the capsule carry coldsnap's engine plugin?")
    if exit_code != 0 or "error" in doc:
        raise EngineCallFailed(f"the KV cache release failed (exit {exit_code}): "
                               f"{str(doc.get('error', doc))[:300]}")
    kv, released = doc.get("kv_bytes"), doc.get("released_bytes")
    if not (isinstance(kv, int) and isinstance(released, int) and 0 <= released <= kv):
        raise EngineCallFailed(f"the KV cache release answered {doc!r}: no kv_bytes >= "
                               "released_bytes >= 0")
    return KvRelease(kv_bytes=kv, released_bytes=released)


def expect_ok(answer: HttpAnswer, what: str) -> None:
    if answer.status is None or not 200 <= answer.status < 300:
        raise EngineCallFailed(f"{what}: {answer.describe()}", answer.status)


class HttpEngine:
    """What both engine surfaces share: the serving port from `--port` (else the engine's
    default), the rendezvous port on the unit that holds rank 0, and the readiness probe."""

    default_port: int
    # Environment variables the engine takes its API key from, when its command has no
    # `--api-key` (vLLM: VLLM_API_KEY).
    api_key_environment: tuple[str, ...] = ()

    def serving_port(self, command: Sequence[str]) -> int:
        return port_flag(command, self.default_port)

    def serves_api(self, command: Sequence[str]) -> bool:
        """Whether the unit's engine serves the HTTP surface (every unit, unless the engine
        has a headless mode that runs only workers)."""
        return True

    def api_key(self, command: Sequence[str], environment: Mapping[str, str]) -> str | None:
        """The key the engine demands of its clients: `--api-key KEY` or `--api-key=KEY` in
        its command (the engine's own precedence), else its environment variable."""
        found = flag_value(command, ("--api-key",))
        if found is None:
            found = next((environment[n] for n in self.api_key_environment
                          if environment.get(n)), None)
        return found or None

    def listen_ports(self, command: Sequence[str], environment: dict[str, str], *,
                     holds_rank0: bool) -> list[int]:
        ports = {self.serving_port(command)} if self.serves_api(command) else set()
        rendezvous = master_port(command, environment)
        if holds_rank0 and rendezvous is not None:
            ports.add(rendezvous)
        return sorted(ports)

    async def ready(self, ep: EngineEndpoint, health_path: str) -> HttpAnswer:
        return await ep.call("GET", health_path, timeout=10)

    # The gauges of the engine's /metrics whose sum is the requests it is running or holding
    # in its queue.
    in_flight_metrics: tuple[str, ...]
    cpu_worker_titles: tuple[str, ...]

    async def in_flight(self, ep: EngineEndpoint) -> int:
        """The requests the engine is running or holds waiting, from its own /metrics."""
        ans = await ep.call("GET", "/metrics", timeout=10)
        expect_ok(ans, "GET /metrics")
        count = requests_in_flight(ans.text, self.in_flight_metrics)
        if count is None:
            raise EngineCallFailed(
                f"GET /metrics has none of {', '.join(self.in_flight_metrics)}: the engine "
                "cannot say whether requests are in flight, so it cannot be drained")
        return count

    def can_keep_kv_cache(self, accelerator: str) -> bool:
        """Whether a quiesce on `accelerator` can keep the KV cache (kv_discard: false)."""
        return True

    def kv_release_argv(self, accelerator: str) -> tuple[str, ...] | None:
        """No KV release after a drain: the engine's KV space stays in its snapshot."""
        return None

    async def drain(self, ep: EngineEndpoint, *, timeout: float = 600.0,  # noqa: ASYNC109
                    interval: float = 0.2) -> None:
        # Two idle readings in a row: an engine's gauges are refreshed once per scheduler
        # step, so a request that has just arrived may not be counted by the first.
        deadline = time.monotonic() + timeout
        idle = 0
        while idle < 2:
            count = await self.in_flight(ep)
            idle = idle + 1 if count == 0 else 0
            if count and time.monotonic() > deadline:
                raise EngineCallFailed(f"{count} request(s) still running or waiting after "
                                       f"{timeout:.0f}s of draining")
            if idle < 2:
                await asyncio.sleep(interval)


class EngineAdapter(Protocol):
    """One engine's public surface. Implementations are stateless."""

    name: str
    # Whether its quiesce can drop the weights and its resume reload them from disk.
    can_release_weights: bool

    def serving_port(self, command: Sequence[str]) -> int:
        """The HTTP port the unit's engine serves on."""
        ...

    def can_keep_kv_cache(self, accelerator: str) -> bool:
        """Whether its quiesce on `accelerator` ("gpu", "cpu") can keep the KV cache
        (policy.process.kv_discard: false)."""
        ...

    def kv_release_argv(self, accelerator: str) -> tuple[str, ...] | None:
        """The command that, run inside the unit's own container after a drain on
        `accelerator` (where there is no sleep), has the engine give its KV cache's memory
        back to the kernel, with anything that points into it (a prefix cache) forgotten, so
        that a snapshot taken now holds none of it and the engine answers as before; its
        answer is read by `kv_release`. None: the engine has no such call, and its KV space
        stays in the snapshot. A command in the container, not an HTTP route: no other
        engine on the host can reach it."""
        ...

    def api_key(self, command: Sequence[str], environment: Mapping[str, str]) -> str | None:
        """The API key the engine was started with (None: it demands none)."""
        ...

    def serves_api(self, command: Sequence[str]) -> bool:
        """Whether the unit's engine serves the HTTP surface; a headless unit runs workers
        only: no readiness probe, no quiesce or resume call, no serving port."""
        ...

    def crossing(self, accelerator: str) -> Crossing | None:
        """How the engine on `accelerator` ("gpu", "cpu") crosses a restore onto other
        addresses (Crossing)."""
        ...

    def listen_ports(self, command: Sequence[str], environment: dict[str, str], *,
                     holds_rank0: bool) -> list[int]:
        """Every TCP port the unit's engine listens on (admission checks they are free)."""
        ...

    def model_dir(self, command: Sequence[str]) -> str | None:
        """The model directory inside the container, from the command line."""
        ...

    async def ready(self, ep: EngineEndpoint, health_path: str) -> HttpAnswer:
        """One readiness probe; status 200 means ready to serve."""
        ...

    async def quiesce(self, ep: EngineEndpoint, *, release_weights: bool = False,
                      discard_kv: bool = True) -> None:
        """Drain requests and put the engine to sleep, closing its cross-worker connections:
        the KV cache dropped (`discard_kv`) and, with `release_weights`, the weights dropped
        too, so that a snapshot taken now holds neither."""
        ...

    @property
    def cpu_worker_titles(self) -> tuple[str, ...]:
        """Process titles (the start of /proc/PID/cmdline) of the engine's workers on the
        CPU, in order of preference: the first title any process of the unit has names its
        workers."""
        ...

    async def drain(self, ep: EngineEndpoint, *, timeout: float = 600.0,  # noqa: ASYNC109
                    interval: float = 0.2) -> None:
        """Wait until the engine runs no request and holds none waiting, read from its own
        metrics: the quiesce of an engine that has no sleep mode (on the CPU)."""
        ...

    async def is_sleeping(self, ep: EngineEndpoint) -> bool | None:
        """Whether the engine is quiesced, when its surface can say (None: it cannot; the
        readiness probe is all there is)."""
        ...

    async def resume(self, ep: EngineEndpoint, *, model_dir: str | None = None,
                     discard_kv: bool = True) -> None:
        """Undo `quiesce`: the engine reads any new placement and rebuilds its cross-worker
        connections; with `model_dir` (the weights were released) it reloads its weights from
        there, through the engine's own reload call."""
        ...

    async def complete(self, ep: EngineEndpoint, prompt: str, *, timeout: float) -> str:  # noqa: ASYNC109
        """Send one prompt (greedy, short); return the generated text."""
        ...
