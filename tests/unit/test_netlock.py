"""The network lock: its table names, the program's argv and ruleset, and the helpers that run
it in a unit's container (against a stand-in session; tests/integration/
test_carried_connections.py runs the program under real nftables)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from typing import Any

import pytest

from coldsnap.capsule import netlock, netlock_program
from coldsnap.capsule.errors import CapsuleError
from coldsnap.capsule.netlock import (
    LOCK_PROGRAM,
    NetworkLockFailed,
    endpoints_of,
    live_sockets,
    lock_table,
    lock_unit,
    unlock_unit,
)
from coldsnap.capsule.session import ExecOutput
from coldsnap.capsule.socket_images import InetSocket
from coldsnap.hosts.base import HostUnreachable

TABLE = "coldsnap_" + "0123456789abcdef0123"


def test_lock_tables_are_valid_stable_and_per_unit() -> None:
    name = lock_table("workload-key", "unit-0")
    assert re.fullmatch(r"coldsnap_[0-9a-f]{20}", name)
    assert name == lock_table("workload-key", "unit-0")
    assert len({name, lock_table("workload-key", "unit-1"), lock_table("other", "unit-0"),
                 lock_table("workload-keyu", "nit-0")}) == 4
    assert netlock_program.check_table(name) == name


def test_endpoints_are_the_local_ends_of_tcp_sockets() -> None:
    sockets = [
        InetSocket(4, "tcp", "listen", "0.0.0.0", 8000, "0.0.0.0", 0),
        InetSocket(6, "tcp", "established", "::ffff:198.18.0.2", 29500, "::ffff:198.18.0.3", 4),
        InetSocket(4, "tcp", "established", "198.18.0.2", 29500, "198.18.0.3", 5),
        InetSocket(4, "udp", "established", "198.18.0.2", 7004, "198.18.0.3", 7004),
        InetSocket(6, "tcp", "listen", "::", 29501, "::", 0),
        InetSocket(4, "tcp", "close", "0.0.0.0", 0, "0.0.0.0", 0),
    ]
    assert endpoints_of(sockets) == [("0.0.0.0", 8000), ("198.18.0.2", 29500), ("::", 29501)]


def test_the_ruleset_drops_only_the_endpoints_in_one_transaction() -> None:
    endpoints = netlock_program.check_endpoints(
        [["198.18.0.2", 7001], ["::ffff:198.18.0.2", 7002], ["0.0.0.0", 8000], ["::", 29500],
         ["fe80::1", 9], ["198.18.0.2", 7001]])
    assert netlock_program.ruleset(TABLE, endpoints) == f"""\
