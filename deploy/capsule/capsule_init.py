#!/usr/bin/python3 -I
"""Quiet PID 1 for capsule containers, and the confined launcher of the engine.

    capsule-init                         PID 1: spawns nothing, reaps orphans
    capsule-init (as CRIU's action script) runs $COLDSNAP_CRIU_ACTION with sh -c
    capsule-init launch --pid-floor N --stdin FILE --log FILE [--seccomp-filter B64]
                        [--environ-from PID] -- ARGV...

CRIU restores the engine tree with its original PIDs, so PID 1 must never spawn anything that
could take one of them. As PID 1 this shim spawns nothing: it reaps orphans (a restored engine
is reparented to PID 1) and exits on SIGTERM/SIGINT so `docker stop` is prompt.

`launch` (run by coldsnapd through `docker exec`, with the container's capabilities) starts the
engine confined: its own session, stdio on regular files, PIDs above N, then an empty
capability bounding set, no inheritable or ambient capabilities, no-new-privs and the seccomp
filter coldsnapd generated (coldsnap/capsule/seccomp.py) before the exec, so the engine tree
holds no capability at all while CRIU, exec'd beside it, keeps the container's.
`--environ-from 1` gives the engine the container's own environment and working directory
(PID 1's: the unit's request environment, the image's WORKDIR), since coldsnapd runs its
execs, this one included, with an empty environment, in /. It prints the engine's PID and
returns at once; the engine is reparented to PID 1.

PIDs above N without writing /proc/sys/kernel/ns_last_pid (Docker keeps /proc/sys read-only):
the kernel hands out PIDs (thread ids included) cyclically, so short-lived threads are started
until one gets a PID above N; the next fork, the engine, follows it. A restored tree's PIDs
are set by CRIU itself (clone3 with set_tid), which does not move that cursor, so a fresh
container's helpers (criu, its lazy-pages daemon) stay at low PIDs, clear of the tree.

Standard library only: real capsules copy this file as they are (deploy/capsule/). It runs
with CRIU's capabilities (PID 1, the launcher, CRIU's action script), so its interpreter is
named by absolute path and isolated (`python3 -I`: no PYTHON* variable, no user site, no
.pth of a directory the engine writes); `env` or PATH would let the container's environment
(the request's) choose it.
"""

import argparse
import base64
import ctypes
import os
import signal
import sys
import threading

PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# A ceiling, not the kernel's count: dropping a capability the kernel does not know fails
# with EINVAL, which ends the loop.
_CAP_CEILING = 64
# Above any descriptor `docker exec` hands a process (os.closerange uses close_range(2)).
_FD_CEILING = 1 << 20


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def confine(seccomp_filter: bytes | None) -> None:
    """Empty bounding set, no inheritable or ambient capabilities, no-new-privs, then the
    seccomp filter coldsnapd generated (`struct sock_filter[]`): after the next exec this
    process holds no capability, can never gain one (not even from a setuid or
    file-capability binary), and the filter stays on it and on all it starts."""
    libc = _libc()
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong]
    for cap in range(_CAP_CEILING):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() == 22:  # EINVAL: past the kernel's last capability
                break
            _check(-1, f"drop capability {cap} from the bounding set")
    # Root keeps, across exec, whatever is in its inheritable set: empty it too.
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(libc.capget(ctypes.byref(header), data), "capget")
    for d in data:
        d.inheritable = 0
    _check(libc.capset(ctypes.byref(header), data), "capset")
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if seccomp_filter:
        if len(seccomp_filter) % 8:
            raise ValueError("a seccomp filter is a whole number of 8-byte instructions")
        buf = ctypes.create_string_buffer(seccomp_filter, len(seccomp_filter))
        prog = _SockFprog(len(seccomp_filter) // 8, ctypes.addressof(buf))
        _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0),
               "seccomp filter")


def advance_pids(floor: int, limit: int = 1 << 17) -> int:
    """Start short-lived threads (each takes the next PID, as a fork would, at a fraction of
    a fork's cost) until one gets a PID above `floor`; returns it, or 0 when none did."""
    got: list[int] = []
    for _ in range(limit):
        thread = threading.Thread(target=lambda: got.append(threading.get_native_id()))
        thread.start()
        thread.join()
        tid = got.pop()
        if tid > floor:
            return tid
    return 0


