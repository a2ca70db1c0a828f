"""The engine's seccomp filter, run through a classic-BPF interpreter: what it refuses and
what it lets through, per architecture."""

from __future__ import annotations

import base64
import errno
import struct

import pytest

from coldsnap.capsule.seccomp import (
    AUDIT_ARCH_AARCH64,
    AUDIT_ARCH_X86_64,
    DENIED,
    UNSUPPORTED,
    engine_filter,
    engine_filter_b64,
)

ALLOW = 0x7FFF0000
EPERM = 0x00050000 | errno.EPERM
ENOSYS = 0x00050000 | errno.ENOSYS
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_THREAD_FLAGS = 0x003D0F00  # what pthread_create passes


def run_filter(program: bytes, arch: int, nr: int, *args: int) -> int:
    """Evaluate a seccomp classic-BPF program on one `struct seccomp_data`."""
    argv = [*args, *[0] * (6 - len(args))]
    data = struct.pack("<iIQ6Q", nr, arch, 0, *argv)
    insns = [struct.unpack_from("<HBBI", program, i) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        op, jt, jf, k = insns[pc]
        pc += 1
        if op == 0x20:  # ld [k]
            acc = struct.unpack_from("<I", data, k)[0]
        elif op == 0x15:  # jeq
            pc += jt if acc == k else jf
        elif op == 0x35:  # jge
            pc += jt if acc >= k else jf
        elif op == 0x45:  # jset
            pc += jt if acc & k else jf
        elif op == 0x06:  # ret
            return k
        else:
            raise AssertionError(f"unexpected opcode {op:#x}")


@pytest.fixture(scope="module")
def program() -> bytes:
    return engine_filter()


@pytest.mark.parametrize(("arch", "index", "read_nr"), [
    (AUDIT_ARCH_X86_64, 0, 0), (AUDIT_ARCH_AARCH64, 1, 63)])
def test_every_denied_syscall_is_refused_and_read_is_allowed(
        program: bytes, arch: int, index: int, read_nr: int) -> None:
    for name, numbers in DENIED.items():
        nr = numbers[index]
        if nr is not None:
            assert run_filter(program, arch, nr) == EPERM, name
    assert run_filter(program, arch, read_nr) == ALLOW


@pytest.mark.parametrize("arch", [AUDIT_ARCH_X86_64, AUDIT_ARCH_AARCH64])
def test_io_uring_answers_enosys_so_its_users_fall_back_to_epoll(program: bytes,
                                                                  arch: int) -> None:
    # 425-427 on both architectures: setup, enter, register. CRIU cannot dump an io_uring.
    for nr in (425, 426, 427):
        assert run_filter(program, arch, nr) == ENOSYS, nr
    assert set(UNSUPPORTED) == {"io_uring_setup", "io_uring_enter", "io_uring_register"}


@pytest.mark.parametrize(("arch", "clone", "clone3"), [
    (AUDIT_ARCH_X86_64, 56, 435), (AUDIT_ARCH_AARCH64, 220, 435)])
def test_clone_into_a_new_namespace_is_refused(program: bytes, arch: int, clone: int,
                                               clone3: int) -> None:
    assert run_filter(program, arch, clone, 0x11) == ALLOW  # fork: SIGCHLD
    assert run_filter(program, arch, clone, CLONE_THREAD_FLAGS) == ALLOW
    assert run_filter(program, arch, clone, CLONE_NEWUSER | 0x11) == EPERM
    assert run_filter(program, arch, clone, CLONE_NEWNET) == EPERM
    # clone3's flags are behind a pointer: ENOSYS makes the C library fall back to clone
    assert run_filter(program, arch, clone3) == ENOSYS


def test_unknown_architecture_and_x32_are_refused(program: bytes) -> None:
    assert run_filter(program, 0x40000003, 0) == EPERM  # i386
    assert run_filter(program, AUDIT_ARCH_X86_64, 0x40000000) == EPERM  # x32 read


def test_the_kernel_gets_whole_instructions_and_the_launcher_gets_base64(
        program: bytes) -> None:
    assert len(program) % 8 == 0 and len(program) // 8 < 4096  # BPF_MAXINSNS
    assert base64.b64decode(engine_filter_b64()) == program
