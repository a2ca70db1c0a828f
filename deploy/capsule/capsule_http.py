#!/usr/bin/python3 -I
"""In-capsule HTTP client used by coldsnapd through `docker exec`.

    capsule-http [--wait-ok PATH] ENDPOINT GET|POST PATH [JSON-BODY] [TIMEOUT-SECONDS]

--wait-ok PATH first polls GET PATH until it answers 200 (within the timeout): one exec for
"healthy, then ask", instead of one exec per poll from the controller.

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
import time
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


def request(endpoint: str, method: str, path: str, body: bytes | None,
            timeout: float) -> tuple[int, bytes]:
    conn = connection(endpoint, timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def main(argv: list[str]) -> int:
    wait_ok = None
    if len(argv) >= 2 and argv[0] == "--wait-ok":
        wait_ok, argv = argv[1], argv[2:]
    if len(argv) not in (3, 4, 5) or argv[1] not in ("GET", "POST"):
        print("usage: capsule-http [--wait-ok PATH] ENDPOINT GET|POST PATH [JSON-BODY] "
              "[TIMEOUT-SECONDS]", file=sys.stderr)
        return 64
    endpoint, method, path = argv[0], argv[1], argv[2]
    body = argv[3].encode() if len(argv) > 3 and argv[3] else None
    timeout = float(argv[4]) if len(argv) > 4 else 30.0
    deadline = time.monotonic() + timeout
    try:
        if wait_ok is not None:
            while True:
                try:
                    if request(endpoint, "GET", wait_ok, None, timeout)[0] == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    print(json.dumps({"error": f"{wait_ok} did not answer 200 in {timeout}s"}))
                    return 2
                time.sleep(0.02)
        status, data = request(endpoint, method, path, body, timeout)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 2
    print(json.dumps({"status": status, "body": data.decode(errors="replace")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
