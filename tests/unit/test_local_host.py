"""LocalHost: the Host protocol on the control node; no cluster needed."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import subprocess
from pathlib import Path

import pytest

from coldsnap.hosts.base import CommandFailed, CommandTimeout, Host, HostError
from coldsnap.hosts.local import LocalHost


def test_is_a_host() -> None:
    assert isinstance(LocalHost(), Host)


async def test_run_argv_stdin_status() -> None:
    h = LocalHost()
    r = await h.run(
        ["sh", "-c", 'tr a-z A-Z; echo "$1" >&2; exit 4', "sh", "a b"], input=b"abc", check=False
    )
    assert (r.exit_status, r.stdout, r.stderr) == (4, b"ABC", b"a b\n")
    with pytest.raises(CommandFailed):
        await h.run(["false"])


def _alive(pattern: str) -> bool:
    return subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 0


async def test_timeout_kills_process_group() -> None:
    t = f"{secrets.randbelow(10**6) + 10**6}.5"
    task = asyncio.create_task(
        LocalHost().run(["sh", "-c", f"sleep {t} & sleep {t}; wait"], timeout=5)
    )
    for _ in range(100):
        if _alive(f"sleep {t}"):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("never started")
    with pytest.raises(CommandTimeout):
        await task
    await asyncio.sleep(0.1)
    assert not _alive(f"sleep {t}")


async def test_put_get_verify_and_are_atomic(tmp_path: Path) -> None:
    h = LocalHost()
    src = tmp_path / "src"
    data = os.urandom(3 * 1024 * 1024 + 1)
    src.write_bytes(data)
    seen: list[int] = []
    r = await h.put(src, str(tmp_path / "d" / "dst"), progress=lambda d, t: seen.append(d))
    assert r.sha256 == "sha256:" + hashlib.sha256(data).hexdigest()
    assert (tmp_path / "d" / "dst").read_bytes() == data
    assert seen[-1] == len(data)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["dst"]
    g = await h.get(str(tmp_path / "d" / "dst"), tmp_path / "back", size=len(data))
    assert g.sha256 == r.sha256


async def test_open_unix_reaches_the_socket_itself(tmp_path: Path) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readexactly(4))
        writer.close()

    server = await asyncio.start_unix_server(echo, str(tmp_path / "s.sock"))
    async with server, LocalHost().open_unix(str(tmp_path / "s.sock")) as (reader, writer):
        writer.write(b"ping")
        await writer.drain()
        assert await reader.read() == b"ping"


async def test_open_unix_to_no_socket_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(HostError, match=r"absent\.sock"):
        async with LocalHost().open_unix(str(tmp_path / "absent.sock")):
            pass
