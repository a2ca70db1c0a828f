"""A plain-HTTP docker-registry (CNCF distribution) on 127.0.0.1 for the tests of the registry
modes: anonymous push and pull, its storage under the test's tmp_path."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Served:
    address: str
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_registry(tmp_path: Path) -> Iterator[Served]:
    """A plain-HTTP docker-registry with its storage under tmp_path, anonymous push and pull."""
    port = _free_port()
    config = tmp_path / "registry.yml"
    config.write_text(json.dumps({
        "version": 0.1, "log": {"level": "error", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(tmp_path / "registry")}},
        "http": {"addr": f"127.0.0.1:{port}"}}))
    log = (tmp_path / "registry.log").open("wb")
    proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log,
                            stderr=subprocess.STDOUT)
    served = Served(f"127.0.0.1:{port}", proc)
    for _ in range(300):
        try:
            with urllib.request.urlopen(f"http://{served.address}/v2/", timeout=5):
                break
        except OSError:
            assert proc.poll() is None, (tmp_path / "registry.log").read_text()
            time.sleep(0.05)
    try:
        yield served
    finally:
        if proc.poll() is None:
            served.stop()
        log.close()
