"""A worker process of the ColdSnap test engine (`engine.py worker`, exec'd by the API
process): its warm state (weights, digests, KV cache, simulated GPU), its part of the group's
all-reduce, sleep, wake and reload, answering the API process over an inherited socketpair.

Python 3 standard library only: it runs inside the capsule.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import random
import socket
import sys
import threading
from typing import Any

import cuda_checkpoint_sim as gpu_sim
import engine_group
import engine_groups
from engine_state import (
    CHUNK,
    SHARD_FORMAT,
    bump_warmup_counter,
    chunk_crcs,
    chunk_digest,
    free_weights,
    load_manifest,
    shard_name,
    weight_buffer,
)

# Chunks re-verified per completion: enough to notice lost pages, cheap at GiB scale.
SAMPLED_CHUNKS = 8
KV_CACHE_BYTES = 4 << 20


class Worker:
    """One worker's warm state and its group membership (runs in the worker process)."""

    def __init__(self, ident: dict[str, Any], devices: list[str], model_dir: str,
                 rounds: int, extra: list[engine_groups.Membership] | None = None) -> None:
        self.ident = ident
        # Its groups beyond the world group (tensor, pipeline, expert...): each formed over
        # TCP like the world group, and crossed by every completion.
        self.extra = list(extra or [])
        self.subgroups: dict[str, engine_group.Group] = {}
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
            # The sentinels differ: a shorter list ends in a difference (the lengths may).
            bad = next(i for i, (a, b) in enumerate(zip([*crcs, -1], [*self.crcs, -2],
                                                        strict=False)) if a != b)
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
        """This rank's part of one world all-reduce step: its own part, and the step run
        across each of its other groups (as the leader), or its connection to them checked,
        so that a member that cannot reach one of its groups cannot answer."""
        own = self.own_part(step)
        if not own.get("ok"):
            return own
        for m in self.extra:
            group = self.subgroups.get(m.group)
            if group is None:
                return {"ok": False, "rank": self.rank,
                        "error": f"{m.who(self.ident['id'])}: the group is not formed"}
            if isinstance(group, engine_group.MasterGroup):
                try:
                    parts = group.all_reduce({**step, "group": m.group}, own,
                                             engine_group.STEP_TIMEOUT * 0.8)
                except engine_group.GroupError as exc:
                    return {"ok": False, "rank": self.rank,
                            "error": f"group {m.group} ({m.kind}): {exc}"}
                bad = [p.get("error") for p in parts if not p.get("ok")]
                if bad:
                    return {"ok": False, "rank": self.rank,
                            "error": f"group {m.group} ({m.kind}): " + "; ".join(map(str, bad))}
            elif not group.ready():
                return {"ok": False, "rank": self.rank,
                        "error": f"{m.who(self.ident['id'])}: not connected to its leader "
                                 f"{group.master} ({group.problem or 'connecting'})"}
        return own

    def own_part(self, step: dict[str, Any]) -> dict[str, Any]:
        """This rank's own part of a step: its warm state checked, its answer."""
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
        groups = [group, *(self.subgroups.get(m.group) for m in self.extra)]
        down = [g for g in groups if g is None or not g.ready()]
        return {"ok": True, "sleeping": self.sleeping, "gpu_state": self.gpu_state(),
                "group_ready": not down,
                "group_problem": next((g.problem for g in down if g is not None), None),
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
            self._stop_subgroups()
        dropped = None
        with self.lock:
            if kv:
                self.kv = None
            if weights:
                dropped, self.weights = self.weights, None
        free_weights(dropped)
        return {"ok": True}

    def _stop_subgroups(self) -> None:
        # caller holds group_lock
        for g in self.subgroups.values():
            g.stop()
        self.subgroups = {}

    def wake(self, master_addr: str, master_port: int, overlay: dict[str, Any],
             peers: dict[str, str] | None = None) -> dict[str, Any]:
        """Awake: the world group and every other group rebuilt when asleep or when the
        placement changed. `peers`: worker id -> its host's address, where each group's
        leader listens."""
        env = dict(os.environ)
        for key, value in overlay.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = str(value)
        peers = dict(peers or {})
        config = (master_addr, int(master_port), sorted(overlay.items()), sorted(peers.items()))
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
                self._stop_subgroups()
                for m in self.extra:
                    leader = peers.get(m.leader)
                    if leader is None:
                        return {"ok": False, "error": f"{m.who(self.ident['id'])}: the address "
                                                      f"of its leader {m.leader} is unknown"}
                    g = engine_group.make_group(m.who(self.ident["id"]), m.rank, m.size, leader,
                                                m.port(int(master_port)), env, self.own_part)
                    g.start()
                    self.subgroups[m.group] = g
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
            return self.wake(req["master_addr"], req["master_port"], req.get("env") or {},
                             req.get("peers") or {})
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
    worker = Worker(ident, manifest.get("devices", []), args.model_dir, args.warmup_rounds,
                    engine_groups.memberships(manifest, str(ident["id"])))
    try:
        worker.warm_up()
    except Exception as exc:
        print(f"worker {ident['id']}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        send({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    worker.wake(args.master_addr, args.master_port, {},
                engine_groups.addresses(manifest, None))
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
