"""A real `coldsnapd serve` process for tests and benchmarks, with its socket, state dir and
a real datagram socket passed as NOTIFY_SOCKET, as systemd passes one."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]


class Served:
    def __init__(self, work: Path, inventory: Path, store: Path, *extra: str,
                 env: dict[str, str] | None = None) -> None:
        self.work = work
        self.socket = work / "coldsnapd.sock"
        self.state_dir = work / "state"
        self.inventory = inventory
        self.store = store
        self.extra = extra
        self.env = env or {}
        self.notify_path = work / "notify.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if self.notify_path.exists():
            self.notify_path.unlink()
        self.notify.bind(str(self.notify_path))
        self.messages: list[dict[str, str]] = []
        self.proc: subprocess.Popen[str] | None = None
        self.log = work / "serve.log"

    def start(self, *, wait_ready: bool = True, timeout: float = 240) -> Served:
        argv = [sys.executable, "-m", "coldsnap", "serve", "--socket", str(self.socket),
                "--state-dir", str(self.state_dir), "--inventory", str(self.inventory),
                "--store", str(self.store), "--socket-group", "", *self.extra]
        env = dict(os.environ, PYTHONPATH=str(REPO), NOTIFY_SOCKET=str(self.notify_path),
                   **self.env)
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, text=True,
                                     stdout=subprocess.DEVNULL,
                                     stderr=self.log.open("a"))
        if wait_ready:
            self.wait_for("READY", timeout)
        return self

    def receive(self, timeout: float) -> dict[str, str] | None:
        self.notify.settimeout(timeout)
        try:
            data = self.notify.recv(4096)
        except TimeoutError:
            return None
        fields = dict(line.split("=", 1) for line in data.decode().splitlines())
        self.messages.append(fields)
        return fields

    def wait_for(self, key: str, timeout: float) -> dict[str, str]:
        """The first notification carrying `key` (earlier ones are kept in `messages`)."""
        for seen in self.messages:
            if key in seen:
                return seen
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                # What it sent before it exited is still queued on the socket.
                while (got := self.receive(0.05)) is not None:
                    if key in got:
                        return got
                raise AssertionError(f"coldsnapd serve exited {self.proc.returncode} before "
                                     f"{key}:\n{self.log.read_text()[-4000:]}")
            got = self.receive(min(1.0, max(deadline - time.monotonic(), 0.01)))
            if got is not None and key in got:
                return got
        raise AssertionError(f"no {key} from coldsnapd serve:\n{self.log.read_text()[-4000:]}")

    def call(self, method: str, path: str, body: Any = None, *,
             data: bytes | None = None) -> tuple[int, Any, str]:
        """One API call with `body` as JSON, or `data` as the raw body."""

        async def go() -> tuple[int, Any, str]:
            connector = aiohttp.UnixConnector(path=str(self.socket))
            sent: dict[str, Any] = {"data": data} if data is not None else {"json": body}
            async with aiohttp.ClientSession(connector=connector) as session, \
                    session.request(method, f"http://coldsnapd{path}", **sent,
                                    timeout=aiohttp.ClientTimeout(total=60)) as response:
                text = await response.text()
                try:
                    doc = json.loads(text)
                except ValueError:
                    doc = None
                return response.status, doc, text

        return asyncio.run(go())

    def cli(self, *args: str, timeout: float = 600,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "coldsnap", *args, "--socket",
                               str(self.socket)], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout, input=input,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))

    def stop(self, sig: int = 15, timeout: float = 480) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.notify.close()
