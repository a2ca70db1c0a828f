"""Which TCP ports a host already listens on, read from the kernel's socket tables.

`/proc/net/tcp` and `/proc/net/tcp6` show the sockets of the network namespace of the reader,
which for a command run over SSH is the host's own network: the one a unit with host
networking will bind in. No tool beyond `cat` is needed on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

from coldsnap.hosts.base import Host, HostError

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


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket of a host: its local address (`*`, `0.0.0.0` and `::` mean
    every address), port, and the process holding it as `ss` names it ("" when unknown)."""

    address: str
    port: int
    holder: str

    def covers(self, address: str, port: int) -> bool:
        """Whether a bind of `address:port` would collide with this listener."""
        if port != self.port:
            return False
        wild = ("*", "0.0.0.0", "::", "[::]")  # noqa: S104 (compared, never bound)
        return self.address in wild or address in wild or \
            self.address.strip("[]") == address.removeprefix("::ffff:")


def parse_ss_listeners(text: str) -> list[Listener]:
    """`ss -Hltnp` output: `LISTEN 0 128 198.18.0.82:22 0.0.0.0:* users:(("sshd",pid=1,...))`."""
    found: list[Listener] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5 or ":" not in fields[3]:
            continue
        address, _, port = fields[3].rpartition(":")
        if not port.isdigit():
            continue
        address = address.split("%", 1)[0].strip("[]") or "*"
        users = " ".join(fields[5:])
        holder = ""
        if users.startswith("users:((") and '"' in users:
            name = users.split('"')[1]
            pid = users.split("pid=", 1)[1].split(",", 1)[0] if "pid=" in users else "?"
            holder = f"{name} (pid {pid})"
        found.append(Listener(address, int(port), holder))
    return found


async def listeners(host: Host, *, timeout: float = 20.0) -> list[Listener]:  # noqa: ASYNC109
    """The host's listening TCP sockets with their holders (`ss` from iproute2, which every
    host that runs dockerd has)."""
    res = await host.run(["ss", "-Hltnp"], timeout=timeout, check=False,
                         output_limit=64 << 20)
    if not res.ok:
        raise HostError(host.name, f"ss -Hltnp exited {res.exit_status}: "
                        f"{res.stderr.decode(errors='replace')[-300:]}")
    return parse_ss_listeners(res.stdout.decode(errors="replace"))
