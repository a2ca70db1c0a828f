"""A token server for a test registry (distribution's `auth: token`), stdlib HTTP over TLS.

`GET /token?service=S&scope=repository:R:pull,push` with basic credentials that the users
file (JSON `{USER: sha256-hex of PASSWORD}`) knows answers `{"token": JWT, ...}`: an RS256
JWT with an `x5c` header (the signing certificate, which the registry verifies against its
`rootcertbundle`), granting exactly the requested scopes. Anything else is 401. Test use only.

Run: `python registry_token.py CONFIG.json` (address, port, tls_cert, tls_key, signing_key,
signing_cert, issuer, service, users).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import ssl
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

TOKEN_LIFETIME_S = 300


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def make_jwt(claims: dict[str, Any], key: rsa.RSAPrivateKey, cert: x509.Certificate) -> str:
    header = {"typ": "JWT", "alg": "RS256",
              "x5c": [base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()]}
    signing_input = (_b64(json.dumps(header, separators=(",", ":")).encode()) + "."
                     + _b64(json.dumps(claims, separators=(",", ":")).encode()))
    signature = key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
    return signing_input + "." + _b64(signature)


def _access(scopes: list[str]) -> list[dict[str, Any]]:
    granted = []
    for scope in scopes:
        for one in scope.split(" "):
            kind, _, rest = one.partition(":")
            name, _, actions = rest.rpartition(":")
            if kind == "repository" and name and actions:
                granted.append({"type": kind, "name": name, "actions": actions.split(",")})
    return granted


def serve(config: dict[str, Any]) -> None:
    loaded = serialization.load_pem_private_key(
        Path(config["signing_key"]).read_bytes(), password=None)
    if not isinstance(loaded, rsa.RSAPrivateKey):
        raise SystemExit("signing_key: not an RSA key")
    key: rsa.RSAPrivateKey = loaded  # named so the handler below sees the narrowed type
    cert = x509.load_pem_x509_certificate(Path(config["signing_cert"]).read_bytes())
    users: dict[str, str] = json.loads(Path(config["users"]).read_text())

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            # The request line only: the query holds no secret, the headers are not logged.
            sys.stderr.write(f"token: {self.address_string()} {format % args}\n")

        def _deny(self) -> None:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="coldsnap-test-token"')
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path != "/token":
                self.send_error(404)
                return
            auth = self.headers.get("Authorization", "")
            scheme, _, encoded = auth.partition(" ")
            try:
                user, _, password = base64.b64decode(encoded).decode().partition(":")
            except ValueError:
                user, password = "", ""
            want = users.get(user)
            got = hashlib.sha256(password.encode()).hexdigest()
            if scheme.lower() != "basic" or want is None or not hmac.compare_digest(want, got):
                self._deny()
                return
            query = parse_qs(url.query)
            now = int(time.time())
            claims = {"iss": config["issuer"], "sub": user,
                      "aud": query.get("service", [config["service"]])[0],
                      "exp": now + TOKEN_LIFETIME_S, "nbf": now - 10, "iat": now,
                      "jti": secrets.token_hex(16), "access": _access(query.get("scope", []))}
            token = make_jwt(claims, key, cert)
            body = json.dumps({"token": token, "access_token": token,
                               "expires_in": TOKEN_LIFETIME_S}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer((config["address"], int(config["port"])), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(config["tls_cert"], config["tls_key"])
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    server.serve_forever()


if __name__ == "__main__":
    serve(json.loads(Path(sys.argv[1]).read_text()))
