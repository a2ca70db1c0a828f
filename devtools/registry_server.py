"""A real OCI registry for tests and the dev cluster: the `docker-registry` binary
(CNCF distribution 2.8) with a generated config, plain HTTP or, with `auth=True`, TLS and
token authentication backed by `registry_token.py` (on port + 1).

`start_registry(state_dir, address, port, *, auth=False, netns=None, data_dir=None)` returns a
`RegistryServer` once the registry answers: `url`, `ca_file` (None when plain),
`credentials_file` (a docker-style config.json with `auths["ADDRESS:PORT"]`; None when
plain), `username`, `password`, `registry` (ADDRESS:PORT), `stop()`. The processes' pids are
in `state_dir` (`registry.pid`, `token.pid`), their logs beside them. With `netns`, both run
inside `ip netns exec NETNS` (the address must be that namespace's).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import ipaddress
import json
import os
import secrets
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

REGISTRY_BINARY = "docker-registry"
TOKEN_SERVER = Path(__file__).resolve().with_name("registry_token.py")
SERVICE = "coldsnap-test-registry"
ISSUER = "coldsnap-test-token"
USERNAME = "coldsnap"
READY_TIMEOUT_S = 30.0


@dataclass
class RegistryServer:
    address: str
    port: int
    state_dir: Path
    data_dir: Path
    auth: bool
    ca_file: Path | None = None
    credentials_file: Path | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    @property
    def registry(self) -> str:
        return f"{self.address}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.auth else 'http'}://{self.registry}"

    def stop(self) -> None:
        """Stop the registry and the token server (their whole process groups)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.procs.clear()
        for name in ("registry.pid", "token.pid"):
            (self.state_dir / name).unlink(missing_ok=True)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_secret(path: Path, data: bytes) -> None:
    """Created 0600 (never readable by others, not even briefly)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_key(path: Path, key: rsa.RSAPrivateKey) -> None:
    _write_secret(path, key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))


def _cert(subject: str, key: rsa.RSAPrivateKey, issuer: x509.Name, issuer_key: rsa.RSAPrivateKey,
          *, ca: bool, address: str | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=30))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
    if address is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address(address))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _make_tls(state_dir: Path, address: str) -> None:
    """CA, the registry's server certificate (IP SAN `address`) and the token signer."""
    ca_key = _key()
    ca = _cert("coldsnap test registry CA", ca_key, _name("coldsnap test registry CA"), ca_key,
               ca=True)
    (state_dir / "ca.pem").write_bytes(_pem(ca))
    server_key = _key()
    _write_key(state_dir / "server.key", server_key)
    (state_dir / "server.pem").write_bytes(
        _pem(_cert(address, server_key, ca.subject, ca_key, ca=False, address=address)))
    signer_key = _key()
    _write_key(state_dir / "signer.key", signer_key)
    (state_dir / "signer.pem").write_bytes(
        _pem(_cert(ISSUER, signer_key, ca.subject, ca_key, ca=False)))


def _config(server: RegistryServer) -> str:
    lines = [
        "version: 0.1",
        "log:",
        "  level: info",
        "storage:",
        "  filesystem:",
        f"    rootdirectory: {server.data_dir}",
        "  delete:",
        "    enabled: true",
        "http:",
        f"  addr: {server.registry}",
        f"  secret: {secrets.token_hex(16)}",
    ]
    if server.auth:
        s = server.state_dir
        lines += [
            "  tls:",
            f"    certificate: {s / 'server.pem'}",
            f"    key: {s / 'server.key'}",
            "auth:",
            "  token:",
            f"    realm: https://{server.address}:{server.port + 1}/token",
            f"    service: {SERVICE}",
            f"    issuer: {ISSUER}",
            f"    rootcertbundle: {s / 'ca.pem'}",
        ]
    return "\n".join(lines) + "\n"


def _spawn(argv: list[str], netns: str | None, log: Path, pidfile: Path) -> \
        subprocess.Popen[bytes]:
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True)
    pidfile.write_text(f"{proc.pid}\n")
    return proc


def _answers(url: str, ca_file: Path | None) -> bool:
    ctx = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx):  # noqa: S310 (our URL)
            return True
    except urllib.error.HTTPError as exc:
        return exc.code in (401, 404)  # answering: it wants a token, or has no such path
    except OSError:
        return False


def start_registry(state_dir: Path, address: str, port: int, *, auth: bool = False,
                   netns: str | None = None, data_dir: Path | None = None) -> RegistryServer:
    state_dir.mkdir(parents=True, exist_ok=True)
    data = data_dir if data_dir is not None else state_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    server = RegistryServer(address, port, state_dir, data, auth)
    if auth:
        _make_tls(state_dir, address)
        server.ca_file = state_dir / "ca.pem"
        server.username = USERNAME
        server.password = secrets.token_urlsafe(16)
        users = state_dir / "users.json"
        _write_secret(users, json.dumps({USERNAME: hashlib.sha256(
            server.password.encode()).hexdigest()}).encode())
        creds = state_dir / "config.json"
        token = base64.b64encode(f"{USERNAME}:{server.password}".encode()).decode()
        _write_secret(creds, json.dumps({"auths": {server.registry: {"auth": token}}}).encode())
        server.credentials_file = creds
        token_config = state_dir / "token.json"
        token_config.write_text(json.dumps({
            "address": address, "port": port + 1, "tls_cert": str(state_dir / "server.pem"),
            "tls_key": str(state_dir / "server.key"),
            "signing_key": str(state_dir / "signer.key"),
            "signing_cert": str(state_dir / "signer.pem"), "issuer": ISSUER,
            "service": SERVICE, "users": str(users)}))
        server.procs.append(_spawn([sys.executable, str(TOKEN_SERVER), str(token_config)],
                                   netns, state_dir / "token.log", state_dir / "token.pid"))
    config = state_dir / "registry.yml"
    config.write_text(_config(server))
    server.procs.append(_spawn([REGISTRY_BINARY, "serve", str(config)], netns,
                               state_dir / "registry.log", state_dir / "registry.pid"))
    deadline = time.monotonic() + READY_TIMEOUT_S
    checks = [f"{server.url}/v2/"]
    if auth:
        checks.append(f"https://{address}:{port + 1}/")
    try:
        for url in checks:
            while not _answers(url, server.ca_file):
                dead = [p for p in server.procs if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    why = "exited" if dead else f"did not answer in {READY_TIMEOUT_S:.0f} s"
                    raise RuntimeError(f"test registry at {url} {why}; see {state_dir}/*.log")
                time.sleep(0.1)
    except BaseException:
        server.stop()
        raise
    return server


__all__ = ["RegistryServer", "start_registry"]
