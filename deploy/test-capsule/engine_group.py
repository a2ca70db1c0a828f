"""Cross-worker group of the ColdSnap test engine: a small stand-in for the NCCL/Gloo bootstrap.

Every worker of one world group takes part, whichever unit (host) it runs in:
- it picks its local IPv4 address from the interface that the transport variables select
  (`select_interface`: NCCL_SOCKET_IFNAME with NCCL's syntax, else GLOO_SOCKET_IFNAME);
- rank 0 listens on (local address, master port); every other rank binds its local address,
  connects to (master address, master port), retrying every 100 ms, and handshakes
  {"rank", "world_size"}. The group is ready when rank 0 holds all world_size-1 peers;
- rank 0 runs the all-reduce: it sends one step to every peer, each peer answers with its
  contribution, and a rank that cannot be reached fails the step within a bounded time;
- `stop()` closes every socket (rank 0 its listener too) and joins the group's threads, so a
  sleeping engine holds no TCP socket at all, as an engine destroys its communicators before a
  checkpoint. A rebuilt group starts from scratch with the (possibly new) placement.

Python 3 standard library only: it runs inside the capsule.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

SIOCGIFADDR = 0x8915
SIOCGIFNETMASK = 0x891B
CONNECT_RETRY = 0.1  # seconds between a peer's connection attempts, as torch's store client
CONNECT_TIMEOUT = 0.5
HANDSHAKE_TIMEOUT = 2.0
POLL = 0.2  # how often blocked group threads look at the stop flag
# A rank that does not answer a step within this fails the completion (tests shorten it).
STEP_TIMEOUT = float(os.environ.get("TEST_ENGINE_STEP_TIMEOUT") or 10.0)
JOIN_TIMEOUT = 3.0

Contribute = Callable[[dict[str, Any]], dict[str, Any]]


class GroupError(Exception):
    pass


def log(msg: str) -> None:
    print(f"test engine: {msg}", file=sys.stderr, flush=True)


# ---- interfaces --------------------------------------------------------------------------


def interfaces() -> list[tuple[str, str, str]]:
    """(name, IPv4 address, netmask) of every interface that has an IPv4 address, in index
    order."""
    out = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _index, name in socket.if_nameindex():
            ifreq = struct.pack("16s24x", name.encode()[:15])
            try:
                addr = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, ifreq)[20:24]
                mask = fcntl.ioctl(probe.fileno(), SIOCGIFNETMASK, ifreq)[20:24]
            except OSError:  # no IPv4 address on this interface
                continue
            out.append((name, socket.inet_ntoa(addr), socket.inet_ntoa(mask)))
    finally:
        probe.close()
    return out


def _matcher(spec: str, exact_only: bool = False) -> Callable[[str], bool]:
    """NCCL_SOCKET_IFNAME syntax: comma-separated name prefixes; a leading `^` excludes the
    listed ones; a leading `=` (after any `^`) means exact names. GLOO_SOCKET_IFNAME names
    interfaces exactly (`exact_only`)."""
    exclude = spec.startswith("^")
    if exclude:
        spec = spec[1:]
    exact = exact_only or spec.startswith("=")
    if spec.startswith("="):
        spec = spec[1:]
    items = [s.strip() for s in spec.split(",") if s.strip()]

    def listed(name: str) -> bool:
        return any(name == it if exact else name.startswith(it) for it in items)

    return (lambda name: not listed(name)) if exclude else listed


def _resolve(host: str) -> ipaddress.IPv4Address | None:
    try:
        return ipaddress.IPv4Address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None


def select_interface(env: Mapping[str, str | None], master_addr: str) -> tuple[str, str]:
    """(interface name, local IPv4 address) for the group's sockets, or GroupError.

    With NCCL_SOCKET_IFNAME (or else GLOO_SOCKET_IFNAME) set, the first interface it selects.
    Unset: the interface whose subnet holds the master address (as NCCL does when it knows the
    remote address; 127.0.0.1 gives lo), else the first non-loopback interface, else lo."""
    have = interfaces()
    for var, exact in (("NCCL_SOCKET_IFNAME", False), ("GLOO_SOCKET_IFNAME", True)):
        spec = env.get(var)
        if spec:
            match = _matcher(spec, exact_only=exact)
            for name, addr, _mask in have:
                if match(name):
                    return name, addr
            listing = ", ".join(f"{n} {a}" for n, a, _ in have) or "none"
            raise GroupError(f"{var}={spec} matches no interface with an IPv4 address "
                             f"(interfaces: {listing}); the group cannot form")
    master = _resolve(master_addr)
    if master is not None:
        for name, addr, mask in have:
            if master in ipaddress.IPv4Network(f"{addr}/{mask}", strict=False):
                return name, addr
    for name, addr, _mask in have:
        if not ipaddress.IPv4Address(addr).is_loopback:
            return name, addr
    for name, addr, _mask in have:
        return name, addr
    raise GroupError("no interface has an IPv4 address; the group cannot form")


# ---- one JSON-lines connection ---------------------------------------------------------------


class LineConn:
    """A TCP connection carrying one JSON object per line, with deadlines on every read."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def send(self, obj: dict[str, Any], timeout: float = STEP_TIMEOUT) -> None:
        self.sock.settimeout(timeout)
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self, deadline: float) -> dict[str, Any]:
        """Next object; TimeoutError past the deadline (a partial line is kept),
        ConnectionError when the peer closed."""
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                raise TimeoutError("timed out") from None
            if not chunk:
                raise ConnectionError("connection closed by the other side")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        out = json.loads(line)
        if not isinstance(out, dict):
            raise ValueError("not a JSON object")
        return out

    def alive(self) -> bool:
        """Not closed by the other side, judged without consuming or waiting for anything."""
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            events = poller.poll(0)
            if not events:
                return True
            if events[0][1] & (select.POLLERR | select.POLLNVAL):
                return False
            # Readable: either data (a reply in flight) or the end of the stream.
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except (BlockingIOError, TimeoutError):
            return True
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        # shutdown first: it wakes any thread blocked on this socket, so the socket is really
        # gone once close() returns (a plain close leaves it alive under a blocked recv).
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


