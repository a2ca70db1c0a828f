"""SSHHost against the dev cluster's real sshd hosts."""

from __future__ import annotations

import asyncio
import io
import secrets
import tarfile
from pathlib import Path

import asyncssh
import docker
import pytest

from coldsnap.capsule.session import docker_relay
from coldsnap.hosts.base import (
    CommandFailed,
    CommandTimeout,
    Host,
    HostAuthFailed,
    HostKeyRejected,
    HostUnreachable,
)
from coldsnap.hosts.host_keys import known_hosts_pattern
from coldsnap.hosts.inventory import HostEntry, Inventory
from coldsnap.hosts.pool import HostPool
from coldsnap.hosts.ssh import SSHHost, SSHSettings
from coldsnap.hosts.transfer.streams import RemoteStream

from .conftest import ClusterControl

pytestmark = pytest.mark.integration

FAST = SSHSettings(connect_attempts=2, retry_initial=0.05, retry_max=0.2)


def token() -> str:
    """A sleep duration unique to this test run, so pgrep finds only our processes."""
    return f"{secrets.randbelow(10**6) + 10**6}.{secrets.randbelow(1000):03d}"


async def pids_matching(host: Host, pattern: str) -> list[int]:
    r = await host.run(["pgrep", "-f", pattern], check=False)
    assert r.exit_status in (0, 1), r
    return [int(p) for p in r.stdout.split()]


async def wait_for_pids(host: Host, pattern: str, at_least: int = 1) -> list[int]:
    for _ in range(200):
        pids = await pids_matching(host, pattern)
        if len(pids) >= at_least:
            return pids
        await asyncio.sleep(0.05)
    raise AssertionError(f"no process matching {pattern!r} ever started")


def entry(dev_hosts: Inventory, name: str = "host-1", **changes: object) -> HostEntry:
    return dev_hosts.get(name).model_copy(update=changes)


async def test_run_passes_argv_verbatim(pool: HostPool) -> None:
    host = pool.host("host-0")
    tricky = ["it's", "two words", "$HOME", "`id`", "a;b", "*", "", "\\n"]
    r = await host.run(["printf", "[%s]\\n", *tricky])
    assert r.ok
    assert r.stdout.decode().splitlines() == [f"[{w}]" for w in tricky]


async def test_run_feeds_stdin_and_reports_status(pool: HostPool) -> None:
    host = pool.host("host-0")
    r = await host.run(
        ["sh", "-c", "tr a-z A-Z; echo oops >&2; exit 7"], input=b"hello", check=False
    )
    assert (r.exit_status, r.stdout, r.stderr) == (7, b"HELLO", b"oops\n")
    with pytest.raises(CommandFailed) as info:
        await host.run(["sh", "-c", "echo broken >&2; exit 3"])
    assert info.value.result.exit_status == 3
    assert "broken" in str(info.value)


