"""The engine's seccomp filter: generated here, installed by the capsule's launcher.

Why not Docker's own `seccomp` option: Docker puts its filter on every process of the
container, CRIU included, and the kernel lets a tracer suspend a task's seccomp filter
(PTRACE_O_SUSPEND_SECCOMP, which CRIU needs to dump and restore a filtered task) only when the
tracer itself runs unfiltered. So the container runs without a Docker-level filter, and the
engine tree alone gets this one, installed by `capsule-init launch` after no-new-privs and
kept across a snapshot by CRIU (it dumps and restores a task's filters).

What it refuses follows Docker's default profile for a container without capabilities: the
syscalls that profile allows only with a capability the engine does not hold, and those it
never allows (kernel modules, kexec, keyrings, bpf, perf, userfaultfd, other namespaces,
mounts, tracing other processes, the clock, NUMA policy). `clone` with a namespace flag is
refused; `clone3`, whose flags a filter cannot read, answers ENOSYS so that the C library
falls back to `clone`, and so does io_uring, which CRIU cannot dump: its users fall back to
epoll. Refusals return EPERM; an unknown architecture or the x32 ABI
is refused altogether. Everything else is allowed.
"""

from __future__ import annotations

import base64
import errno
import struct
from collections.abc import Mapping

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
_X32_SYSCALL_BIT = 0x40000000

# Syscall numbers of what is refused, per architecture (x86_64: asm/unistd_64.h; aarch64:
# asm-generic/unistd.h). A syscall that an architecture lacks is simply absent there.
DENIED: Mapping[str, tuple[int | None, int | None]] = {
    # name: (x86_64, aarch64)
    "acct": (163, 89), "add_key": (248, 217), "bpf": (321, 280),
    "clock_adjtime": (305, 266), "clock_settime": (227, 112), "create_module": (174, None),
    "delete_module": (176, 106), "finit_module": (313, 273), "get_kernel_syms": (177, None),
    "get_mempolicy": (239, 236), "init_module": (175, 105), "ioperm": (173, None),
    "iopl": (172, None), "kcmp": (312, 272), "kexec_file_load": (320, 294),
    "kexec_load": (246, 104), "keyctl": (250, 219), "lookup_dcookie": (212, 18),
    "mbind": (237, 235), "mount": (165, 40), "move_pages": (279, 239),
    "name_to_handle_at": (303, 264), "nfsservctl": (180, 42), "open_by_handle_at": (304, 265),
    "perf_event_open": (298, 241), "pivot_root": (155, 41), "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271), "ptrace": (101, 117), "query_module": (178, None),
    "quotactl": (179, 60), "quotactl_fd": (443, 443), "reboot": (169, 142),
    "request_key": (249, 218), "set_mempolicy": (238, 237),
    "set_mempolicy_home_node": (450, 450), "setns": (308, 268), "settimeofday": (164, 170),
    "swapon": (167, 224), "swapoff": (168, 225), "sysfs": (139, None), "_sysctl": (156, None),
    "umount2": (166, 39), "unshare": (272, 97), "uselib": (134, None),
    "userfaultfd": (323, 282), "ustat": (136, None),
    # The mount API of Linux 5.2 and later, refused like mount(2).
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442),
}
# Answered ENOSYS, as a kernel built without them would: io_uring, which CRIU cannot dump
# ("Unknown shit 600 (anon_inode:[io_uring])"). Libraries that try it first (libuv, under
# vLLM's and SGLang's API servers) take ENOSYS as "not here" and fall back to epoll; a
# refusal (EPERM) is not what they expect to see.
UNSUPPORTED: Mapping[str, tuple[int | None, int | None]] = {
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
}
CLONE = (56, 220)
CLONE3 = (435, 435)
# CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
# | CLONE_NEWNET: clone's first argument on both architectures.
CLONE_NAMESPACE_FLAGS = 0x7E020000

_LD_ABS_W = 0x20
_JEQ = 0x15
_JGE = 0x35
_JSET = 0x45
_RET = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_OFFSET_NR = 0
_OFFSET_ARCH = 4
_OFFSET_ARG0_LOW = 16  # args[0], low 32 bits (both architectures are little-endian)


class _Program:
    """Classic BPF with labels: jumps name their targets, resolved once all is emitted."""

    def __init__(self) -> None:
        self.code: list[tuple[int, str | int, str | int, int]] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def emit(self, op: int, k: int, jt: str | int = 0, jf: str | int = 0) -> None:
        self.code.append((op, jt, jf, k))

    def assemble(self) -> bytes:
        out = bytearray()
        for i, (op, jt, jf, k) in enumerate(self.code):
            offsets = [self.labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf)]
            if any(not 0 <= o <= 255 for o in offsets):
                raise ValueError(f"seccomp jump out of range at {i}: {offsets}")
            out += struct.pack("<HBBI", op, offsets[0], offsets[1], k)
        return bytes(out)


def _arch_block(p: _Program, arch: str, index: int) -> None:
    deny, enosys, clone = f"{arch}-deny", f"{arch}-enosys", f"{arch}-clone"
    p.label(arch)
    p.emit(_LD_ABS_W, _OFFSET_NR)
    if arch == "x86_64":
        p.emit(_JGE, _X32_SYSCALL_BIT, deny, 0)
    for numbers in DENIED.values():
        nr = numbers[index]
        if nr is not None:
            p.emit(_JEQ, nr, deny, 0)
    for numbers in UNSUPPORTED.values():
        nr = numbers[index]
        if nr is not None:
            p.emit(_JEQ, nr, enosys, 0)
    p.emit(_JEQ, CLONE[index], clone, 0)
    p.emit(_JEQ, CLONE3[index], enosys, 0)
    p.emit(_RET, _RET_ALLOW)
    p.label(clone)
    p.emit(_LD_ABS_W, _OFFSET_ARG0_LOW)
    p.emit(_JSET, CLONE_NAMESPACE_FLAGS, deny, 0)
    p.emit(_RET, _RET_ALLOW)
    p.label(deny)
    p.emit(_RET, _RET_ERRNO | errno.EPERM)
    p.label(enosys)
    p.emit(_RET, _RET_ERRNO | errno.ENOSYS)


def engine_filter() -> bytes:
    """The filter as `struct sock_filter[]`, ready for seccomp(SECCOMP_SET_MODE_FILTER)."""
    p = _Program()
    p.emit(_LD_ABS_W, _OFFSET_ARCH)
    p.emit(_JEQ, AUDIT_ARCH_X86_64, "x86_64", 0)
    p.emit(_JEQ, AUDIT_ARCH_AARCH64, "aarch64", 0)
    p.emit(_RET, _RET_ERRNO | errno.EPERM)
    _arch_block(p, "x86_64", 0)
    _arch_block(p, "aarch64", 1)
    return p.assemble()


def engine_filter_b64() -> str:
    """The filter as capsule-init's `--seccomp-filter` takes it."""
    return base64.b64encode(engine_filter()).decode()
