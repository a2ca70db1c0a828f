"""Real test registries (devtools.registry_server) on 127.0.0.1 free ports, one plain and one
with TLS and token authentication, each started once per test session. Tests use distinct
repositories so that they do not see each other's blobs."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.registry_server import RegistryServer, start_registry

_repos = itertools.count()


def free_port_pair() -> int:
    """A port P with P and P + 1 free (the token server takes P + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return int(port)
    raise RuntimeError("no two adjacent free ports on 127.0.0.1")


def new_repository(prefix: str = "coldsnap/test") -> str:
    return f"{prefix}{next(_repos)}"


def _start(tmp: Path, auth: bool) -> Iterator[RegistryServer]:
    server = start_registry(tmp, "127.0.0.1", free_port_pair(), auth=auth)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def plain_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    yield from _start(tmp_path_factory.mktemp("registry-plain"), False)


@pytest.fixture(scope="session")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    yield from _start(tmp_path_factory.mktemp("registry-auth"), True)
