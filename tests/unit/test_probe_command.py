"""The host probe's one light command, run on this machine through LocalHost: sh, stat and a
Docker socket asked with curl; python only for a real host's NVML part."""

from __future__ import annotations

import http.server
import json
import os
import platform
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap.hosts.inventory import HostEntry
from coldsnap.hosts.local import LocalHost
from coldsnap.hosts.probe import ProbeGarbage, parse_probe_output, probe_host


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def _docker_socket(path: Path, status: int, body: bytes) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def address_string(self) -> str:
            return "docker"

        def do_GET(self) -> None:
            self.send_response(status if self.path == "/version" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = _UnixHTTPServer(str(path), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield str(path)
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def docker_socket(tmp_path: Path) -> Iterator[str]:
    yield from _docker_socket(tmp_path / "docker.sock", 200,
                              json.dumps({"Version": "26.1.5", "ApiVersion": "1.45"}).encode())


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _entry(data_dir: Path, socket: str | None, *, simulated: bool = True) -> HostEntry:
    return HostEntry(name="h", address="127.0.0.1", data_dir=str(data_dir),
                     docker_socket=socket, simulated=simulated,
                     driver_version="610.43.02" if simulated else None)


async def test_a_simulated_host_gets_its_facts_from_sh_stat_and_curl(tmp_path: Path,
                                                         docker_socket: str) -> None:
    f = await probe_host(LocalHost(), _entry(tmp_path, docker_socket))
    assert f.reachable and f.error is None, f
    assert (f.arch, f.kernel) == (platform.machine(), platform.release())
    assert f.docker == "26.1.5"
    st = os.statvfs(tmp_path)
    assert f.data_dir_free_bytes is not None
    assert abs(f.data_dir_free_bytes - st.f_bavail * st.f_frsize) < 256 << 20
    assert f.notes == [] and f.nvidia_driver == "610.43.02"
    # Which boot and which dockerd the facts came from: what a remembered CRIU probe needs.
    assert f.boot_id == _boot_id()
    st_sock = os.stat(docker_socket)
    assert f.docker_instance == f"{st_sock.st_ino} {int(st_sock.st_ctime)}"
    facts = f.admission_facts()
    assert (facts.boot_id, facts.docker, facts.docker_instance) == (
        f.boot_id, "26.1.5", f.docker_instance)


async def test_a_missing_data_dir_and_a_dead_docker_socket_are_notes(tmp_path: Path) -> None:
    entry = _entry(tmp_path / "not" / "yet", str(tmp_path / "no.sock"))
    f = await probe_host(LocalHost(), entry)
    assert f.reachable and f.error is None
    assert f.docker is None and f.docker_instance is None
    assert f"data_dir does not exist yet; free space is that of {tmp_path}" in f.notes
    assert any(n.startswith(f"docker: cannot query {tmp_path / 'no.sock'}") for n in f.notes)


async def test_docker_answering_an_error_is_a_note(tmp_path: Path) -> None:
    for sock in _docker_socket(tmp_path / "d.sock", 500, b'{"message": "boom"}'):
        f = await probe_host(LocalHost(), _entry(tmp_path, sock))
        assert f.docker is None and "docker: HTTP 500" in f.notes


async def test_a_real_host_asks_nvml_and_says_there_is_no_driver(tmp_path: Path) -> None:
    # This machine has no NVIDIA driver: NVML (sent along on stdin) must say so, cleanly.
    f = await probe_host(LocalHost(), _entry(tmp_path, None, simulated=False))
    assert f.reachable and f.error is None, f
    assert not f.simulated and f.gpus == [] and f.nvidia_driver is None
    assert any(n.startswith("no NVIDIA driver") for n in f.notes), f.notes


def test_an_answer_without_the_basic_facts_is_garbage() -> None:
    with pytest.raises(ProbeGarbage):
        parse_probe_output("hello\n", "/d", None)
    facts = parse_probe_output("@@arch aarch64\n@@kernel 6.8.0\n@@free-path /d\n@@free 10 4096\n"
                               "@@nvml\n{\"nvidia_driver\": \"610.1\", \"gpus\": [], "
                               "\"notes\": []}\n", "/d", None)
    assert facts["data_dir_free_bytes"] == 40960 and facts["nvidia_driver"] == "610.1"
