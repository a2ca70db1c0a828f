"""Run a command in a container and read all of its output, through any socket relay.

docker-py's `exec_run` reads the exec's multiplexed stream from the raw socket under the
HTTP response. The bytes that http.client had already buffered while reading the `101
UPGRADED` headers are skipped that way, and through the SSH-forwarded Docker socket the
headers and a quick command's whole output often arrive in one read: the command then
"succeeds" with empty output (measured: 9 of 1,500 `echo`s under load). Here the frames are
read from the response's own buffered reader, which yields what it buffered first."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

_HEADER = struct.Struct(">BxxxL")  # stream (1 stdout, 2 stderr), then the frame's length
_STDERR = 2


def exec_in_container(api: Any, container_id: str, argv: Sequence[str],
                      environment: Mapping[str, str] | None = None,
                      ) -> tuple[int | None, bytes, bytes]:
    """Exit status (None while Docker does not know it), stdout and stderr of `argv`, run
    with `environment` over the container's own."""
    exec_id = api.exec_create(container_id, list(argv), stdout=True, stderr=True,
                              environment=dict(environment or {}))["Id"]
    sock = api.exec_start(exec_id, socket=True)
    response = sock._response  # docker-py keeps the HTTP response on the socket it returns
    reader = response.raw._fp.fp  # http.client's buffered reader over that socket
    out, err = bytearray(), bytearray()
    try:
        while len(header := reader.read(_HEADER.size)) == _HEADER.size:
            stream, length = _HEADER.unpack(header)
            data = reader.read(length)
            (err if stream == _STDERR else out).extend(data)
            if len(data) < length:
                break
    finally:
        response.close()
        sock.close()
    code = api.exec_inspect(exec_id).get("ExitCode")
    return (code if isinstance(code, int) else None), bytes(out), bytes(err)
