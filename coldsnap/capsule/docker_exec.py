"""Run a command in a container and read all of its output, through any socket relay.

docker-py's `exec_run` reads the exec's multiplexed stream from the raw socket under the
HTTP response. The bytes that http.client had already buffered while reading the `101
UPGRADED` headers are skipped that way, and through the SSH-forwarded Docker socket the
headers and a quick command's whole output often arrive in one read: the command then
"succeeds" with empty output (measured: 9 of 1,500 `echo`s under load). Here the frames are
read from the response's own buffered reader, which yields what it buffered first.

What the command writes comes from a container an engine controls: each stream keeps a
bounded tail (`TailBuffer`), and a frame is read in pieces whatever length its header says."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from coldsnap.hosts.base import DEFAULT_OUTPUT_LIMIT, TailBuffer

_HEADER = struct.Struct(">BxxxL")  # stream (1 stdout, 2 stderr), then the frame's length
_STDERR = 2
_PIECE = 1 << 16


def exec_tail(api: Any, container_id: str, argv: Sequence[str], *,
              limit: int = DEFAULT_OUTPUT_LIMIT, environment: Mapping[str, str] | None = None,
              workdir: str | None = None) -> tuple[int | None, TailBuffer, TailBuffer]:
    """Exit status (None while Docker does not know it), and the last `limit` bytes of the
    stdout and stderr of `argv`, run with `environment` over the container's own, in
    `workdir` (None: the container's)."""
    exec_id = api.exec_create(container_id, list(argv), stdout=True, stderr=True,
                              environment=dict(environment or {}), workdir=workdir)["Id"]
    sock = api.exec_start(exec_id, socket=True)
    response = sock._response  # docker-py keeps the HTTP response on the socket it returns
    reader = response.raw._fp.fp  # http.client's buffered reader over that socket
    out, err = TailBuffer(limit), TailBuffer(limit)
    try:
        while len(header := reader.read(_HEADER.size)) == _HEADER.size:
            stream, length = _HEADER.unpack(header)
            into = err if stream == _STDERR else out
            while length:
                data = reader.read(min(length, _PIECE))
                if not data:
                    break
                into.add(data)
                length -= len(data)
            if length:
                break
    finally:
        response.close()
        sock.close()
    code = api.exec_inspect(exec_id).get("ExitCode")
    return (code if isinstance(code, int) else None), out, err


def exec_in_container(api: Any, container_id: str, argv: Sequence[str], *,
                      limit: int = DEFAULT_OUTPUT_LIMIT) -> tuple[int | None, bytes, bytes]:
    """`exec_tail` for a caller that needs the whole output: more than `limit` bytes on
    either stream is an error, not a tail read as if it were everything."""
    code, out, err = exec_tail(api, container_id, argv, limit=limit)
    if out.dropped or err.dropped:
        raise ValueError(f"{argv[0]} wrote more than {limit} bytes")
    return code, out.bytes(), err.bytes()