add table inet {TABLE}
delete table inet {TABLE}
table inet {TABLE} {{
  chain output {{
    type filter hook output priority -300; policy accept;
    ip saddr . tcp sport {{ 198.18.0.2 . 7001, 198.18.0.2 . 7002 }} drop
    ip6 saddr . tcp sport {{ fe80::1 . 9 }} drop
    tcp sport {{ 8000, 29500 }} drop
  }}
  chain input {{
    type filter hook input priority -300; policy accept;
    ip daddr . tcp dport {{ 198.18.0.2 . 7001, 198.18.0.2 . 7002 }} drop
    ip6 daddr . tcp dport {{ fe80::1 . 9 }} drop
    tcp dport {{ 8000, 29500 }} drop
  }}
}}
"""


def test_no_endpoints_make_a_table_that_drops_nothing() -> None:
    text = netlock_program.ruleset(TABLE, [])
    assert "drop" not in text and text.count("policy accept") == 2


@pytest.mark.parametrize("raw", [{"a": 1}, [["198.18.0.2"]], [["198.18.0.2", 0]],
                                 [["198.18.0.2", 70000]], [["198.18.0.2", "80"]],
                                 [["198.18.0.2", True]], [["host-1", 80]],
                                 [["198.18.0.2 } accept; {", 80]]])
def test_endpoints_that_are_not_address_and_port_are_refused(raw: object) -> None:
    with pytest.raises(ValueError):
        netlock_program.check_endpoints(raw)


@pytest.mark.parametrize("name", ["coldsnap_0123", "filter", f"{TABLE}; flush ruleset",
                                  "coldsnap_" + "G" * 20, f"{TABLE}\n"])
def test_only_coldsnap_tables_are_ever_touched(name: str) -> None:
    with pytest.raises(ValueError):
        netlock_program.ruleset(name, [])
    with pytest.raises(ValueError):
        netlock_program.unlock_commands(name)


def test_argv_runs_the_program_with_the_capsules_python_isolated() -> None:
    py = ["/usr/bin/python3", "-I"]
    assert netlock.lock_argv(TABLE, [("198.18.0.2", 7001), ("::", 80)]) == [
        *py, "-c", LOCK_PROGRAM, "lock", TABLE, '[["198.18.0.2", 7001], ["::", 80]]']
    assert netlock.unlock_argv(TABLE) == [*py, "-c", LOCK_PROGRAM, "unlock", TABLE]
    assert netlock.has_argv(TABLE) == [*py, "-c", LOCK_PROGRAM, "has", TABLE]
    assert netlock.sockets_argv(12) == [*py, "-c", netlock.SOCKETS_PROGRAM, "live", "12"]
    assert "--network-lock" in netlock.CRIU_SESSION_FLAGS


@pytest.mark.parametrize("args", [["lock", "filter", "[]"], ["lock", TABLE, "{"],
                                  ["lock", TABLE, '[["x", 1]]'], ["unlock", "filter"],
                                  ["has", "nat"], ["flush"]])
def test_the_program_refuses_bad_input_before_touching_nftables(args: list[str]) -> None:
    # -I: the capsule's bare python3 has nothing but the standard library.
    res = subprocess.run([sys.executable, "-I", "-c", LOCK_PROGRAM, *args],
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == netlock_program.FAILED
    assert res.stderr.startswith("netlock: ") and res.stderr.count("\n") == 1


def test_sockets_answers_are_checked() -> None:
    good = [{"family": 4, "proto": "tcp", "state": "listen", "src": "0.0.0.0", "sport": 80,
             "dst": "0.0.0.0", "dport": 0}]
    assert netlock.parse_sockets(json.dumps(good)) == [
        InetSocket(4, "tcp", "listen", "0.0.0.0", 80, "0.0.0.0", 0)]
    for bad in ({}, [1], [{**good[0], "family": 5}], [{**good[0], "sport": "80"}],
                [{**good[0], "src": None}]):
        with pytest.raises(ValueError):
            netlock.parse_sockets(json.dumps(bad))


class _Handle:
    unit = "unit-1"
    container_id = "c1"
    engine_pid: int | None = 10042


class _Session:
    """Stands in for CapsuleSession: records each exec, answers with a scripted outcome."""

    host = "host-1"

    def __init__(self, answer: ExecOutput | BaseException) -> None:
        self.answer = answer
        self.calls: list[tuple[list[str], float | None]] = []

    async def container(self, container_id: str, unit: str, step: str) -> Any:
        return container_id

    async def exec(self, container: Any, argv: list[str], *, timeout_s: float | None = None,
                   **_: Any) -> ExecOutput:
        self.calls.append((argv, timeout_s))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


async def test_lock_and_unlock_run_the_program_with_a_timeout() -> None:
    s = _Session(ExecOutput(0, "", ""))
    await lock_unit(s, _Handle(), TABLE, [("198.18.0.2", 7001)])  # type: ignore[arg-type]
    await unlock_unit(s, _Handle(), TABLE, timeout_s=5)  # type: ignore[arg-type]
    assert [c[0][4:] for c in s.calls] == [
        ["lock", TABLE, '[["198.18.0.2", 7001]]'], ["unlock", TABLE]]
    assert [c[1] for c in s.calls] == [netlock.LOCK_TIMEOUT_S, 5]


@pytest.mark.parametrize("answer", [ExecOutput(2, "", "netlock: Error: Could not process"),
                                    TimeoutError(), HostUnreachable("host-1", "gone")])
async def test_a_failed_lock_names_host_unit_and_step(answer: Any) -> None:
    for call in (lambda s: lock_unit(s, _Handle(), TABLE, []),
                 lambda s: unlock_unit(s, _Handle(), TABLE)):
        with pytest.raises(NetworkLockFailed) as err:
            await asyncio.wait_for(call(_Session(answer)), 10)
        assert isinstance(err.value, CapsuleError)
        assert (err.value.host, err.value.unit) == ("host-1", "unit-1")
        assert err.value.step in ("network lock", "network unlock")


async def test_live_sockets_reads_the_programs_answer() -> None:
    answer = json.dumps([{"family": 6, "proto": "tcp", "state": "established",
                          "src": "::ffff:198.18.0.2", "sport": 29500,
                          "dst": "::ffff:198.18.0.3", "dport": 40000}])
    s = _Session(ExecOutput(0, answer, ""))
    assert await live_sockets(s, _Handle()) == [  # type: ignore[arg-type]
        InetSocket(6, "tcp", "established", "::ffff:198.18.0.2", 29500, "::ffff:198.18.0.3",
                   40000)]
    assert s.calls[0][0] == netlock.sockets_argv(10042)
    with pytest.raises(NetworkLockFailed, match="unreadable"):
        await live_sockets(_Session(ExecOutput(0, "[", "")), _Handle())  # type: ignore[arg-type]
    handle = _Handle()
    handle.engine_pid = None
    with pytest.raises(NetworkLockFailed, match="no engine"):
        await live_sockets(_Session(ExecOutput(0, "[]", "")), handle)  # type: ignore[arg-type]
