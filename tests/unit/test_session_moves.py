"""The address map of a workload moved with its TCP sessions, and what it changes."""

from __future__ import annotations

import pytest

from coldsnap.formats.capsule import CapsuleManifest, InetSocketRecord
from coldsnap.session_moves import (
    Endpoint,
    SessionMoveError,
    address_map,
    bind_endpoints,
    changed,
    crossing_hosts,
    lock_endpoints,
    mapped,
    rewritten,
)

HEAD, FOLLOWER = "198.18.0.2", "198.18.0.3"
NEW_HEAD, NEW_FOLLOWER = "198.18.0.4", "198.18.0.5"
MOVE = {HEAD: NEW_HEAD, FOLLOWER: NEW_FOLLOWER}


def sock(src: str, sport: int, dst: str = "0.0.0.0", dport: int = 0, *,
         state: str = "established", family: int = 4, proto: str = "tcp"
         ) -> InetSocketRecord:
    return InetSocketRecord(family=family, proto=proto, state=state, src=src, sport=sport,
                            dst=dst, dport=dport)


# A head's sockets as vLLM TP2 holds them: its API listener on the wildcard, a gloo listener
# and pair on its own address, the follower's c10d TCPStore connection seen from the store
# (dual-stack: IPv4-mapped), a loopback pair between its own processes.
HEAD_SOCKETS = [
    sock("0.0.0.0", 8000, state="listen"),
    sock("::", 29500, "::", 0, state="listen", family=6),
    sock(HEAD, 41000, state="listen"),
    sock(HEAD, 41000, FOLLOWER, 52000),
    sock(f"::ffff:{HEAD}", 29500, f"::ffff:{FOLLOWER}", 53000, family=6),
    sock("127.0.0.1", 45000, "127.0.0.1", 45001),
    sock(HEAD, 5353, FOLLOWER, 5353, proto="udp"),
]


def test_the_map_holds_every_moved_host_and_nothing_in_place() -> None:
    assert address_map({"unit-0": HEAD, "unit-1": FOLLOWER},
                       {"unit-0": NEW_HEAD, "unit-1": NEW_FOLLOWER}) == MOVE
    assert address_map({"unit-0": HEAD, "unit-1": FOLLOWER},
                       {"unit-0": HEAD, "unit-1": FOLLOWER}) == {}
    # Swapped: each address maps onto the other.
    assert address_map({"unit-0": HEAD, "unit-1": FOLLOWER},
                       {"unit-0": FOLLOWER, "unit-1": HEAD}) == {HEAD: FOLLOWER,
                                                                 FOLLOWER: HEAD}


def test_two_units_of_one_host_move_together() -> None:
    both = {"unit-0": HEAD, "unit-1": HEAD}
    assert address_map(both, {"unit-0": NEW_HEAD, "unit-1": NEW_HEAD}) == {HEAD: NEW_HEAD}


@pytest.mark.parametrize(("captured", "restored", "says"), [
    ({"unit-0": HEAD, "unit-1": HEAD}, {"unit-0": NEW_HEAD, "unit-1": NEW_FOLLOWER},
     "restored apart"),
    ({"unit-0": HEAD, "unit-1": FOLLOWER}, {"unit-0": NEW_HEAD, "unit-1": NEW_HEAD},
     "restored together"),
    ({"unit-0": HEAD}, {"unit-0": NEW_HEAD, "unit-1": NEW_FOLLOWER}, "unit-1"),
    ({"unit-0": "host-0.example"}, {"unit-0": NEW_HEAD}, "not an IPv4"),
])
def test_a_move_no_single_map_can_express_is_refused(
        captured: dict[str, str], restored: dict[str, str], says: str) -> None:
    with pytest.raises(SessionMoveError, match=says):
        address_map(captured, restored)


def test_the_map_rewrites_both_ends_and_mapped_ipv6_but_not_loopback_or_wildcard() -> None:
    assert mapped(HEAD, MOVE) == NEW_HEAD
    assert mapped(f"::ffff:{FOLLOWER}", MOVE) == f"::ffff:{NEW_FOLLOWER}"
    for untouched in ("0.0.0.0", "::", "127.0.0.1", "::ffff:127.0.0.1", "198.18.0.9"):
        assert mapped(untouched, MOVE) == untouched
    pair = rewritten(HEAD_SOCKETS[3], MOVE)
    assert (pair.src, pair.sport, pair.dst, pair.dport) == (NEW_HEAD, 41000, NEW_FOLLOWER,
                                                            52000)


def test_changed_counts_the_sockets_a_map_touches() -> None:
    # The gloo listener and pair, the TCPStore connection and the UDP socket; not the
    # wildcard listeners or the loopback pair.
    assert changed(HEAD_SOCKETS, MOVE) == 4
    assert changed(HEAD_SOCKETS, {}) == 0


def test_connections_between_hosts_are_the_established_non_loopback_tcp_ones() -> None:
    assert crossing_hosts(HEAD_SOCKETS) == [HEAD_SOCKETS[3], HEAD_SOCKETS[4]]


def test_the_lock_covers_the_local_ends_of_cross_host_connections_after_the_map() -> None:
    assert lock_endpoints(HEAD_SOCKETS, MOVE) == [Endpoint(NEW_HEAD, 29500),
                                                  Endpoint(NEW_HEAD, 41000)]
    assert lock_endpoints(HEAD_SOCKETS, {}) == [Endpoint(HEAD, 29500), Endpoint(HEAD, 41000)]


def test_every_tcp_port_the_restore_binds_is_probed_loopback_and_wildcard_included() -> None:
    assert bind_endpoints(HEAD_SOCKETS, MOVE) == sorted([
        Endpoint("0.0.0.0", 8000), Endpoint("::", 29500), Endpoint(NEW_HEAD, 41000),
        Endpoint(NEW_HEAD, 29500), Endpoint("127.0.0.1", 45000)])
    assert str(Endpoint("::", 29500)) == "[::]:29500"
    assert str(Endpoint(NEW_HEAD, 41000)) == f"{NEW_HEAD}:41000"


def test_a_manifest_written_before_sockets_were_recorded_still_reads() -> None:
    fields = CapsuleManifest.model_fields
    assert fields["crossing"].default is None
    assert fields["inet_sockets"].default_factory is not None
