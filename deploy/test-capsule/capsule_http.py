#!/usr/bin/env python3
"""In-capsule HTTP client used by coldsnapd through `docker exec`.

    capsule-http ENDPOINT GET|POST PATH [JSON-BODY] [TIMEOUT-SECONDS]

ENDPOINT is `unix:@abstract-name`, `unix:/path/to.sock` or `http://127.0.0.1:PORT`.
Capsule containers run with --network none, so the engine's socket exists only in the
container's namespaces; the controller reaches it by exec'ing this client there.
Prints one JSON line {"status": int, "body": str} and exits 0 whenever an HTTP answer came back
(whatever its status), 2 when none did. Python 3 standard library only.
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import urllib.parse


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, address: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        # "@name" is Linux's abstract namespace: no file in the rootfs to go stale in a capsule.
        self.address = "\0" + address[1:] if address.startswith("@") else address

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.address)
        self.sock = s


def connection(endpoint: str, timeout: float) -> http.client.HTTPConnection:
    if endpoint.startswith("unix:"):
        return UnixConnection(endpoint[len("unix:"):], timeout)
    u = urllib.parse.urlsplit(endpoint)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"unsupported endpoint {endpoint!r}")
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4, 5) or argv[1] not in ("GET", "POST"):
        print("usage: capsule-http ENDPOINT GET|POST PATH [JSON-BODY] [TIMEOUT-SECONDS]",
              file=sys.stderr)
        return 64
    endpoint, method, path = argv[0], argv[1], argv[2]
    body = argv[3].encode() if len(argv) > 3 and argv[3] else None
    timeout = float(argv[4]) if len(argv) > 4 else 30.0
    try:
        conn = connection(endpoint, timeout)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        status, data = resp.status, resp.read()
        conn.close()
    except (OSError, ValueError, http.client.HTTPException) as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 2
    print(json.dumps({"status": status, "body": data.decode(errors="replace")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
