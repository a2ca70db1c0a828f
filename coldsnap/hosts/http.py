"""HTTP/1.1 requests sent from a host to a service on that host's network.

The engines of a unit serve HTTP on the host's network (host networking), so the controller
reaches them the way a client on that host would: a TCP connection opened by the host
(`Host.open_tcp`, a direct-tcpip channel over SSH), with h11 doing the HTTP framing. One
request per connection (`Connection: close`), so that nothing the controller holds open is
still established when the engine is checkpointed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import h11

from coldsnap.hosts.base import Host, HostError

# An engine answer is small JSON; anything larger is a misbehaving peer.
MAX_BODY = 8 * 1024 * 1024


@dataclass(frozen=True)
class HttpAnswer:
    status: int | None  # None: no HTTP answer at all (nothing listening, connection dropped)
    body: bytes
    error: str = ""

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not."""
        return json.loads(self.body)

    def describe(self) -> str:
        if self.status is None:
            return f"no answer ({self.error})"
        return f"{self.status} {self.text[:500]}".strip()


async def http_request(
    host: Host,
    address: str,
    port: int,
    method: str,
    target: str,
    body: Any = None,
    *,
    timeout: float = 30.0,  # noqa: ASYNC109 (bounds connect, send and the whole answer)
    extra_headers: Sequence[tuple[str, str]] = (),
) -> HttpAnswer:
    """One request to http://address:port/target from `host`. Never raises for transport
    trouble: a failed connection or a timeout is an answer with `status=None`.
    `extra_headers` (an API key's Authorization) go on the wire only: the request travels
    in a direct-tcpip channel, never on a command line, and no answer repeats them."""
    data = b"" if body is None else json.dumps(body).encode()
    headers = [("Host", f"{address}:{port}"), ("Connection", "close"),
               ("Accept", "application/json"), ("Content-Length", str(len(data))),
               *extra_headers]
    if body is not None:
        headers.append(("Content-Type", "application/json"))
    try:
        async with asyncio.timeout(timeout):
            async with host.open_tcp(address, port, timeout=timeout) as (reader, writer):
                conn = h11.Connection(h11.CLIENT)
                out = conn.send(h11.Request(method=method, target=target, headers=headers))
                out += conn.send(h11.Data(data=data)) if data else b""
                out += conn.send(h11.EndOfMessage())
                writer.write(out)
                await writer.drain()
                return await _read_answer(conn, reader)
    except TimeoutError:
        return HttpAnswer(None, b"", f"no answer from {address}:{port} in {timeout:.0f}s")
    except HostError as exc:
        return HttpAnswer(None, b"", exc.message)
    except (OSError, h11.ProtocolError) as exc:
        return HttpAnswer(None, b"", f"{type(exc).__name__}: {exc}")


async def _read_answer(conn: h11.Connection, reader: Any) -> HttpAnswer:
    status: int | None = None
    chunks: list[bytes] = []
    size = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await reader.read(65536)
            conn.receive_data(data)  # b"" means EOF; h11 then reports the truncation
            continue
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.InformationalResponse):
            continue
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > MAX_BODY:
                return HttpAnswer(None, b"", f"answer larger than {MAX_BODY} bytes")
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return HttpAnswer(status, b"".join(chunks))
        elif isinstance(event, h11.ConnectionClosed):
            return HttpAnswer(None, b"", "connection closed before a full answer")