# ---- the group ---------------------------------------------------------------------------------


class Group:
    """One worker's membership in its world group: threads and sockets live between start()
    and stop()."""

    def __init__(self, who: str, rank: int, world_size: int, master_addr: str,
                 master_port: int, env: Mapping[str, str | None],
                 contribute: Contribute) -> None:
        self.who = who
        self.rank = rank
        self.world_size = world_size
        self.master_addr = master_addr
        self.master_port = master_port
        self.env = dict(env)
        self.contribute = contribute
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.problem: str | None = None  # the last reason the group is not up, for errors
        self.local: tuple[str, str] | None = None  # (interface, address) in use

    @property
    def master(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=f"group-{self.rank}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._close_all()
        if self.thread is not None:
            self.thread.join(JOIN_TIMEOUT)
        self._close_all()  # whatever the thread opened while it was stopping

    def ready(self) -> bool:
        raise NotImplementedError

    def _run(self) -> None:
        raise NotImplementedError

    def _close_all(self) -> None:
        raise NotImplementedError

    def _report(self, problem: str) -> None:
        """Log each distinct problem once per group build: quiet while it persists."""
        if problem != self.problem:
            log(f"{self.who}: {problem}")
        self.problem = problem

    def _local_address(self) -> str | None:
        """The local address, retried every second until found or stopped."""
        while not self.stopping.is_set():
            try:
                self.local = select_interface(self.env, self.master_addr)
                return self.local[1]
            except GroupError as exc:
                self._report(str(exc))
            self.stopping.wait(1.0)
        return None


class MasterGroup(Group):
    """Rank 0: listens on (local address, master port), holds one connection per peer and runs
    the all-reduce."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.listener: socket.socket | None = None
        self.peers: dict[int, LineConn] = {}
        self.peers_lock = threading.Lock()
        self.reduce_lock = threading.Lock()
        self.seq = 0

    def ready(self) -> bool:
        if self.world_size == 1:
            return True
        with self.peers_lock:
            for rank, conn in list(self.peers.items()):
                if not conn.alive():
                    self._drop(rank, conn)
            return len(self.peers) == self.world_size - 1

    def _drop(self, rank: int, conn: LineConn) -> None:
        # caller holds peers_lock
        if self.peers.get(rank) is conn:
            del self.peers[rank]
        conn.close()

    def _close_all(self) -> None:
        # stop() and the group thread may both get here: each socket is taken exactly once.
        with self.peers_lock:
            listener, self.listener = self.listener, None
            for rank, conn in list(self.peers.items()):
                self._drop(rank, conn)
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
            listener.close()

    def _listen(self) -> socket.socket | None:
        while not self.stopping.is_set():
            addr = self._local_address()
            if addr is None:
                return None
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                # Reuse: the connections closed on sleep leave TIME_WAIT entries on this port.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((addr, self.master_port))
                s.listen(64)
                s.settimeout(POLL)
                self.problem = None
                return s
            except OSError as exc:
                s.close()
                self._report(f"cannot listen on {addr}:{self.master_port} "
                             f"({self.local[0] if self.local else '?'}): {exc}")
            self.stopping.wait(1.0)
        return None

    def _run(self) -> None:
        if self.world_size == 1:
            return  # a group of one needs no sockets (as vLLM with TP1)
        listener = self._listen()
        if listener is None:
            return
        with self.peers_lock:
            if self.stopping.is_set():  # stop() ran before the listener was published
                listener.close()
                return
            self.listener = listener
        while not self.stopping.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed by stop()
            self._admit(LineConn(sock))

    def _admit(self, conn: LineConn) -> None:
        try:
            hello = conn.recv(time.monotonic() + HANDSHAKE_TIMEOUT)
            rank, world = int(hello["rank"]), int(hello["world_size"])
            if world != self.world_size or not 0 < rank < self.world_size:
                conn.send({"ok": False, "error": f"rank {rank} of {world} does not belong to "
                           f"this group of {self.world_size}"}, HANDSHAKE_TIMEOUT)
                conn.close()
                return
            conn.send({"ok": True}, HANDSHAKE_TIMEOUT)
        except (OSError, ValueError, KeyError, TypeError):
            conn.close()
            return
        with self.peers_lock:
            if self.stopping.is_set():
                conn.close()
                return
            old = self.peers.get(rank)
            if old is not None:  # the peer reconnected (restarted, or its link broke)
                self._drop(rank, old)
            self.peers[rank] = conn

    def all_reduce(self, step: dict[str, Any], own: dict[str, Any],
                   timeout: float = STEP_TIMEOUT) -> list[dict[str, Any]]:
        """Every rank's contribution to `step`, in rank order, or GroupError within `timeout`
        when a rank is missing, unreachable or silent."""
        deadline = time.monotonic() + timeout
        if self.world_size == 1:
            return [own]
        if not self.reduce_lock.acquire(timeout=timeout):
            raise GroupError(f"all-reduce busy for more than {timeout:.0f}s")
        try:
            with self.peers_lock:
                peers = sorted(self.peers.items())
            missing = [r for r in range(1, self.world_size) if r not in dict(peers)]
            if missing:
                where = f"listening on {self.local[1]}:{self.master_port}" \
                    if self.listener is not None and self.local else self.problem
                raise GroupError(
                    f"rank {', '.join(map(str, missing))} of {self.world_size} is not "
                    f"connected to the group (rank 0 {where or 'not listening yet'}); "
                    "the all-reduce cannot run")
            self.seq += 1
            msg = {**step, "op": "step", "seq": self.seq}
            for rank, conn in peers:
                try:
                    conn.send(msg, max(0.1, deadline - time.monotonic()))
                except OSError as exc:
                    self._fail(rank, conn, f"rank {rank} is unreachable: {exc}")
            out = [own]
            for rank, conn in peers:
                try:
                    reply = conn.recv(deadline)
                except TimeoutError:
                    self._fail(rank, conn, f"rank {rank} did not answer within {timeout:.0f}s")
                except (OSError, ValueError) as exc:
                    self._fail(rank, conn, f"rank {rank} is unreachable: {exc}")
                if reply.get("seq") != self.seq:
                    self._fail(rank, conn, f"rank {rank} answered out of order")
                out.append(reply)
            return out
        finally:
            self.reduce_lock.release()

    def _fail(self, rank: int, conn: LineConn, why: str) -> None:
        with self.peers_lock:
            self._drop(rank, conn)  # it reconnects afresh; no half-read step is left behind
        raise GroupError(why)


class PeerGroup(Group):
    """Rank > 0: connects to the master from its local address and answers steps."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.conn: LineConn | None = None
        self.sock: socket.socket | None = None  # the socket being connected, for stop()
        self.lock = threading.Lock()

    def ready(self) -> bool:
        return self.conn is not None

    def _close_all(self) -> None:
        with self.lock:
            if self.conn is not None:
                self.conn.close()
                self.conn = None
            if self.sock is not None:
                with contextlib.suppress(OSError):
                    self.sock.close()
                self.sock = None

    def _connect(self, addr: str) -> LineConn | None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with self.lock:
            if self.stopping.is_set():
                s.close()
                return None
            self.sock = s
        try:
            s.bind((addr, 0))  # from the selected interface, as NCCL does
            s.settimeout(CONNECT_TIMEOUT)
            s.connect((self.master_addr, self.master_port))
            conn = LineConn(s)
            conn.send({"rank": self.rank, "world_size": self.world_size}, HANDSHAKE_TIMEOUT)
            answer = conn.recv(time.monotonic() + HANDSHAKE_TIMEOUT)
        except (OSError, ValueError):
            s.close()
            return None
        finally:
            with self.lock:
                self.sock = None
        if not answer.get("ok"):
            self._report(f"master {self.master} refused rank {self.rank}: "
                         f"{answer.get('error')}")
            conn.close()
            self.stopping.wait(1.0)
            return None
        with self.lock:
            if self.stopping.is_set():
                conn.close()
                return None
            self.conn = conn
        self.problem = None
        return conn

    def _run(self) -> None:
        while not self.stopping.is_set():
            addr = self._local_address()
            if addr is None:
                return
            conn = self._connect(addr)
            if conn is None:
                self.stopping.wait(CONNECT_RETRY)
                continue
            self._serve(conn)
            with self.lock:
                if self.conn is conn:
                    self.conn = None
            conn.close()
            self.stopping.wait(CONNECT_RETRY)

    def _serve(self, conn: LineConn) -> None:
        while not self.stopping.is_set():
            try:
                step = conn.recv(time.monotonic() + POLL)
            except TimeoutError:
                continue
            except (OSError, ValueError):
                return  # the master went away: reconnect
            if step.get("op") != "step":
                continue
            try:
                reply = self.contribute(step)
            except Exception as exc:  # a rank must answer, never die on one bad step
                reply = {"ok": False, "error": f"rank {self.rank}: {type(exc).__name__}: {exc}"}
            try:
                conn.send({**reply, "seq": step.get("seq")})
            except OSError:
                return


def make_group(who: str, rank: int, world_size: int, master_addr: str, master_port: int,
               env: Mapping[str, str | None], contribute: Contribute) -> Group:
    cls = MasterGroup if rank == 0 else PeerGroup
    return cls(who, rank, world_size, master_addr, master_port, env, contribute)