async def test_a_command_that_ends_before_its_stdin_is_closed_still_reports_its_status(
        pool: HostPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quick command can exit, and its channel close, before this side closes its stdin: the
    controller paused (SIGSTOP, a loaded node) between reading the pid line and feeding input.
    That is the command's outcome, not a lost connection."""
    host = pool.host("host-0")
    assert isinstance(host, SSHHost)
    opened = host._open

    class LateReader:
        """Hands over the pid line, then holds the caller while the remote side finishes."""

        def __init__(self, inner: asyncssh.SSHReader[bytes]) -> None:
            self.inner = inner

        async def readline(self) -> bytes:
            line = await self.inner.readline()
            await self.inner.channel.wait_closed()
            return line

        async def read(self, n: int = -1) -> bytes:
            return await self.inner.read(n)

    async def open_late(command: str) -> RemoteStream:
        stream = await opened(command)
        return RemoteStream(stream.stdin, LateReader(stream.stdout), stream.stderr)  # type: ignore[arg-type]

    monkeypatch.setattr(host, "_open", open_late)
    r = await host.run(["sh", "-c", "echo done; exit 4"], check=False)
    assert (r.exit_status, r.stdout) == (4, b"done\n")
    r = await host.run(["echo", "unread input"], input=b"x" * 4096)
    assert r.stdout == b"unread input\n"


async def test_a_command_cancelled_while_its_channel_opens_is_killed_on_the_host(
        pool: HostPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host may start a command before this side learns that its channel is open; a
    cancellation in that gap must not leave the command running unseen."""
    host = pool.host("host-0")
    assert isinstance(host, SSHHost)
    opened = host._open
    started = asyncio.Event()
    marker = token()

    async def open_slowly(command: str) -> RemoteStream:
        stream = await opened(command)
        if command.endswith(f" sleep {marker}"):  # only this one; pgrep's open as usual
            started.set()
            await asyncio.sleep(2)  # the confirmation still on its way
        return stream

    monkeypatch.setattr(host, "_open", open_slowly)
    task = asyncio.ensure_future(host.run(["sleep", marker]))
    await started.wait()
    await wait_for_pids(host, f"sleep {marker}")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    monkeypatch.undo()
    assert await pids_matching(host, f"sleep {marker}") == []


async def test_failed_command_is_not_retried(pool: HostPool, dev_hosts: Inventory) -> None:
    host = pool.host("host-0")
    marker = f"{dev_hosts.get('host-0').data_dir}/retry-{secrets.token_hex(4)}"
    with pytest.raises(CommandFailed):
        await host.run(["sh", "-c", 'echo ran >> "$1"; exit 9', "sh", marker])
    r = await host.run(["cat", marker])
    await host.run(["rm", "-f", marker])
    assert r.stdout == b"ran\n"


async def test_timeout_kills_the_remote_process_tree(pool: HostPool) -> None:
    host = pool.host("host-1")
    t = token()
    task = asyncio.create_task(host.run(["sh", "-c", f"sleep {t} & sleep {t}; wait"], timeout=3.0))
    # The shell and both children: all of them must die, not just the one sshd started.
    await wait_for_pids(host, f"sleep {t}", at_least=3)
    with pytest.raises(CommandTimeout):
        await task
    assert await pids_matching(host, f"sleep {t}") == []


async def test_cancellation_kills_the_remote_process(pool: HostPool) -> None:
    host = pool.host("host-1")
    t = token()
    task = asyncio.create_task(host.run(["sleep", t]))
    await wait_for_pids(host, f"sleep {t}")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await pids_matching(host, f"sleep {t}") == []


async def test_many_commands_share_one_connection_within_the_channel_limit(
    dev_hosts: Inventory,
) -> None:
    entry = dev_hosts.get("host-2")
    host = SSHHost(entry, SSHSettings(max_channels=3))
    probe_dir = f"{entry.data_dir}/channels-{secrets.token_hex(4)}"
    # Each command registers itself in a directory, counts who else is there, and leaves.
    script = 'touch "$1/$$"; ls "$1" | wc -l; sleep 0.3; rm -f "$1/$$"'
    try:
        await host.run(["mkdir", "-p", probe_dir])
        results = await asyncio.gather(
            *(host.run(["sh", "-c", script, "sh", probe_dir]) for _ in range(9))
        )
        seen = [int(r.stdout) for r in results]
        assert max(seen) <= 3, seen
        echo = await asyncio.gather(*(host.run(["echo", str(i)]) for i in range(30)))
        assert [r.stdout for r in echo] == [f"{i}\n".encode() for i in range(30)]
        assert host.connects == 1
    finally:
        await host.run(["rm", "-rf", probe_dir], check=False)
        await host.close()


async def test_gather_gives_each_host_its_own_outcome(
    dev_hosts: Inventory, cluster: ClusterControl
) -> None:
    names = dev_hosts.names[:3]
    async with HostPool([dev_hosts.get(n) for n in names], FAST) as p:
        with cluster.host_stopped(names[1]):
            outcomes = await p.gather(lambda h: h.run(["echo", h.name]))
    assert [o.host for o in outcomes] == names
    assert [o.ok for o in outcomes] == [True, False, True]
    assert isinstance(outcomes[1].error, HostUnreachable)
    assert outcomes[0].value is not None and outcomes[0].value.stdout == f"{names[0]}\n".encode()


async def test_unknown_host_key_is_refused(dev_hosts: Inventory, tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    other = dev_hosts.get("host-2")
    # A file that knows a different host only.
    kh.write_text(
        next(
            line
            for line in other.known_hosts.read_text().splitlines()
            if line.startswith(known_hosts_pattern(other.address, other.port) + " ")
        )
        + "\n"
    )
    host = SSHHost(entry(dev_hosts, "host-1", known_hosts=kh), FAST)
    with pytest.raises(HostKeyRejected, match="unknown"):
        await host.run(["true"])
    assert host.connects == 0


async def test_changed_host_key_is_refused_even_with_accept_new(
    dev_hosts: Inventory, tmp_path: Path
) -> None:
    target = dev_hosts.get("host-1")
    impostor = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
    kh = tmp_path / "known_hosts"
    kh.write_text(f"{known_hosts_pattern(target.address, target.port)} {impostor}")
    before = kh.read_text()
    for policy in ("strict", "accept-new"):
        host = SSHHost(entry(dev_hosts, known_hosts=kh, host_key_policy=policy), FAST)
        with pytest.raises(HostKeyRejected, match="DIFFERS"):
            await host.run(["true"])
    assert kh.read_text() == before


async def test_accept_new_appends_once_and_keeps_existing_lines(
    dev_hosts: Inventory, tmp_path: Path
) -> None:
    kh = tmp_path / "known_hosts"
    original = "# hand-written comment\n10.9.9.9 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA==\n"
    kh.write_text(original)
    e = entry(dev_hosts, "host-1", known_hosts=kh, host_key_policy="accept-new")
    for _ in range(2):
        host = SSHHost(e, FAST)
        assert (await host.run(["echo", "ok"])).stdout == b"ok\n"
        await host.close()
    text = kh.read_text()
    assert text.startswith(original)
    added = text[len(original) :].splitlines()
    assert len(added) == 1
    assert added[0].startswith(known_hosts_pattern(e.address, e.port) + " ssh-ed25519 ")
    # The appended key is the host's real key: a strict connection now works.
    strict = SSHHost(e.model_copy(update={"host_key_policy": "strict"}), FAST)
    try:
        assert (await strict.run(["true"])).ok
    finally:
        await strict.close()


async def test_wrong_client_key_is_refused(dev_hosts: Inventory, tmp_path: Path) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    path = tmp_path / "id_ed25519"
    key.write_private_key(str(path))
    path.chmod(0o600)
    host = SSHHost(entry(dev_hosts, identity_file=path), FAST)
    with pytest.raises(HostAuthFailed, match="refused our key"):
        await host.run(["true"])


async def test_stopped_host_is_unreachable_then_comes_back(
    dev_hosts: Inventory, cluster: ClusterControl
) -> None:
    host = SSHHost(dev_hosts.get("host-2"), FAST)
    try:
        assert (await host.run(["true"])).ok
        with cluster.host_stopped("host-2"), pytest.raises(HostUnreachable):
            await host.run(["true"])
        # Same object, new connection: the pool needs no manual reset after an outage.
        assert (await host.run(["true"])).ok
        assert host.connects == 2
    finally:
        await host.close()


async def test_proxy_jump_goes_through_the_jump_host(
    dev_hosts: Inventory, cluster: ClusterControl
) -> None:
    jumped = entry(dev_hosts, "host-1", proxy_jump="host-0")
    entries = [dev_hosts.get("host-0"), jumped]
    async with HostPool(entries, FAST) as p:
        r = await p.host("host-1").run(["sh", "-c", "echo $COLDSNAP_DEV_HOST"])
        assert r.stdout == b"host-1\n"
    # Proof that the jump host carries the connection: without it, host-1 is unreachable
    # through this entry although host-1 itself is up.
    with cluster.host_stopped("host-0"):
        async with HostPool(entries, FAST) as p:
            with pytest.raises(HostUnreachable):
                await p.host("host-1").run(["true"])
        direct = SSHHost(dev_hosts.get("host-1"), FAST)
        try:
            assert (await direct.run(["true"])).ok
        finally:
            await direct.close()


def _tiny_rootfs_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"coldsnap forwarded-socket test\n"
        info = tarfile.TarInfo("etc/coldsnap-test")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def test_docker_sdk_through_the_relayed_socket(pool: HostPool, dev_hosts: Inventory) -> None:
    sockets = {h.name: h.docker_socket for h in dev_hosts.hosts[:2]}
    if None in sockets.values():
        pytest.fail("the dev cluster runs without Docker; start it with `scripts/dev-cluster up 4`")
    repo = f"coldsnap-test/fwd-{secrets.token_hex(4)}"
    host0, host1 = pool.host("host-0"), pool.host("host-1")
    sock0, sock1 = sockets["host-0"], sockets["host-1"]
    assert sock0 is not None and sock1 is not None
    async with docker_relay(host1, sock1) as local1:
        assert local1 != sock1
        # The SDK is synchronous and the forward is served by this event loop: the SDK
        # must run in a thread, or the two would wait on each other.
        client = await asyncio.to_thread(docker.DockerClient, base_url=f"unix://{local1}")
        try:
            await asyncio.to_thread(client.containers.list, all=True)
            await asyncio.to_thread(
                client.api.import_image_from_data, _tiny_rootfs_tar(), repository=repo, tag="1"
            )
            image = await asyncio.to_thread(client.images.get, f"{repo}:1")
            # The image landed in host-1's own engine...
            r = await host1.run(["docker", "image", "inspect", "--format", "{{.Id}}", f"{repo}:1"])
            assert r.stdout.decode().strip() == image.id
            # ...and not in host-0's, which has its own image store.
            async with docker_relay(host0, sock0) as local0:
                other = await asyncio.to_thread(docker.DockerClient, base_url=f"unix://{local0}")
                try:
                    with pytest.raises(docker.errors.ImageNotFound):
                        await asyncio.to_thread(other.images.get, f"{repo}:1")
                finally:
                    other.close()
        finally:
            await asyncio.to_thread(client.images.remove, f"{repo}:1", force=True)
            client.close()
