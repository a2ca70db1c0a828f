"""The network lock coldsnapd holds on a unit's host instead of CRIU's own.

CRIU's lock lives from the start of one unit's dump (or restore) to its end; a workload split
across hosts needs every unit's connections held before the first unit is dumped or restored
and released only once every unit is back, or a peer's kernel answers the packets of a unit
that is not there yet with a reset. So coldsnapd locks each unit's TCP endpoints itself (an
nftables table per unit, dropping only the packets of those endpoints), runs CRIU with
`--network-lock skip`, and unlocks every unit together.

The endpoints of a live unit come from its engine tree's sockets (`live_sockets`); those of a
unit about to be restored, from its (rewritten) images (`socket_images.inet_sockets`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.handle import UnitHandle
from coldsnap.capsule.session import CapsuleSession, ExecOutput
from coldsnap.capsule.socket_images import PROGRAM as SOCKETS_PROGRAM
from coldsnap.capsule.socket_images import InetSocket
from coldsnap.capsule.spec import PYTHON
from coldsnap.hosts.base import HostError

LOCK_PROGRAM = (Path(__file__).parent / "netlock_program.py").read_text(encoding="utf-8")
# Each is one nftables transaction or one walk of /proc: seconds at most, even on a busy host.
LOCK_TIMEOUT_S = 30.0
SOCKETS_TIMEOUT_S = 60.0
# The flags a unit that keeps its sessions gives CRIU instead of its own lock.
CRIU_SESSION_FLAGS = ("--tcp-established", "--network-lock", "skip")

Endpoint = tuple[str, int]


class NetworkLockFailed(CapsuleError):
    """A unit's network could not be locked or unlocked, or its sockets listed."""


def lock_table(workload_key: str, unit_id: str) -> str:
    """The nftables table of one unit's lock: stable for the pair, and a valid name."""
    digest = hashlib.sha256(f"{workload_key}\0{unit_id}".encode()).hexdigest()
    return f"coldsnap_{digest[:20]}"


def endpoints_of(sockets: Iterable[InetSocket]) -> list[Endpoint]:
    """The local ends of the TCP sockets, as the lock takes them: IPv4-mapped IPv6 as IPv4,
    each once, in order."""
    out = {(s.src[7:] if s.src.startswith("::ffff:") and "." in s.src else s.src, s.sport)
           for s in sockets if s.proto == "tcp" and s.sport}
    return sorted(out)


def lock_argv(table: str, endpoints: Sequence[Endpoint]) -> list[str]:
    return [*PYTHON, "-c", LOCK_PROGRAM, "lock", table,
            json.dumps([[a, p] for a, p in endpoints])]


def unlock_argv(table: str) -> list[str]:
    return [*PYTHON, "-c", LOCK_PROGRAM, "unlock", table]


def has_argv(table: str) -> list[str]:
    return [*PYTHON, "-c", LOCK_PROGRAM, "has", table]


def sockets_argv(pid: int) -> list[str]:
    return [*PYTHON, "-c", SOCKETS_PROGRAM, "live", str(pid)]


async def _run(s: CapsuleSession, handle: UnitHandle, argv: list[str], step: str,
               timeout_s: float) -> ExecOutput:
    container = await s.container(handle.container_id, handle.unit, step)
    try:
        return await s.exec(container, argv, timeout_s=timeout_s)
    except TimeoutError:
        raise NetworkLockFailed(s.host, handle.unit, step,
                                f"no answer within {timeout_s:.0f} s") from None
    except HostError as exc:
        raise NetworkLockFailed(s.host, handle.unit, step, str(exc)) from exc


async def lock_unit(s: CapsuleSession, handle: UnitHandle, table: str,
                    endpoints: Sequence[Endpoint], *,
                    timeout_s: float = LOCK_TIMEOUT_S) -> None:
    """Hold every TCP packet of the unit's endpoints on its host (again: the table is made
    anew, in one transaction)."""
    await _run_checked(s, handle, lock_argv(table, endpoints), "network lock", timeout_s)


async def unlock_unit(s: CapsuleSession, handle: UnitHandle, table: str, *,
                      timeout_s: float = LOCK_TIMEOUT_S) -> None:
    """Release the unit's lock; a lock that is not there is already released."""
    await _run_checked(s, handle, unlock_argv(table), "network unlock", timeout_s)


async def _run_checked(s: CapsuleSession, handle: UnitHandle, argv: list[str], step: str,
                       timeout_s: float) -> None:
    """_run, with a nonzero exit a NetworkLockFailed naming the step."""
    out = await _run(s, handle, argv, step, timeout_s)
    if not out.ok:
        raise NetworkLockFailed(s.host, handle.unit, step,
                                f"exit {out.exit_status}: {out.tail(500)}")


async def is_locked(s: CapsuleSession, handle: UnitHandle, table: str, *,
                    timeout_s: float = LOCK_TIMEOUT_S) -> bool:
    out = await _run(s, handle, has_argv(table), "network lock check", timeout_s)
    if out.exit_status not in (0, 1):
        raise NetworkLockFailed(s.host, handle.unit, "network lock check",
                                f"exit {out.exit_status}: {out.tail(500)}")
    return out.exit_status == 0


def parse_sockets(text: str) -> list[InetSocket]:
    """The JSON list the sockets program prints, checked field by field."""
    raw = json.loads(text)
    if not isinstance(raw, list):
        raise ValueError("not a list")
    out = []
    for item in raw:
        if not isinstance(item, dict):
            raise ValueError(f"{item!r} is not a socket")
        fam, sport, dport = item.get("family"), item.get("sport"), item.get("dport")
        texts = [item.get(k) for k in ("proto", "state", "src", "dst")]
        if (not isinstance(fam, int) or fam not in (4, 6) or not isinstance(sport, int)
                or not isinstance(dport, int) or not all(isinstance(t, str) for t in texts)):
            raise ValueError(f"{item!r} is not a socket")
        proto, state, src, dst = (str(t) for t in texts)
        out.append(InetSocket(fam, proto, state, src, sport, dst, dport))
    return out


async def live_sockets(s: CapsuleSession, handle: UnitHandle, *,
                       timeout_s: float = SOCKETS_TIMEOUT_S) -> list[InetSocket]:
    """The TCP sockets (listening and connected) that the unit's engine tree holds now."""
    step = "list sockets"
    if handle.engine_pid is None:
        raise NetworkLockFailed(s.host, handle.unit, step, "the unit has no engine process")
    out = await _run(s, handle, sockets_argv(handle.engine_pid), step, timeout_s)
    if not out.ok:
        raise NetworkLockFailed(s.host, handle.unit, step,
                                f"exit {out.exit_status}: {out.tail(500)}")
    try:
        return parse_sockets(out.stdout)
    except ValueError as exc:
        raise NetworkLockFailed(s.host, handle.unit, step,
                                f"unreadable answer: {exc}") from None
