"""What a host's network says about an address: what a name resolves to there, and whether a
TCP connection from the host reaches `address:port`.

Network admission (coldsnap.network_admission) asks these for rendezvous values only; the host's
own interfaces and addresses come with its facts (coldsnap.hosts.probe). The name is an argv
element, never part of a shell string.
"""

from __future__ import annotations

from coldsnap.hosts.base import Host, HostError


async def resolve_name(host: Host, name: str, *,
                       timeout: float = 10.0) -> list[str]:  # noqa: ASYNC109
    """The addresses `name` resolves to on the host (its resolver, /etc/hosts included); empty
    when it does not resolve there or the host has no `getent`."""
    if name.startswith("-"):
        return []  # not a name, and never an option to getent
    try:
        res = await host.run(["getent", "ahosts", name], timeout=timeout, check=False)
    except HostError:
        return []
    if res.exit_status != 0:
        return []
    return sorted({line.split()[0] for line in res.stdout.decode(errors="replace").splitlines()
                   if line.split()})


async def tcp_refusal(host: Host, address: str, port: int, *,
                      timeout: float = 5.0) -> str | None:  # noqa: ASYNC109
    """None when a TCP connection from the host reaches `address:port`; else why not."""
    try:
        async with host.open_tcp(address, port, timeout=timeout):
            return None
    except HostError as exc:
        return exc.message
