"""The network lock's program, run inside a unit's container (host network) with the capsule's
python3: stdlib only, nftables through libnftables (the capsules carry libnftables1, not the
`nft` command).

    lock TABLE ENDPOINTS_JSON   table `inet TABLE` drops every TCP packet whose local end is
                                one of the endpoints ([[address, port], ...]); idempotent
    unlock TABLE                the table deleted; fine when it is absent
    has TABLE                   exit 0 when the table exists, 1 when not

Only the unit's own endpoints are matched (its address and port on output, the same as the
destination on input), so the host's other traffic, SSH included, is never held. A wildcard
endpoint (a listener on 0.0.0.0 or ::) matches its port on every address. Only tables named
as coldsnapd names them (`coldsnap_` and 20 hex digits) are ever touched."""

from __future__ import annotations

import ctypes
import ipaddress
import json
import re
import sys
from collections.abc import Sequence

TABLE_NAME = re.compile(r"coldsnap_[0-9a-f]{20}")
# Before conntrack (-200): a held packet leaves no trace in the connection table.
PRIORITY = -300
NOT_FOUND, FAILED = 1, 2


def check_table(name: str) -> str:
    if not TABLE_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a coldsnap lock table")
    return name


def check_endpoints(raw: object) -> list[tuple[str, int]]:
    """[[address, port], ...] as (address text, port), IPv4-mapped IPv6 as IPv4 (its packets
    are IPv4 on the wire)."""
    if not isinstance(raw, list):
        raise ValueError("endpoints must be a JSON list of [address, port]")
    out: set[tuple[str, int]] = set()
    for item in raw:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], int) or isinstance(item[1], bool)
                or not 0 < item[1] < 65536):
            raise ValueError(f"endpoint {item!r} is not [address, port]")
        addr = ipaddress.ip_address(item[0])
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        out.add((str(addr), item[1]))
    return sorted(out)


def _rules(hook: str, direction: str, endpoints: Sequence[tuple[str, int]]) -> list[str]:
    wild = [ipaddress.ip_address(a).is_unspecified for a, _ in endpoints]
    v4 = [f"{a} . {p}" for (a, p), w in zip(endpoints, wild, strict=True) if ":" not in a and not w]
    v6 = [f"{a} . {p}" for (a, p), w in zip(endpoints, wild, strict=True) if ":" in a and not w]
    anywhere = sorted({p for (_, p), w in zip(endpoints, wild, strict=True) if w})
    addr, port = ("saddr", "sport") if direction == "out" else ("daddr", "dport")
    rules = [f"    type filter hook {hook} priority {PRIORITY}; policy accept;"]
    if v4:
        rules.append(f"    ip {addr} . tcp {port} {{ {', '.join(v4)} }} drop")
    if v6:
        rules.append(f"    ip6 {addr} . tcp {port} {{ {', '.join(v6)} }} drop")
    if anywhere:
        rules.append(f"    tcp {port} {{ {', '.join(map(str, anywhere))} }} drop")
    return rules


def ruleset(table: str, endpoints: Sequence[tuple[str, int]]) -> str:
    """One nftables transaction: the table made anew (added first so that deleting it cannot
    fail), so a second lock replaces the first without a moment unlocked."""
    check_table(table)
    return "\n".join([
        f"add table inet {table}",
        f"delete table inet {table}",
        f"table inet {table} {{",
        "  chain output {", *_rules("output", "out", endpoints), "  }",
        "  chain input {", *_rules("input", "in", endpoints), "  }",
        "}", ""])


def unlock_commands(table: str) -> str:
    check_table(table)
    return f"add table inet {table}\ndelete table inet {table}\n"


def _nft(commands: str) -> tuple[int, str]:
    """(libnftables' status, its error text) for one buffer of commands."""
    try:
        lib = ctypes.CDLL("libnftables.so.1")
    except OSError as exc:
        raise RuntimeError(f"libnftables.so.1 is not in this capsule: {exc}") from None
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    for name in ("nft_ctx_buffer_output", "nft_ctx_buffer_error", "nft_ctx_free"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
    lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
    ctx = lib.nft_ctx_new(0)
    if not ctx:
        raise RuntimeError("nft_ctx_new failed")
    try:
        lib.nft_ctx_buffer_output(ctx)
        lib.nft_ctx_buffer_error(ctx)
        status = int(lib.nft_run_cmd_from_buffer(ctx, commands.encode()))
        err = lib.nft_ctx_get_error_buffer(ctx) or b""
        return status, err.decode(errors="replace").strip()
    finally:
        lib.nft_ctx_free(ctx)


def main(argv: Sequence[str]) -> int:
    try:
        if len(argv) == 3 and argv[0] == "lock":
            commands = ruleset(argv[1], check_endpoints(json.loads(argv[2])))
        elif len(argv) == 2 and argv[0] == "unlock":
            commands = unlock_commands(argv[1])
        elif len(argv) == 2 and argv[0] == "has":
            status, err = _nft(f"list table inet {check_table(argv[1])}\n")
            if status == 0:
                return 0
            if "No such file or directory" in err:
                return NOT_FOUND
            raise RuntimeError(err)
        else:
            raise ValueError("usage: lock TABLE ENDPOINTS_JSON | unlock TABLE | has TABLE")
        status, err = _nft(commands)
        if status != 0:
            raise RuntimeError(err or f"libnftables returned {status}")
    except (ValueError, RuntimeError) as exc:
        print(f"netlock: {exc}".replace("\n", " "), file=sys.stderr)
        return FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
