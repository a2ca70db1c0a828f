"""Which TCP ports a host already listens on, read from the kernel's socket tables.

`/proc/net/tcp` and `/proc/net/tcp6` show the sockets of the network namespace of the reader,
which for a command run over SSH is the host's own network: the one a unit with host
networking will bind in. No tool beyond `cat` is needed on the host.
"""

from __future__ import annotations

from coldsnap.hosts.base import Host

_LISTEN = "0A"


def parse_listening(table: str) -> set[int]:
    ports: set[int] = set()
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[3] != _LISTEN or ":" not in fields[1]:
            continue
        try:
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        except ValueError:
            continue
    return ports


async def listening_ports(host: Host, *, timeout: float = 20.0) -> set[int]:  # noqa: ASYNC109
    # ~150 bytes a socket: a busy host's tables run past the default output limit.
    res = await host.run(["cat", "/proc/net/tcp", "/proc/net/tcp6"], timeout=timeout,
                         check=False, output_limit=64 << 20)
    # tcp6 is absent on a kernel without IPv6; whatever was read still counts.
    return parse_listening(res.stdout.decode(errors="replace"))
