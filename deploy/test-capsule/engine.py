#!/usr/bin/env python3
"""ColdSnap test engine: a small stand-in for vLLM/SGLang inside the test capsule.

    engine.py serve [--api vllm|sglang] [--host 0.0.0.0] [--port P] --model-dir D
                    [--served-model-name NAME] [--master-addr A] [--master-port P2]
                    [--warmup-rounds N] [--hold-undumpable] [--try-io-uring]
    engine.py make-shards --out D --world-size W --bytes N --prompt P --answer A [--seed S]

--api defaults to vllm; --port to 8000 (vllm) or 30000 (sglang); --master-addr to
$MASTER_ADDR else 127.0.0.1 and --master-port to $MASTER_PORT else 29500 (as torch);
--served-model-name to the model dir. --hold-undumpable makes the API process open a TCP
connection to itself at start and keep it: CRIU refuses to dump a connected TCP socket without
--tcp-established, so a dump of the tree is refused (a test knob). --try-io-uring asks for an
io_uring instance at start, as libuv does, and keeps it when it gets one (io_uring_probe.py).

Processes, shaped like a real engine at MiB-to-GiB scale and without a GPU:
- one API process serving HTTP on TCP (--host, --port), plus one EXEC'd worker process per
  manifest worker (`engine.py worker ...`), started with RANK (global rank), LOCAL_RANK
  (process slot) and WORLD_SIZE in its environment, talking to the API process over an
  inherited socketpair. The API process reaps its workers and forks nothing after start
  (CRIU restores PIDs). A worker exits when the API process goes away.
- each worker warms up for real: reads its weight shard from the model dir into memory,
  derives a digest table (CPU time proportional to the shard), closes the file, allocates a
  few MiB of "KV cache", "initialises CUDA" by registering with the simulated driver (see
  cuda_checkpoint_sim.py) and counts the warm-up in a file under TEST_ENGINE_STATE_DIR
  (default /var/lib/test-engine), so a second warm-up after a restore would show.
- the workers of one world group form a group over TCP like NCCL/Gloo's bootstrap
  (engine_group.py): local address from the interface NCCL_SOCKET_IFNAME selects (NCCL's
  syntax; else GLOO_SOCKET_IFNAME, exact names; unset: the interface whose subnet holds the
  master address, else the first non-loopback one, else lo); rank 0 listens on (local
  address, master port), the others bind their local address and connect to (master addr,
  master port), retrying every 100 ms. A world of one opens no group socket (as vLLM TP1).
  Every completion is one all-reduce across ALL ranks, run by the rank-0 worker in the unit
  that holds global rank 0 (the driver): each rank answers only while its weights match the
  digests taken at warm-up and its simulated GPU is `running`; a rank that is gone fails the
  completion at once, a silent one within TEST_ENGINE_STEP_TIMEOUT (10 s). A unit without
  rank 0 answers completions with an error naming the driver, and serves /health and
  sleep/wake for its own workers.

Surfaces (HTTP/1.1, one request per connection, always Content-Length; errors in the engine's
own error JSON):
- --api vllm: GET /health (200/503, empty body), GET /v1/models, POST /v1/completions,
  POST /v1/chat/completions (the prompt is the last user message), POST /sleep?level=1|2,
  POST /wake_up[?tags=...], GET /is_sleeping -> {"is_sleeping": bool}, and the dev-mode
  POST /collective_rpc {"method": "reload_weights"} -> {"results": [null per worker]}.
  Errors: {"error": {"message", "type", "param", "code"}}.
- --api sglang: GET /health, GET /health_generate (one tiny generation through the
  all-reduce on the driver), POST /generate {"text", "sampling_params"} -> {"text",
  "meta_info"}, GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
  POST /release_memory_occupation, POST /resume_memory_occupation ({} bodies, `null`
  answers), POST /update_weights_from_disk {"model_path"?} -> {"success", "message",
  "num_paused_requests"}. Errors: {"error": {"message"}} natively, {"object": "error",
  "message", "type", "param", "code"} on /v1.
Completion bodies may carry "full_check": true (an extra field, as vLLM accepts): every rank
then re-verifies all of its weight chunks instead of a sample.
/health is 200 only when every local worker is warm, awake, its GPU `running` and its group
connection up (rank 0: every peer connected).

Sleep (vLLM /sleep, SGLang release) closes intake (new completions get 503), waits for the
ones in flight (60 s at most), then every local worker closes ALL its group sockets (rank 0 its
listener too) and drops its KV cache; level 2 also drops the weights (the digest table
stays), unmapping their memory, so that a CRIU dump taken then holds no weight bytes. SGLang's
release drops what its "tags" name ("kv_cache", "weights"; "cuda_graph" is accepted and means
nothing here; no tags: everything). Dropped weights come back only through
reload_weights/update_weights_from_disk, which re-read the shard from the model dir (where the
controller mounts the worker's staged payload after a restore) and check every MiB against a
CRC-32 taken at warm-up (staging verified the payload's sha256 already; this only has to run at
the speed of the disk): a payload that differs is refused, and the engine stays without weights.
Wake (vLLM /wake_up, SGLang resume) first reads $COLDSNAP_RUNTIME_DIR/placement.json (default
dir /var/lib/coldsnap/runtime; format coldsnap-placement/1, written by the controller after a
restore; its unit_id must be this unit's, else the wake is refused with 400 and the engine
stays asleep): its master_addr/master_port replace the command line's and its `environment`
(NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, ...; null unsets) overrides the process environment
for choosing interfaces, since a restored process keeps its captured environment. The last
placement read is kept when a later wake finds no file. Host addresses, `port` and
`device_map` in the file are informational here. Wake then reallocates the KV cache and
rebuilds the group in the background (200 at once; /health is 503 until the group is up) and
logs one line with the master address used.

Sockets and snapshots: the HTTP listener binds --host (0.0.0.0 by default, which CRIU restores
on any host without a rewrite); every HTTP connection closes after its response; group sockets
are bound to a host's own address and exist only while awake, so a sleeping engine holds no
established TCP connection and no host-specific socket. Logging is quiet: nothing is written
while sleeping or serving; only warm-up failures, wake lines and group problems (each once).

Identity: COLDSNAP_UNIT is a JSON object
    {"unit_id": str, "devices": [uuid, ...],
     "workers": [{"id", "global_rank", "world_size", "process_slot", "device_slots": [int]}]}
Without it the engine runs one worker, rank 0 of 1, on no devices.

Shard files: <model-dir>/shard-<rank>-of-<world>.bin, a one-line JSON header followed by the
payload bytes; `engine.py make-shards` writes them.

Python 3 standard library only: it runs inside the capsule, with engine_group.py (the group),
engine_http.py (the HTTP surfaces) and cuda_checkpoint_sim.py next to it.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import mmap
import os
import random
import socket
import subprocess
import sys
import threading
import time
import zlib
from typing import Any

# The capsule runs this file through a symlink (/usr/local/bin/test-engine).
HERE = os.path.realpath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
import cuda_checkpoint_sim as gpu_sim  # noqa: E402
import engine_group  # noqa: E402
import engine_http  # noqa: E402
import io_uring_probe  # noqa: E402

SHARD_FORMAT = "coldsnap-test-shard/1"
PLACEMENT_FORMAT = "coldsnap-placement/1"
CHUNK = 1 << 20
DEFAULT_STATE_DIR = "/var/lib/test-engine"
DEFAULT_RUNTIME_DIR = "/var/lib/coldsnap/runtime"
# Chunks re-verified per completion: enough to notice lost pages, cheap at GiB scale.
SAMPLED_CHUNKS = 8
KV_CACHE_BYTES = 4 << 20
DRAIN_TIMEOUT = 60.0
CONTROL_TIMEOUT = 15.0  # sleep/wake in one worker (a group stop joins its threads)
RELOAD_TIMEOUT = 600.0
DEFAULT_PORTS = {"vllm": 8000, "sglang": 30000}
log = engine_group.log


# ---- shards and counters -----------------------------------------------------------------


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


def chunk_crcs(view: memoryview) -> list[int]:
    """A CRC-32 per MiB: what a reload checks. The payload's sha256 was verified when it was
    staged; the reload only has to notice bytes that differ from the warm-up's, at the speed
    of the disk (a real engine's reload checks nothing)."""
    return [zlib.crc32(view[i:i + CHUNK]) for i in range(0, len(view), CHUNK)]


def weight_buffer(size: int) -> mmap.mmap:
    """Anonymous memory of its own for a weight shard: freeing it unmaps it, whatever the
    allocator would have kept (a discarding sleep must really leave the process smaller)."""
    return mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE)


