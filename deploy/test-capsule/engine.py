#!/usr/bin/env python3
"""ColdSnap test engine: a small stand-in for vLLM/SGLang inside the test capsule.

Shape of a real engine, at MiB-to-GiB scale and without a GPU:
- one API process plus one child process per worker (like vLLM's multiprocessing executor);
- each worker warms up for real: reads its weight shard from the mounted model directory into
  memory, derives a digest table from it (CPU time proportional to the shard), closes the file,
  "initialises CUDA" by registering with the simulated driver (see cuda_checkpoint_sim.py) and
  counts the warm-up in a file in the container rootfs (so a second warm-up after a restore
  would show, even though the counter file travels in the capsule);
- /v1/completions answers the validation prompt with the text stored in the weights only while
  the in-memory weights still match the digests taken at warm-up and every worker's simulated
  GPU is running (locked or checkpointed GPUs are never served);
- /status reports each worker's identity (from the COLDSNAP_UNIT manifest the controller passes),
  pid, the devices as the simulated driver sees them, and the warm-up counters;
- /admin/quiesce and /admin/resume drain and reopen request intake around a snapshot.

Identity: COLDSNAP_UNIT is a JSON object
    {"unit_id": str, "devices": [uuid, ...],
     "workers": [{"id", "global_rank", "world_size", "process_slot", "device_slots": [int]}]}
Without it the engine runs one worker, rank 0 of 1, on no devices.

Shard files: <model-dir>/shard-<rank>-of-<world>.bin, a one-line JSON header followed by the
payload bytes; `engine.py make-shards` writes them.

Python 3 standard library only: it runs inside the capsule.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import http.server
import json
import os
import platform
import random
import socket
import socketserver
import struct
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cuda_checkpoint_sim as gpu_sim

SHARD_FORMAT = "coldsnap-test-shard/1"
CHUNK = 1 << 20
DEFAULT_STATE_DIR = "/var/lib/test-engine"
# Chunks re-verified per completion: enough to notice lost pages, cheap at GiB scale.
SAMPLED_CHUNKS = 8


def shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.bin"


def make_shards(out: str, world_size: int, payload_bytes: int, prompt: str, answer: str,
                seed: int = 0) -> list[str]:
    os.makedirs(out, exist_ok=True)
    paths = []
    for rank in range(world_size):
        header = {"format": SHARD_FORMAT, "rank": rank, "world_size": world_size,
                  "prompt": prompt, "answer": answer, "payload_bytes": payload_bytes}
        path = os.path.join(out, shard_name(rank, world_size))
        rng = random.Random(f"{seed}:{rank}")
        with open(path + ".tmp", "wb") as f:
            f.write(json.dumps(header, sort_keys=True).encode() + b"\n")
            left = payload_bytes
            while left:
                n = min(left, CHUNK)
                f.write(rng.randbytes(n))
                left -= n
        os.replace(path + ".tmp", path)
        paths.append(path)
    return paths


def chunk_digest(data: memoryview, rounds: int) -> bytes:
    d = hashlib.sha256(data).digest()
    for _ in range(rounds - 1):
        d = hashlib.sha256(d + data).digest()
    return d


def state_dir() -> str:
    return os.environ.get("TEST_ENGINE_STATE_DIR", DEFAULT_STATE_DIR)


def bump_warmup_counter(worker_id: str) -> int:
    os.makedirs(state_dir(), exist_ok=True)
    path = os.path.join(state_dir(), f"warmups-{worker_id}")
    try:
        with open(path, encoding="utf-8") as f:
            n = int(f.read().strip() or 0)
    except FileNotFoundError:
        n = 0
    n += 1
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(f"{n}\n")
    os.replace(path + ".tmp", path)
    return n


def read_warmup_counter(worker_id: str) -> int:
    try:
        with open(os.path.join(state_dir(), f"warmups-{worker_id}"), encoding="utf-8") as f:
            return int(f.read().strip() or 0)
    except FileNotFoundError:
        return 0


class Worker:
    """Runs in the worker child process."""

    def __init__(self, ident: dict[str, Any], devices: list[str], model_dir: str,
                 rounds: int) -> None:
        self.ident = ident
        self.devices = [devices[s] for s in ident.get("device_slots", []) if s < len(devices)]
        self.model_dir = model_dir
        self.rounds = rounds
        self.weights = bytearray()
        self.table: list[bytes] = []
        self.root = ""
        self.header: dict[str, Any] = {}
        self.warmups_in_process = 0
        self.warmup_seconds = 0.0
        self.weights_path = ""
        self.served = 0

    def warm_up(self) -> None:
        t0 = time.monotonic()
        rank, world = self.ident["global_rank"], self.ident["world_size"]
        self.weights_path = os.path.join(self.model_dir, shard_name(rank, world))
        # The file is closed before serving: a snapshot must not depend on the model mount.
        with open(self.weights_path, "rb") as f:
            self.header = json.loads(f.readline())
            if self.header.get("format") != SHARD_FORMAT or self.header.get("rank") != rank:
                raise RuntimeError(f"{self.weights_path}: not the shard of rank {rank}")
            size = int(self.header["payload_bytes"])
            self.weights = bytearray(size)
            view = memoryview(self.weights)
            got = 0
            while got < size:
                n = f.readinto(view[got:got + (64 << 20)])
                if not n:
                    raise RuntimeError(f"{self.weights_path}: truncated shard")
                got += n
        view = memoryview(self.weights)
        self.table = [chunk_digest(view[i:i + CHUNK], self.rounds)
                      for i in range(0, len(self.weights), CHUNK)]
        self.root = hashlib.sha256(b"".join(self.table)).hexdigest()
        gpu_sim.register(os.getpid(), self.devices)
        self.warmups_in_process += 1
        bump_warmup_counter(self.ident["id"])
        self.warmup_seconds = time.monotonic() - t0

    def gpu(self) -> dict[str, Any]:
        with gpu_sim.driver_lock():
            try:
                return gpu_sim.read_state(os.getpid())
            except gpu_sim.SimError as exc:
                return {"state": "absent", "devices": [], "error": str(exc)}

    def intact(self, full: bool) -> bool:
        if hashlib.sha256(b"".join(self.table)).hexdigest() != self.root:
            return False
        n = len(self.table)
        if full:
            picks = range(n)
        else:
            rng = random.Random(self.served)
            picks = sorted({rng.randrange(n) for _ in range(min(SAMPLED_CHUNKS, n))}) if n else []
        view = memoryview(self.weights)
        return all(chunk_digest(view[i * CHUNK:(i + 1) * CHUNK], self.rounds) == self.table[i]
                   for i in picks)

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "status":
            g = self.gpu()
            return {**self.ident, "pid": os.getpid(), "devices": g.get("devices", []),
                    "gpu_state": g.get("state"), "warmups_total": read_warmup_counter(
                        self.ident["id"]), "warmups_in_process": self.warmups_in_process,
                    "warmup_seconds": self.warmup_seconds, "weights_path": self.weights_path,
                    "weights_bytes": len(self.weights), "weights_root": self.root,
                    "served": self.served}
        if op == "complete":
            g = self.gpu()
            if g.get("state") != "running":
                return {"ok": False, "error": f"GPU state is {g.get('state')}, not running"}
            self.served += 1
            if not self.intact(full=bool(req.get("full_check"))):
                return {"ok": False, "error": "warm state damaged: weights digest mismatch"}
            if req.get("prompt") == self.header.get("prompt"):
                text = self.header["answer"]
            else:
                text = "echo:" + hashlib.sha256(
                    (self.root + str(req.get("prompt"))).encode()).hexdigest()[:16]
            return {"ok": True, "text": text}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def loop(self, sock: socket.socket) -> None:
        f = sock.makefile("rwb")
        for line in f:
            try:
                resp = self.handle(json.loads(line))
            except Exception as exc:  # a worker must answer, never die on one bad request
                resp = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            f.write(json.dumps(resp).encode() + b"\n")
            f.flush()


class Channel:
    def __init__(self, ident: dict[str, Any], sock: socket.socket, pid: int) -> None:
        self.ident = ident
        self.sock = sock
        self.pid = pid
        self.file = sock.makefile("rwb")
        self.lock = threading.Lock()

    def call(self, req: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.file.write(json.dumps(req).encode() + b"\n")
            self.file.flush()
            line = self.file.readline()
        if not line:
            return {"ok": False, "error": f"worker {self.ident['id']} is gone"}
        out: dict[str, Any] = json.loads(line)
        return out


class Engine:
    def __init__(self, manifest: dict[str, Any], channels: list[Channel]) -> None:
        self.manifest = manifest
        self.channels = channels
        self.cond = threading.Condition()
        self.draining = False
        self.in_flight = 0
        self.undumpable: int | None = None

    def status(self) -> dict[str, Any]:
        workers = [c.call({"op": "status"}) for c in self.channels]
        return {"unit_id": self.manifest.get("unit_id"), "pid": os.getpid(),
                "draining": self.draining, "in_flight": self.in_flight,
                "holds_undumpable": self.undumpable is not None, "workers": workers}

    def healthy(self) -> bool:
        if self.draining:
            return False
        return all(w.get("gpu_state") == "running" for w in self.status()["workers"])

    def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.cond:
            if self.draining:
                return 503, {"error": "engine is quiesced"}
            self.in_flight += 1
        try:
            answers = [c.call({"op": "complete", "prompt": body.get("prompt"),
                               "full_check": body.get("full_check", False)})
                       for c in self.channels]
        finally:
            with self.cond:
                self.in_flight -= 1
                self.cond.notify_all()
        bad = [a["error"] for a in answers if not a.get("ok")]
        if bad:
            return 503, {"error": "; ".join(bad)}
        texts = [a["text"] for a in answers]
        # Every shard carries the whole trained answer; other prompts get each rank's part.
        text = texts[0] if len(set(texts)) == 1 else "/".join(texts)
        return 200, {"text": text, "workers": len(answers)}

    def quiesce(self, timeout: float) -> tuple[int, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self.cond:
            self.draining = True
            while self.in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return 504, {"error": "in-flight requests did not drain",
                                 "in_flight": self.in_flight}
                self.cond.wait(left)
        return 200, {"draining": True, "in_flight": 0}

    def resume(self) -> tuple[int, dict[str, Any]]:
        with self.cond:
            self.draining = False
        return 200, {"draining": False}

    def hold_undumpable(self) -> tuple[int, dict[str, Any]]:
        # Test knob: a perf event fd is a kernel object CRIU has no dumper for ("Can't dump
        # file ... anon_inode:[perf_event]"), so a dump of this tree is refused while it is open.
        if self.undumpable is None:
            try:
                self.undumpable = open_perf_event()
            except OSError as exc:
                return 500, {"error": f"perf_event_open: {exc}"}
        return 200, {"holds_undumpable": True}

    def release_undumpable(self) -> tuple[int, dict[str, Any]]:
        if self.undumpable is not None:
            os.close(self.undumpable)
            self.undumpable = None
        return 200, {"holds_undumpable": False}


PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}


def open_perf_event() -> int:
    """perf_event_open(software CPU clock, this process): needs no PMU, works in containers."""
    nr = PERF_EVENT_OPEN.get(platform.machine())
    if nr is None:
        raise OSError(f"perf_event_open: unknown syscall number on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    attr = ctypes.create_string_buffer(128)
    # struct perf_event_attr: type=PERF_TYPE_SOFTWARE(1), size=128, config=CPU_CLOCK(0)
    attr[0:16] = struct.pack("<IIQ", 1, 128, 0)
    fd = int(libc.syscall(nr, attr, 0, -1, -1, 0))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def make_handler(engine: Engine) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def address_string(self) -> str:
            return "local"  # unix peers have no address tuple

        def log_message(self, format: str, *args: Any) -> None:
            # Quiet on purpose: nothing may grow the engine's stdio files around a snapshot.
            pass

        def reply(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def body(self) -> dict[str, Any]:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b"{}"
            out: dict[str, Any] = json.loads(raw or b"{}")
            return out

        def do_GET(self) -> None:
            if self.path == "/health":
                ok = engine.healthy()
                self.reply(200 if ok else 503, {"status": "ok" if ok else "unavailable"})
            elif self.path == "/status":
                self.reply(200, engine.status())
            else:
                self.reply(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = self.body()
            if self.path == "/v1/completions":
                self.reply(*engine.complete(body))
            elif self.path == "/admin/quiesce":
                self.reply(*engine.quiesce(float(body.get("timeout", 30))))
            elif self.path == "/admin/resume":
                self.reply(*engine.resume())
            elif self.path == "/admin/hold-undumpable":
                self.reply(*engine.hold_undumpable())
            elif self.path == "/admin/release-undumpable":
                self.reply(*engine.release_undumpable())
            else:
                self.reply(404, {"error": "not found"})

    return Handler


def load_manifest() -> dict[str, Any]:
    raw = os.environ.get("COLDSNAP_UNIT")
    if not raw:
        return {"unit_id": "local", "devices": [], "workers": [
            {"id": "worker-0", "global_rank": 0, "world_size": 1, "process_slot": 0,
             "device_slots": []}]}
    manifest: dict[str, Any] = json.loads(raw)
    return manifest


def serve(args: argparse.Namespace) -> int:
    manifest = load_manifest()
    workers = sorted(manifest["workers"], key=lambda w: w["process_slot"])
    channels = []
    for ident in workers:
        parent_end, child_end = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            parent_end.close()
            for c in channels:
                c.sock.close()
            code = 0
            try:
                w = Worker(ident, manifest.get("devices", []), args.model_dir,
                           args.warmup_rounds)
                w.warm_up()
                child_end.sendall(b"ready\n")
                w.loop(child_end)
            except BaseException as exc:
                print(f"worker {ident['id']}: {type(exc).__name__}: {exc}", file=sys.stderr,
                      flush=True)
                code = 1
            os._exit(code)
        child_end.close()
        channels.append(Channel(ident, parent_end, pid))
    # Workers warm up in parallel; the API opens only once all of them are ready.
    for c in channels:
        if c.file.readline() != b"ready\n":
            print(f"worker {c.ident['id']} failed to warm up", file=sys.stderr, flush=True)
            return 1
    engine = Engine(manifest, channels)
    server = make_server(args.listen, make_handler(engine))
    print(f"test engine serving on {args.listen}", flush=True)
    server.serve_forever()
    return 0


class UnixHTTPServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


def make_server(listen: str, handler: type[http.server.BaseHTTPRequestHandler]
                ) -> socketserver.BaseServer:
    # Default is an abstract unix socket: CRIU 4.1.1 cannot dump an AF_INET socket on Linux
    # >= 6.16 (SO_PASSCRED now fails there with EOPNOTSUPP), and the abstract namespace leaves
    # no socket file in the rootfs to collide with at restore.
    if listen.startswith("unix:"):
        addr = listen[len("unix:"):]
        return UnixHTTPServer("\0" + addr[1:] if addr.startswith("@") else addr, handler)
    if listen.startswith("tcp:"):
        host, _, port = listen[len("tcp:"):].rpartition(":")
        srv = http.server.ThreadingHTTPServer((host, int(port)), handler)
        srv.daemon_threads = True
        return srv
    raise SystemExit(f"--listen: expected unix:@name, unix:/path or tcp:HOST:PORT, not {listen}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="test-engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--listen", default="unix:@coldsnap-engine",
                   help="unix:@abstract-name, unix:/path or tcp:HOST:PORT")
    s.add_argument("--model-dir", default="/models")
    s.add_argument("--warmup-rounds", type=int, default=4,
                   help="digest rounds per weight chunk: the CPU cost of warm-up")
    m = sub.add_parser("make-shards")
    m.add_argument("--out", required=True)
    m.add_argument("--world-size", type=int, required=True)
    m.add_argument("--bytes", type=int, required=True, help="payload bytes per shard")
    m.add_argument("--prompt", required=True)
    m.add_argument("--answer", required=True)
    m.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.cmd == "serve":
        return serve(args)
    for path in make_shards(args.out, args.world_size, args.bytes, args.prompt, args.answer,
                            args.seed):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
