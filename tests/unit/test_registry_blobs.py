"""The helper's registry modes (`blob-pull`, `blob-push`), run as a host runs them, against a
real docker-registry (CNCF distribution) started here on 127.0.0.1 over plain HTTP: a pull,
a pull that resumes a partial file, a blob whose bytes lie, an unknown blob, a registry that is
gone (the partial file stays), and a push of a blob the repository holds already."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.server
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from coldsnap.hosts.helper import helper_argv
from coldsnap.hosts.helper.common import (
    EXIT_MISMATCH,
    EXIT_REFUSED,
    EXIT_UNAUTHORIZED,
    EXIT_UNKNOWN,
    EXIT_UNREACHABLE,
)
from coldsnap.hosts.helper.registry import PULL_PART_SUFFIX
from coldsnap.hosts.helper.stamps import STAMP_ATTR
from coldsnap.hosts.local import LocalHost
from coldsnap.hosts.registry.access import RegistryAccess
from coldsnap.hosts.registry.blobs import RegistryTransferError, pull_blob, push_blob
from coldsnap.hosts.transfer.protocol import PART_SUFFIX
from tests.unit.conftest import PlainRegistry

REPO = "coldsnap/test"


def stdin_for(address: str) -> bytes:
    return json.dumps({"access": RegistryAccess(address, insecure=True).to_helper(),
                       "repository": REPO, "timeout": 20}).encode()


def helper(mode: str, address: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(helper_argv(mode, *args), input=stdin_for(address),
                          capture_output=True, timeout=60, check=False)


def blob(tmp_path: Path, data: bytes) -> tuple[Path, str]:
    path = tmp_path / ("src-" + hashlib.sha256(data).hexdigest()[:12])
    path.write_bytes(data)
    return path, "sha256:" + hashlib.sha256(data).hexdigest()


def answer(res: subprocess.CompletedProcess[bytes]) -> Any:
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_pull_uses_the_partial_file_name_every_transfer_uses() -> None:
    # So that gc sweeps an old one, and a pull resumes what a put left.
    assert PULL_PART_SUFFIX == PART_SUFFIX


DATA = os.urandom(3 * 1024 * 1024 + 17)  # a few MiB: more than one piece of the helper's CH


def test_a_pushed_blob_is_pulled_verified_stamped_and_private(registry: PlainRegistry,
                                                               tmp_path: Path) -> None:
    src, digest = blob(tmp_path, DATA)
    pushed = answer(helper("blob-push", registry.address, str(src), digest, str(len(DATA))))
    assert pushed == {"present": False, "sent": len(DATA), "size": len(DATA)}
    final = tmp_path / "host" / "objects" / "sha256" / digest[7:]
    pulled = answer(helper("blob-pull", registry.address, str(final), digest, str(len(DATA))))
    assert pulled == {"received": len(DATA), "resumed_from": 0, "size": len(DATA)}
    assert final.read_bytes() == DATA
    assert not Path(str(final) + PART_SUFFIX).exists()
    assert final.parent.stat().st_mode & 0o777 == 0o700
    assert final.stat().st_mode & 0o777 == 0o600
    st = final.stat()
    assert os.getxattr(final, STAMP_ATTR) == \
        f"{digest[7:]} {st.st_size} {st.st_mtime_ns}".encode()


def test_a_second_push_of_a_held_blob_sends_nothing(registry: PlainRegistry,
                                                     tmp_path: Path) -> None:
    src, digest = blob(tmp_path, DATA[:4096])
    assert answer(helper("blob-push", registry.address, str(src), digest, "4096"))["sent"] == 4096
    again = answer(helper("blob-push", registry.address, str(src), digest, "4096"))
    assert again == {"present": True, "sent": 0, "size": 4096}


def test_a_partial_file_is_resumed_from_where_it_ends(registry: PlainRegistry,
                                                      tmp_path: Path) -> None:
    src, digest = blob(tmp_path, DATA)
    answer(helper("blob-push", registry.address, str(src), digest, str(len(DATA))))
    final = tmp_path / "obj"
    kept = 1024 * 1024 + 5
    Path(str(final) + PART_SUFFIX).write_bytes(DATA[:kept])
    pulled = answer(helper("blob-pull", registry.address, str(final), digest, str(len(DATA))))
    # Only the rest crossed: the registry answered the range.
    assert pulled == {"received": len(DATA) - kept, "resumed_from": kept, "size": len(DATA)}
    assert final.read_bytes() == DATA


def test_a_partial_file_with_wrong_bytes_is_a_mismatch_and_is_removed(
        registry: PlainRegistry, tmp_path: Path) -> None:
    src, digest = blob(tmp_path, DATA)
    answer(helper("blob-push", registry.address, str(src), digest, str(len(DATA))))
    final = tmp_path / "obj"
    part = Path(str(final) + PART_SUFFIX)
    part.write_bytes(b"x" * 1000)
    res = helper("blob-pull", registry.address, str(final), digest, str(len(DATA)))
    assert res.returncode == EXIT_MISMATCH
    assert f"registry {registry.address}, {REPO}@{digest}" in res.stderr.decode()
    assert not part.exists() and not final.exists()
    # The retry starts over and succeeds.
    assert answer(helper("blob-pull", registry.address, str(final), digest,
                         str(len(DATA))))["resumed_from"] == 0


def test_a_size_that_lies_is_a_mismatch(registry: PlainRegistry, tmp_path: Path) -> None:
    src, digest = blob(tmp_path, DATA[:5000])
    answer(helper("blob-push", registry.address, str(src), digest, "5000"))
    final = tmp_path / "obj"
    res = helper("blob-pull", registry.address, str(final), digest, "4000")
    assert res.returncode == EXIT_MISMATCH, res.stderr
    assert not final.exists() and not Path(str(final) + PART_SUFFIX).exists()


def test_an_unknown_blob_is_named(registry: PlainRegistry, tmp_path: Path) -> None:
    digest = "sha256:" + hashlib.sha256(b"never pushed").hexdigest()
    res = helper("blob-pull", registry.address, str(tmp_path / "obj"), digest, "12")
    assert res.returncode == EXIT_UNKNOWN
    line = res.stderr.decode()
    assert line.count("\n") == 1 and "blob unknown (404)" in line
    assert f"registry {registry.address}, {REPO}@{digest}" in line
    assert not (tmp_path / "obj").exists()
    assert not (tmp_path / ("obj" + PART_SUFFIX)).exists()  # no empty partial file either


def test_a_registry_that_is_gone_keeps_the_partial_file(registry: PlainRegistry,
                                                        tmp_path: Path) -> None:
    src, digest = blob(tmp_path, DATA)
    answer(helper("blob-push", registry.address, str(src), digest, str(len(DATA))))
    final = tmp_path / "obj"
    part = Path(str(final) + PART_SUFFIX)
    part.write_bytes(DATA[:777])
    registry.stop()
    res = helper("blob-pull", registry.address, str(final), digest, str(len(DATA)))
    assert res.returncode == EXIT_UNREACHABLE
    assert f"registry {registry.address}, {REPO}@{digest}: unreachable" in res.stderr.decode()
    assert part.read_bytes() == DATA[:777] and not final.exists()
    push = helper("blob-push", registry.address, str(src), digest, str(len(DATA)))
    assert push.returncode == EXIT_UNREACHABLE


def test_secrets_stay_off_argv_and_out_of_errors(registry: PlainRegistry, tmp_path: Path) -> None:
    req = json.loads(stdin_for(registry.address))
    req["access"].update(username="alice", password="s3cret-pw")
    digest = "sha256:" + "0" * 64
    res = subprocess.run(helper_argv("blob-pull", str(tmp_path / "o"), digest, "1"),
                         input=json.dumps(req).encode(), capture_output=True, timeout=60,
                         check=False)
    assert res.returncode == EXIT_UNKNOWN  # anonymous first: the registry asked for nothing
    assert b"s3cret" not in res.stderr + res.stdout


def test_the_near_side_pulls_and_pushes_through_a_host_and_names_failures(
        registry: PlainRegistry, tmp_path: Path) -> None:
    host = LocalHost("host-a")
    access = RegistryAccess(registry.address, insecure=True, username="u", password="pw-xyz")
    src, digest = blob(tmp_path, DATA[:9000])
    pushed = asyncio.run(push_blob(host, access, REPO, str(src), digest, 9000, timeout=60))
    assert (pushed.sent, pushed.present) == (9000, False)
    final = tmp_path / "pulled"
    pulled = asyncio.run(pull_blob(host, access, REPO, digest, 9000, str(final), timeout=60))
    assert (pulled.received, pulled.resumed_from) == (9000, 0)
    assert final.read_bytes() == DATA[:9000]
    missing = "sha256:" + "1" * 64
    with pytest.raises(RegistryTransferError) as err:
        asyncio.run(pull_blob(host, access, REPO, missing, 5, str(tmp_path / "m"), timeout=60))
    assert err.value.reason == "blob unknown"
    text = str(err.value)
    assert text.startswith(f"host-a: blob unknown: {registry.address}/{REPO}@{missing}")
    assert "pw-xyz" not in text


class _AuthRegistry(http.server.BaseHTTPRequestHandler):
    """A registry front that asks for a bearer token (realm /token, which wants basic
    credentials alice:right) and serves one blob to it: the auth dance the spec describes."""

    blob = b"guarded bytes"

    def log_message(self, *_args: Any) -> None:
        pass

    def do_GET(self) -> None:
        auth = self.headers.get("Authorization", "")
        if self.path.startswith("/token?"):
            ok = auth == "Basic " + base64.b64encode(b"alice:right").decode()
            assert "scope=repository%3Acoldsnap%2Ftest%3Apull" in self.path
            self._answer(200 if ok else 401, json.dumps({"token": "tok"}).encode() if ok
                         else b"{}")
        elif auth != "Bearer tok":
            port = self.server.server_address[1]
            self._answer(401, b"{}", {"WWW-Authenticate":
                         f'Bearer realm="http://127.0.0.1:{port}/token",service="reg",'
                         f'scope="repository:{REPO}:pull"'})
        else:
            self._answer(200, self.blob)

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize("password", ["right", "wrong"])
def test_a_bearer_token_is_asked_with_the_basic_credentials(tmp_path: Path,
                                                            password: str) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AuthRegistry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        access = RegistryAccess(address, insecure=True, username="alice", password=password)
        data = _AuthRegistry.blob
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        final = tmp_path / "obj"
        res = subprocess.run(
            helper_argv("blob-pull", str(final), digest, str(len(data))), capture_output=True,
            input=json.dumps({"access": access.to_helper(), "repository": REPO}).encode(),
            timeout=60, check=False)
        if password == "right":
            assert res.returncode == 0, res.stderr
            assert final.read_bytes() == data
        else:
            assert res.returncode == EXIT_UNAUTHORIZED
            assert f"registry {address}, {REPO}@{digest}: unauthorized" in res.stderr.decode()
            assert b"wrong" not in res.stderr and not final.exists()
    finally:
        server.shutdown()


def test_a_push_beneath_a_root_follows_no_symlink(registry: PlainRegistry, tmp_path: Path) -> None:
    root = tmp_path / "mount"
    root.mkdir()
    src, digest = blob(tmp_path, DATA[:2048])
    (root / "weights.bin").symlink_to(src)  # the engine could point its payload anywhere
    res = helper("blob-push", registry.address, str(root / "weights.bin"), digest, "2048",
                 str(root))
    assert res.returncode == EXIT_REFUSED, res.stderr
    (root / "real.bin").write_bytes(DATA[:2048])
    pushed = answer(helper("blob-push", registry.address, str(root / "real.bin"), digest,
                           "2048", str(root)))
    assert pushed["sent"] == 2048


class _CutShort(http.server.BaseHTTPRequestHandler):
    """Declares the whole blob, sends its first half, then closes: a registry stopped
    mid-body."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(DATA)))
        self.end_headers()
        self.wfile.write(DATA[:len(DATA) // 2])
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


def test_a_body_cut_short_is_an_interruption_and_keeps_the_partial_file(
        tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutShort)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        digest = "sha256:" + hashlib.sha256(DATA).hexdigest()
        final = tmp_path / "obj"
        res = helper("blob-pull", address, str(final), digest, str(len(DATA)))
    finally:
        server.shutdown()
        server.server_close()
    assert res.returncode == EXIT_UNREACHABLE, res.stderr
    assert "interrupted: the body ended" in res.stderr.decode()
    assert Path(str(final) + PART_SUFFIX).read_bytes() == DATA[:len(DATA) // 2]
    assert not final.exists()


class _Elsewhere(http.server.BaseHTTPRequestHandler):
    """Another origin an upload `Location` names: records the Authorization it was sent and
    takes the blob."""

    seen: list[str | None] = []

    def log_message(self, *_args: Any) -> None:
        pass

    def do_PUT(self) -> None:
        type(self).seen.append(self.headers.get("Authorization"))
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()


class _Redirecting(http.server.BaseHTTPRequestHandler):
    """A registry that wants basic credentials alice:pw, and answers an upload's POST with
    a `Location` of its class's choosing (another port, another scheme, or its own)."""

    location = ""
    seen: list[str | None] = []

    def log_message(self, *_args: Any) -> None:
        pass

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == \
                "Basic " + base64.b64encode(b"alice:pw-s3cret").decode():
            return True
        self._answer(401, {"WWW-Authenticate": 'Basic realm="reg"'})
        return False

    def do_HEAD(self) -> None:
        if self._authorized():
            self._answer(404)

    def do_POST(self) -> None:
        if self._authorized():
            port = self.server.server_address[1]
            self._answer(202, {"Location": type(self).location.format(port=port)})

    def do_PUT(self) -> None:
        type(self).seen.append(self.headers.get("Authorization"))
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer(201)

    def _answer(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.mark.parametrize(("location", "own"), [
    ("http://127.0.0.1:{other}/upload/1", False),  # another port
    ("http://localhost:{port}/upload/1", False),  # another host name
    ("https://127.0.0.1:{port}/upload/1", False),  # another scheme
    ("/v2/coldsnap/test/blobs/uploads/1", True),  # relative: the registry itself
    ("http://127.0.0.1:{port}/v2/coldsnap/test/blobs/uploads/1", True),
])
def test_a_push_sends_the_credentials_only_to_the_registrys_origin(
        tmp_path: Path, location: str, own: bool) -> None:
    # An upload Location is the registry's answer: one naming another origin must not
    # carry the registry's credentials there.
    registry = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Redirecting)
    elsewhere = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Elsewhere)
    for server in (registry, elsewhere):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    _Redirecting.location = location.replace("{other}", str(elsewhere.server_address[1]))
    _Redirecting.seen, _Elsewhere.seen = [], []
    try:
        address = f"127.0.0.1:{registry.server_address[1]}"
        access = RegistryAccess(address, insecure=True, username="alice", password="pw-s3cret")
        src, digest = blob(tmp_path, DATA[:4096])
        res = subprocess.run(
            helper_argv("blob-push", str(src), digest, "4096"), capture_output=True,
            input=json.dumps({"access": access.to_helper(), "repository": REPO,
                              "timeout": 10}).encode(), timeout=60, check=False)
    finally:
        for server in (registry, elsewhere):
            server.shutdown()
            server.server_close()
    sent = _Redirecting.seen + _Elsewhere.seen
    if own:
        assert res.returncode == 0, res.stderr
        assert _Redirecting.seen == ["Basic " + base64.b64encode(b"alice:pw-s3cret").decode()]
    elif location.startswith("https"):
        # Nothing listens for TLS there: the push fails, and no PUT carried the credentials.
        assert res.returncode != 0 and all(a is None for a in sent)
    else:
        assert res.returncode == 0, res.stderr
        assert sent == [None]  # the other origin took the bytes, never the credentials
    assert b"s3cret" not in res.stderr + res.stdout