def free_weights(weights: mmap.mmap | None) -> None:
    if weights is None:
        return
    try:
        weights.close()
    except BufferError:
        pass  # a view is still out (a completion in flight): unmapped when it goes


def state_dir() -> str:
    return os.environ.get("TEST_ENGINE_STATE_DIR", DEFAULT_STATE_DIR)


def runtime_dir() -> str:
    return os.environ.get("COLDSNAP_RUNTIME_DIR", DEFAULT_RUNTIME_DIR)


def bump_warmup_counter(worker_id: str) -> int:
    os.makedirs(state_dir(), exist_ok=True)
    path = os.path.join(state_dir(), f"warmups-{worker_id}")
    n = read_warmup_counter(worker_id) + 1
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


def load_manifest() -> dict[str, Any]:
    raw = os.environ.get("COLDSNAP_UNIT")
    if not raw:
        return {"unit_id": "local", "devices": [], "workers": [
            {"id": "worker-0", "global_rank": 0, "world_size": 1, "process_slot": 0,
             "device_slots": []}]}
    manifest: dict[str, Any] = json.loads(raw)
    return manifest


# ---- the worker process ----------------------------------------------------------------------


class Worker:
    """One worker's warm state and its group membership (runs in the worker process)."""

    def __init__(self, ident: dict[str, Any], devices: list[str], model_dir: str,
                 rounds: int) -> None:
        self.ident = ident
        self.rank, self.world_size = int(ident["global_rank"]), int(ident["world_size"])
        self.who = f"worker {ident['id']} (rank {self.rank} of {self.world_size})"
        self.devices = [devices[s] for s in ident.get("device_slots", []) if s < len(devices)]
        self.model_dir = model_dir
        self.rounds = rounds
        self.header: dict[str, Any] = {}
        self.weights: mmap.mmap | None = None
        self.table: list[bytes] = []
        self.crcs: list[int] = []  # per chunk, what a reload is checked against
        self.root = ""
        self.kv: bytearray | None = None
        self.sleeping = False
        self.served = 0
        self.lock = threading.Lock()  # warm state
        self.group_lock = threading.Lock()  # group rebuilds
        self.group: engine_group.Group | None = None
        self.config: tuple[Any, ...] | None = None

    def read_shard(self, model_dir: str) -> tuple[str, dict[str, Any], mmap.mmap]:
        path = os.path.join(model_dir, shard_name(self.rank, self.world_size))
        # The file is closed before serving: a snapshot must not depend on the model mount.
        with open(path, "rb") as f:
            header = json.loads(f.readline())
            if header.get("format") != SHARD_FORMAT or header.get("rank") != self.rank:
                raise RuntimeError(f"{path}: not the shard of rank {self.rank}")
            size = int(header["payload_bytes"])
            weights = weight_buffer(size)
            with memoryview(weights) as view:
                got = 0
                while got < size:
                    n = f.readinto(view[got:got + (64 << 20)])
                    if not n:
                        free_weights(weights)
                        raise RuntimeError(f"{path}: truncated shard")
                    got += n
        return path, header, weights

    def warm_up(self) -> None:
        _, self.header, self.weights = self.read_shard(self.model_dir)
        size = int(self.header["payload_bytes"])
        with memoryview(self.weights) as view:
            self.crcs = chunk_crcs(view[:size])
            self.table = [chunk_digest(view[i:min(i + CHUNK, size)], self.rounds)
                          for i in range(0, size, CHUNK)]
        self.root = hashlib.sha256(b"".join(self.table)).hexdigest()
        self.kv = bytearray(b"\x5a") * KV_CACHE_BYTES
        gpu_sim.register(os.getpid(), self.devices)
        bump_warmup_counter(self.ident["id"])

    def reload(self, model_dir: str) -> dict[str, Any]:
        path, header, weights = self.read_shard(model_dir)
        with memoryview(weights) as view:
            crcs = chunk_crcs(view[:int(header["payload_bytes"])])
        if crcs != self.crcs:
            free_weights(weights)
            bad = next(i for i, (a, b) in enumerate(zip([*crcs, -1], [*self.crcs, -2]))
                       if a != b)
            raise RuntimeError(f"{path}: weights do not match the ones loaded at warm-up "
                               f"(first difference in MiB {bad})")
        with self.lock:
            old, self.header, self.weights = self.weights, header, weights
        free_weights(old)
        return {"ok": True, "bytes": len(weights)}

    def gpu_state(self) -> str:
        with gpu_sim.driver_lock():
            try:
                return str(gpu_sim.read_state(os.getpid())["state"])
            except gpu_sim.SimError:
                return "absent"

    def intact(self, weights: mmap.mmap, full: bool) -> bool:
        if hashlib.sha256(b"".join(self.table)).hexdigest() != self.root:
            return False
        n = len(self.table)
        if full:
            picks: Any = range(n)
        else:
            rng = random.Random(self.served)
            picks = sorted({rng.randrange(n) for _ in range(min(SAMPLED_CHUNKS, n))}) if n else []
        with memoryview(weights) as view:
            return all(chunk_digest(view[i * CHUNK:(i + 1) * CHUNK], self.rounds)
                       == self.table[i] for i in picks)

    def contribute(self, step: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of one all-reduce step."""
        def no(why: str) -> dict[str, Any]:
            return {"ok": False, "rank": self.rank, "error": f"{self.who}: {why}"}

        state = self.gpu_state()
        if state != "running":
            return no(f"GPU state is {state}, not running")
        with self.lock:
            if self.sleeping:
                return no("asleep")
            if self.weights is None:
                return no("weights were released by a discarding sleep; reload them from disk "
                          "(reload_weights / update_weights_from_disk)")
            if self.kv is None:
                return no("no KV cache")
            self.served += 1
            if not self.intact(self.weights, full=bool(step.get("full_check"))):
                return no("warm state damaged: weights digest mismatch")
            prompt = step.get("prompt")
            if prompt == self.header.get("prompt"):
                text = str(self.header["answer"])
            else:
                text = "echo:" + hashlib.sha256(
                    (self.root + str(prompt)).encode()).hexdigest()[:16]
        return {"ok": True, "rank": self.rank, "text": text}

    def complete(self, step: dict[str, Any]) -> dict[str, Any]:
        """Rank 0 only: the all-reduce of one completion across every rank."""
        group = self.group
        if not isinstance(group, engine_group.MasterGroup):
            return {"ok": False, "error": f"{self.who}: not rank 0, or asleep"}
        try:
            parts = group.all_reduce(step, self.contribute(step))
        except engine_group.GroupError as exc:
            return {"ok": False, "error": str(exc)}
        bad = [p.get("error") or f"rank {p.get('rank')} failed" for p in parts if not p.get("ok")]
        if bad:
            return {"ok": False, "error": "; ".join(bad)}
        texts = [p["text"] for p in parts]
        # Every shard carries the whole trained answer; other prompts get each rank's part.
        return {"ok": True, "text": texts[0] if len(set(texts)) == 1 else "/".join(texts),
                "ranks": len(parts)}

    def health(self) -> dict[str, Any]:
        group = self.group
        return {"ok": True, "sleeping": self.sleeping, "gpu_state": self.gpu_state(),
                "group_ready": group is not None and group.ready(),
                "group_problem": group.problem if group is not None else None,
                "weights_loaded": self.weights is not None}

    def sleep(self, weights: bool, kv: bool) -> dict[str, Any]:
        """Asleep: group sockets closed; `kv` drops the KV cache, `weights` the weights (their
        pages go back to the kernel, so a snapshot taken now does not hold them)."""
        with self.lock:
            self.sleeping = True
        with self.group_lock:
            if self.group is not None:
                self.group.stop()
                self.group = None
        dropped = None
        with self.lock:
            if kv:
                self.kv = None
            if weights:
                dropped, self.weights = self.weights, None
        free_weights(dropped)
        return {"ok": True}

    def wake(self, master_addr: str, master_port: int, overlay: dict[str, Any]) -> dict[str, Any]:
        env = dict(os.environ)
        for key, value in overlay.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = str(value)
        config = (master_addr, int(master_port), sorted(overlay.items()))
        with self.group_lock:
            with self.lock:
                rebuild = self.sleeping or self.group is None or config != self.config
                self.config = config
                if self.kv is None:
                    self.kv = bytearray(b"\x5a") * KV_CACHE_BYTES
                self.sleeping = False
            if rebuild:
                if self.group is not None:
                    self.group.stop()
                self.group = engine_group.make_group(
                    self.who, self.rank, self.world_size, master_addr, int(master_port), env,
                    self.contribute)
                self.group.start()
        return {"ok": True, "rebuilt": rebuild}

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "health":
            return self.health()
        if op == "complete":
            return self.complete(req.get("step") or {})
        if op == "sleep":
            return self.sleep(bool(req.get("weights")), bool(req.get("kv", True)))
        if op == "wake":
            return self.wake(req["master_addr"], req["master_port"], req.get("env") or {})
        if op == "reload":
            return self.reload(req.get("model_dir") or self.model_dir)
        return {"ok": False, "error": f"unknown op {op!r}"}


def worker_main(args: argparse.Namespace) -> int:
    chan = socket.socket(fileno=args.channel_fd)
    send_lock = threading.Lock()

    def send(obj: dict[str, Any]) -> None:
        try:
            with send_lock:
                chan.sendall(json.dumps(obj).encode() + b"\n")
        except OSError:
            pass  # the API process is gone; the read loop below ends too

    manifest = load_manifest()
    ident = next(w for w in manifest["workers"] if w["process_slot"] == args.slot)
    worker = Worker(ident, manifest.get("devices", []), args.model_dir, args.warmup_rounds)
    try:
        worker.warm_up()
    except Exception as exc:
        print(f"worker {ident['id']}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        send({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    worker.wake(args.master_addr, args.master_port, {})
    send({"ready": True, "pid": os.getpid()})

    def serve_one(req: dict[str, Any]) -> None:
        try:
            out = worker.handle(req)
        except Exception as exc:  # a worker must answer, never die on one bad request
            out = {"ok": False, "error": f"{worker.who}: {type(exc).__name__}: {exc}"}
        send({**out, "id": req.get("id")})

    for line in chan.makefile("rb"):
        threading.Thread(target=serve_one, args=(json.loads(line),), daemon=True).start()
    os._exit(0)  # the API process went away: so does this worker


# ---- the API process -------------------------------------------------------------------------


class Channel:
    """The API process's end of one worker's socketpair: concurrent calls matched by id."""

    def __init__(self, ident: dict[str, Any], sock: socket.socket,
                 proc: subprocess.Popen[bytes]) -> None:
        self.ident = ident
        self.sock = sock
        self.proc = proc
        self.reader = sock.makefile("rb")
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()
        self.pending: dict[int, list[Any]] = {}
        self.ids = itertools.count(1)
        self.gone: str | None = None

    def wait_ready(self) -> dict[str, Any]:
        line = self.reader.readline()
        if not line:
            return {"ready": False, "error": "exited during warm-up"}
        out: dict[str, Any] = json.loads(line)
        return out

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.reader:
            msg = json.loads(line)
            with self.lock:
                slot = self.pending.pop(msg.get("id"), None)
            if slot is not None:
                slot[1] = msg
                slot[0].set()
        with self.lock:
            self.gone = f"worker {self.ident['id']} (pid {self.proc.pid}) is gone"
            for slot in self.pending.values():
                slot[0].set()
            self.pending.clear()
        self.proc.wait()  # reap it

    def call(self, op: str, timeout: float, **kw: Any) -> dict[str, Any]:
        rid = next(self.ids)
        slot: list[Any] = [threading.Event(), None]
        with self.lock:
            if self.gone:
                return {"ok": False, "error": self.gone}
            self.pending[rid] = slot
        try:
            with self.send_lock:
                self.sock.sendall(json.dumps({"id": rid, "op": op, **kw}).encode() + b"\n")
        except OSError as exc:
            with self.lock:
                self.pending.pop(rid, None)
            return {"ok": False, "error": f"worker {self.ident['id']}: {exc}"}
        if not slot[0].wait(timeout):
            with self.lock:
                self.pending.pop(rid, None)
            return {"ok": False,
                    "error": f"worker {self.ident['id']} did not answer {op} within {timeout:.0f}s"}
        return slot[1] or {"ok": False, "error": self.gone}


class PlacementError(Exception):
    pass


class Engine:
    """The API process's state: intake, sleep/wake, placement, and calls into the workers."""

    def __init__(self, args: argparse.Namespace, manifest: dict[str, Any],
                 channels: list[Channel]) -> None:
        self.args = args
        self.unit_id = str(manifest.get("unit_id"))
        self.channels = channels
        self.driver = next((c for c in channels if c.ident["global_rank"] == 0), None)
        self.model_dir = args.model_dir
        self.cond = threading.Condition()
        self.sleeping = False
        self.in_flight = 0
        self.control = threading.Lock()  # one sleep/wake/reload at a time
        self.placement: dict[str, Any] | None = None
        self.placement_digest: str | None = None
        # the loopback TCP connection of --hold-undumpable
        self.undumpable: tuple[socket.socket, socket.socket] | None = None

    def call_all(self, op: str, timeout: float, **kw: Any) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{} for _ in self.channels]

        def one(i: int) -> None:
            out[i] = self.channels[i].call(op, timeout, **kw)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(self.channels))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def healthy(self) -> bool:
        with self.cond:
            if self.sleeping:
                return False
        return all(h.get("ok") and not h.get("sleeping") and h.get("gpu_state") == "running"
                   and h.get("group_ready") for h in self.call_all("health", 5.0))

    def transport(self) -> tuple[str, int, dict[str, Any]]:
        p = self.placement or {}
        return (str(p.get("master_addr") or self.args.master_addr),
                int(p.get("master_port") or self.args.master_port),
                dict(p.get("environment") or {}))

    def driver_hint(self) -> str:
        for w in (self.placement or {}).get("workers") or []:
            if w.get("global_rank") == 0:
                return f"unit {w.get('unit')} at {w.get('host_address')}"
        addr, port, _ = self.transport()
        return f"the unit that holds global rank 0 (master {addr}:{port})"

    def generate(self, prompt: str, full_check: bool = False) -> tuple[int, str]:
        """(200, text) or (status, error message)."""
        if self.driver is None:
            return 400, (f"unit {self.unit_id} holds no global rank 0 and does not serve "
                         f"completions: send them to {self.driver_hint()}")
        with self.cond:
            if self.sleeping:
                return 503, "the engine is sleeping: wake it up first"
            self.in_flight += 1
        try:
            r = self.driver.call("complete", engine_group.STEP_TIMEOUT + 5.0,
                                 step={"prompt": prompt, "full_check": full_check})
        finally:
            with self.cond:
                self.in_flight -= 1
                self.cond.notify_all()
        if not r.get("ok"):
            return 503, str(r.get("error"))
        return 200, str(r["text"])

    def sleep(self, *, weights: bool, kv: bool = True) -> tuple[int, str | None]:
        """Drain, then every worker sleeps, dropping its KV cache (`kv`) and its weights
        (`weights`)."""
        with self.control:
            with self.cond:
                was, self.sleeping = self.sleeping, True
                deadline = time.monotonic() + DRAIN_TIMEOUT
                while self.in_flight:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.sleeping = was
                        return 503, (f"{self.in_flight} requests still in flight after "
                                     f"{DRAIN_TIMEOUT:.0f}s; not sleeping")
                    self.cond.wait(left)
            bad = [r.get("error") for r in self.call_all("sleep", CONTROL_TIMEOUT, weights=weights,
                                                        kv=kv)
                   if not r.get("ok")]
            return (500, "; ".join(map(str, bad))) if bad else (200, None)

    def read_placement(self) -> str:
        path = os.path.join(runtime_dir(), "placement.json")
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return "no placement file" + (", keeping the last placement" if self.placement
                                          else "")
        except OSError as exc:
            raise PlacementError(f"{path}: {exc}") from exc
        digest = hashlib.sha256(raw).hexdigest()
        if digest == self.placement_digest:
            return f"placement {path} unchanged"
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise PlacementError(f"{path}: not JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != PLACEMENT_FORMAT:
            raise PlacementError(f"{path}: not a {PLACEMENT_FORMAT} document")
        if data.get("unit_id") not in (None, self.unit_id):
            raise PlacementError(f"{path} is for unit {data.get('unit_id')}, "
                                 f"this is unit {self.unit_id}")
        env = data.get("environment") or {}
        port = data.get("master_port")
        if not isinstance(env, dict) or not all(
                isinstance(v, (str, type(None))) for v in env.values()):
            raise PlacementError(f"{path}: environment must map names to strings")
        if port is not None and not (isinstance(port, int) and 0 < port < 65536):
            raise PlacementError(f"{path}: bad master_port {port!r}")
        self.placement, self.placement_digest = data, digest
        return f"placement {path} applied"

    def wake(self) -> tuple[int, str | None]:
        with self.control:
            try:
                note = self.read_placement()
            except PlacementError as exc:
                return 400, str(exc)
            addr, port, env = self.transport()
            bad = [r.get("error") for r in self.call_all(
                "wake", CONTROL_TIMEOUT, master_addr=addr, master_port=port, env=env)
                if not r.get("ok")]
            if bad:
                return 500, "; ".join(map(str, bad))
            with self.cond:
                self.sleeping = False
            ifname = env.get("NCCL_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME")
            log(f"unit {self.unit_id} wakes up: master {addr}:{port}, "
                f"NCCL_SOCKET_IFNAME={ifname or '(unset)'}; {note}")
            return 200, None

    def reload(self, model_dir: str | None) -> tuple[int, list[Any] | str]:
        with self.control:
            results = self.call_all("reload", RELOAD_TIMEOUT, model_dir=model_dir or self.model_dir)
            bad = [r.get("error") for r in results if not r.get("ok")]
            if bad:
                return 500, "; ".join(map(str, bad))
            if model_dir:
                self.model_dir = model_dir
            return 200, [None for _ in results]


def open_undumpable() -> tuple[socket.socket, socket.socket]:
    """An established TCP connection of this process to itself over loopback. CRIU dumps a
    connected TCP socket only when told to (--tcp-established, which coldsnapd does not pass),
    and an engine confined by its seccomp filter may still open one (a perf event fd, the
    earlier knob, is refused by the filter)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


def start_workers(args: argparse.Namespace, manifest: dict[str, Any]) -> list[Channel]:
    channels = []
    for ident in sorted(manifest["workers"], key=lambda w: w["process_slot"]):
        mine, theirs = socket.socketpair()
        env = {**os.environ, "RANK": str(ident["global_rank"]),
               "LOCAL_RANK": str(ident["process_slot"]), "WORLD_SIZE": str(ident["world_size"])}
        proc = subprocess.Popen(
            [sys.executable, HERE, "worker",
             "--channel-fd", str(theirs.fileno()), "--slot", str(ident["process_slot"]),
             "--model-dir", args.model_dir, "--warmup-rounds", str(args.warmup_rounds),
             "--master-addr", args.master_addr, "--master-port", str(args.master_port)],
            env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        theirs.close()
        channels.append(Channel(ident, mine, proc))
    return channels


def serve(args: argparse.Namespace) -> int:
    port = args.port if args.port is not None else DEFAULT_PORTS[args.api]
    # Opened before the workers start (they do not inherit it) and kept for the process's life.
    undumpable = open_undumpable() if args.hold_undumpable else None
    if args.try_io_uring:
        # Kept open for the process's life, as an event loop keeps its ring.
        ring, outcome = io_uring_probe.try_io_uring()
        print(f"io_uring: {outcome}" + (f" (fd {ring})" if ring is not None else ""),
              flush=True)
    manifest = load_manifest()
    channels = start_workers(args, manifest)
    # Workers warm up in parallel; the API opens only once all of them are ready.
    for c in channels:
        ready = c.wait_ready()
        if not ready.get("ready"):
            print(f"worker {c.ident['id']} failed to warm up: {ready.get('error')}",
                  file=sys.stderr, flush=True)
            for other in channels:
                other.proc.kill()
                other.proc.wait()
            return 1
    for c in channels:
        c.start()
    engine = Engine(args, manifest, channels)
    engine.undumpable = undumpable
    surface_cls = engine_http.VllmSurface if args.api == "vllm" else engine_http.SglangSurface
    surface = surface_cls(engine, args.served_model_name or args.model_dir)
    engine_http.Server.address_family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    server = engine_http.Server((args.host, port), engine_http.make_handler(surface))
    print(f"test engine ({args.api}) serving on {args.host}:{port}", flush=True)
    server.serve_forever()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="test-engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--api", choices=sorted(DEFAULT_PORTS), default="vllm")
    s.add_argument("--host", default="0.0.0.0")  # noqa: S104 (restorable on any host)
    s.add_argument("--port", type=int, default=None,
                   help="default 8000 for vllm, 30000 for sglang")
    s.add_argument("--model-dir", default="/models")
    s.add_argument("--served-model-name", default=None, help="default: the model dir")
    s.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR") or "127.0.0.1",
                   help="default: $MASTER_ADDR, else 127.0.0.1")
    s.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT") or 29500),
                   help="default: $MASTER_PORT, else 29500")
    s.add_argument("--warmup-rounds", type=int, default=4,
                   help="digest rounds per weight chunk: the CPU cost of warm-up")
    s.add_argument("--try-io-uring", action="store_true",
                   help="ask for an io_uring instance at start and keep it, as libuv does "
                        "(the capsule's seccomp filter answers ENOSYS)")
    s.add_argument("--hold-undumpable", action="store_true",
                   help="keep a TCP connection open so that a CRIU dump is refused (tests)")
    w = sub.add_parser("worker", help="internal: one worker process, started by serve")
    w.add_argument("--channel-fd", type=int, required=True)
    w.add_argument("--slot", type=int, required=True)
    w.add_argument("--model-dir", required=True)
    w.add_argument("--warmup-rounds", type=int, required=True)
    w.add_argument("--master-addr", required=True)
    w.add_argument("--master-port", type=int, required=True)
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
    if args.cmd == "worker":
        return worker_main(args)
    for path in make_shards(args.out, args.world_size, args.bytes, args.prompt, args.answer,
                            args.seed):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
