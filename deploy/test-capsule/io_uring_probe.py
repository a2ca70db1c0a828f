"""What an engine's event loop does first on a recent kernel: ask for an io_uring instance
(libuv, under vLLM's and SGLang's API servers, does). The test engine does the same with
`--try-io-uring`, so that tests can see the capsule's answer: coldsnapd's seccomp filter makes
io_uring_setup fail with ENOSYS (the engine then keeps using epoll, and CRIU can dump it);
without that filter the engine holds an io_uring descriptor, which CRIU cannot dump.

Standard library only, x86_64 and aarch64 (the syscall has the same number on both).
"""

from __future__ import annotations

import ctypes
import errno
import os

IO_URING_SETUP = 425
# struct io_uring_params: 120 bytes on both architectures; the kernel fills it in.
_PARAMS_BYTES = 120


def try_io_uring(entries: int = 8) -> tuple[int | None, str]:
    """(the io_uring descriptor, "held") or (None, the errno's name)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    params = ctypes.create_string_buffer(_PARAMS_BYTES)
    fd = libc.syscall(ctypes.c_long(IO_URING_SETUP), ctypes.c_uint(entries), params)
    if fd < 0:
        err = ctypes.get_errno()
        return None, errno.errorcode.get(err, str(err))
    os.set_inheritable(fd, False)
    return int(fd), "held"
