"""A command run in a container returns all of its output even when the daemon's `101
UPGRADED` headers and the output arrive in one read, as they often do through the
SSH-forwarded Docker socket: docker-py's own `exec_run` loses those bytes."""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from coldsnap.capsule.docker_exec import exec_in_container, exec_tail

FRAMES = (struct.pack(">BxxxL", 1, 6) + b"hello\n" + struct.pack(">BxxxL", 2, 5) + b"oops\n")


def _answer(conn: socket.socket) -> None:
    with conn:
        request = b""
        while b"\r\n\r\n" not in request:
            request += conn.recv(65536)
        head, _, body = request.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            body += conn.recv(65536)
        line = head.split(b"\r\n")[0].decode()
        if "/exec/ex1/start" in line:
            # Headers and every frame in one write: the client reads them in one go.
            conn.sendall(b"HTTP/1.1 101 UPGRADED\r\nContent-Type: application/vnd.docker."
                         b"multiplexed-stream\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
                         + FRAMES)
            return
        create = line.split()[1].endswith("/exec")  # POST /containers/ID/exec
        payload = {"Id": "ex1"} if create else {"ExitCode": 3, "Running": False}
        data = json.dumps(payload).encode()
        status = b"201 Created" if create else b"200 OK"
        conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


@pytest.fixture
def eager_daemon(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "docker.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn = server.accept()[0]
            except TimeoutError:
                continue
            conn.settimeout(10)
            _answer(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield path
    stop.set()
    thread.join()
    server.close()


def test_output_that_came_with_the_headers_is_kept(eager_daemon: str) -> None:
    client = docker.DockerClient(base_url=f"unix://{eager_daemon}", version="1.41", timeout=10)
    try:
        code, out, err = exec_in_container(client.api, "c1", ["echo", "hello"])
    finally:
        client.close()
    assert (code, out, err) == (3, b"hello\n", b"oops\n")


def test_docker_pys_own_exec_run_loses_it(eager_daemon: str) -> None:
    """Why exec_in_container exists: if this starts to pass, docker-py fixed it upstream."""
    client = docker.DockerClient(base_url=f"unix://{eager_daemon}", version="1.41", timeout=10)
    try:
        got = client.api.exec_start("ex1", demux=True)
    finally:
        client.close()
    assert got == (None, None)


def test_each_stream_keeps_a_bounded_tail(eager_daemon: str) -> None:
    """What a container writes is kept up to a limit, its tail, and the drop is counted: an
    engine's endless output never grows the controller's buffers."""
    client = docker.DockerClient(base_url=f"unix://{eager_daemon}", version="1.41", timeout=10)
    try:
        code, out, err = exec_tail(client.api, "c1", ["echo", "hello"], limit=3)
        with pytest.raises(ValueError, match="more than 3 bytes"):
            exec_in_container(client.api, "c1", ["echo", "hello"], limit=3)
    finally:
        client.close()
    assert code == 3
    assert (out.bytes(), out.dropped) == (b"lo\n", 3)
    assert (err.bytes(), err.dropped) == (b"ps\n", 2)