def _environ_of(pid: int) -> dict[str, str]:
    """The environment `pid` was started with (/proc/PID/environ)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read()
    env = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name:
            env[os.fsdecode(name)] = os.fsdecode(value)
    return env


def launch(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="capsule-init launch")
    p.add_argument("--pid-floor", type=int, required=True)
    p.add_argument("--stdin", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--seccomp-filter", default="",
                   help="base64 of the struct sock_filter[] to install (none: no filter)")
    p.add_argument("--environ-from", type=int, default=None,
                   help="start the engine with this PID's environment and working directory "
                        "instead of ours")
    p.add_argument("command", nargs="+")
    args = p.parse_args(argv)
    env = os.environ.copy() if args.environ_from is None else _environ_of(args.environ_from)
    if not advance_pids(args.pid_floor):
        print(f"capsule-init: could not get a PID above {args.pid_floor}", file=sys.stderr)
        return 1
    # The child reports a failed confinement or exec through this pipe (closed on exec).
    r, w = os.pipe()
    os.set_inheritable(w, False)
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setsid()
            stdin = os.open(args.stdin, os.O_RDONLY)
            log = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(stdin, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(stdin)
            os.close(log)
            # Whatever the launcher inherited from `docker exec` (descriptors of dockerd's
            # mounts, e.g. its /dev/null) would be inherited by the engine, and CRIU cannot
            # dump a descriptor whose mount it cannot find in the container. Only the
            # close-on-exec error pipe survives until the exec.
            os.closerange(3, w)
            os.closerange(w + 1, _FD_CEILING)
            if args.environ_from is not None:
                # The container's working directory (PID 1 starts there): coldsnapd runs its
                # execs, this one included, in / so that nothing in a directory the engine
                # writes is ever read beside them.
                os.chdir(f"/proc/{args.environ_from}/cwd")
            confine(base64.b64decode(args.seccomp_filter, validate=True))
            os.execvpe(args.command[0], args.command, env)  # noqa: S606 (argv list, no shell)
        except BaseException as exc:  # reported to the parent, then exit
            os.write(w, f"{type(exc).__name__}: {exc}".encode())
        os._exit(127)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        failure = pipe.read().decode(errors="replace")
    if failure:
        os.waitpid(pid, 0)
        print(f"capsule-init: cannot start {args.command[0]}: {failure}", file=sys.stderr)
        return 1
    print(pid, flush=True)
    return 0


def criu_action() -> int:
    """Run as CRIU's action script (`criu dump --action-script /usr/local/bin/capsule-init`):
    the commands coldsnapd gave the dump in COLDSNAP_CRIU_ACTION, through `sh -c`. CRIU execs
    its script by path, and a script written into the container at dump time would sit in a
    directory the engine writes (the rootfs is read-only); this file is part of the rootfs."""
    script = os.environ.get("COLDSNAP_CRIU_ACTION", "")
    if not script:
        return 0
    os.execv("/bin/sh", ["sh", "-c", script])  # noqa: S606 (coldsnapd's own script)
    return 127


def main() -> int:
    if sys.argv[1:2] == ["launch"]:
        return launch(sys.argv[2:])
    if "CRTOOLS_SCRIPT_ACTION" in os.environ:
        return criu_action()
    return reap_forever()


_WAKE = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}


def reap_forever() -> int:
    """PID 1: reap every child that ends, until SIGTERM or SIGINT (`docker stop`).

    The signals are blocked and taken with sigwait: a child that ends between a wait that
    found none and the sleep after it leaves its SIGCHLD pending, which the next sigwait
    returns at once (os.wait() then signal.pause() would sleep through it, and the zombie
    with it). Handlers stay installed: PID 1 of a PID namespace gets a signal from outside it
    only when it has one."""
    for sig in _WAKE:
        signal.signal(sig, lambda *_: None)
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAKE)
    while True:
        reap_all()
        if signal.sigwait(_WAKE) in (signal.SIGTERM, signal.SIGINT):
            return 0


def reap_all() -> None:
    """Reap every child that has ended, without waiting for one that runs."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


if __name__ == "__main__":
    sys.exit(main())
