"""The API process of the ColdSnap test engine: intake, sleep/wake, the placement file, and
calls into the workers over their socketpairs (one Channel per worker). The HTTP surfaces
(engine_http.py) call into the Engine here.

Python 3 standard library only: it runs inside the capsule.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import socket
import subprocess
import threading
import time
from typing import Any

import engine_group
import engine_groups

PLACEMENT_FORMAT = "coldsnap-placement/1"
DEFAULT_RUNTIME_DIR = "/var/lib/coldsnap/runtime"
DRAIN_TIMEOUT = 60.0
CONTROL_TIMEOUT = 15.0  # sleep/wake in one worker (a group stop joins its threads)
RELOAD_TIMEOUT = 600.0
log = engine_group.log


def runtime_dir() -> str:
    return os.environ.get("COLDSNAP_RUNTIME_DIR", DEFAULT_RUNTIME_DIR)


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
        self.manifest = manifest
        # SGLang prefill/decode: a decode engine's completions need the prefill service.
        self.prefill = (engine_groups.prefill_head(manifest)
                        if getattr(args, "disaggregation_mode", None) == "decode" else None)
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
        # What the runtime cache held at start (engine.read_cache).
        self.cache_seen: dict[str, Any] = {}

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
            if self.prefill is not None:
                status, why = self.prefilled(prompt)
                if status != 200:
                    return status, why
            r = self.driver.call("complete", engine_group.STEP_TIMEOUT + 5.0,
                                 step={"prompt": prompt, "full_check": full_check})
        finally:
            with self.cond:
                self.in_flight -= 1
                self.cond.notify_all()
        if not r.get("ok"):
            return 503, str(r.get("error"))
        return 200, str(r["text"])

    def prefilled(self, prompt: str) -> tuple[int, str]:
        """A decode engine's prefill step: the prompt sent to the prefill service's head at
        its bootstrap port (where its host is now: the placement's, else the identity's), as
        SGLang's router pairs a prefill with every decode request. (200, "") or an error."""
        addr = engine_groups.addresses(self.manifest, self.placement).get(str(self.prefill))
        port = int(self.args.disaggregation_bootstrap_port)
        if addr is None:
            return 503, f"the address of the prefill service's head {self.prefill} is unknown"
        where = f"prefill {self.prefill} at {addr}:{port}"
        deadline = time.monotonic() + engine_group.STEP_TIMEOUT
        while True:
            try:
                status, body = engine_groups.post_json(addr, port, "/generate", {
                    "text": prompt, "sampling_params": {"max_new_tokens": 1}},
                    engine_group.STEP_TIMEOUT)
                if status == 200:
                    return 200, ""
                why = f"{where} answered {status}: {body[:300]!r}"
            except (OSError, ValueError) as exc:
                why = f"{where} cannot be reached: {exc}"
            # A prefill still forming its groups after a wake answers 503 for a moment.
            if time.monotonic() > deadline:
                return 503, f"the decode service cannot prefill: {why}"
            time.sleep(0.2)

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
            peers = engine_groups.addresses(self.manifest, self.placement)
            bad = [r.get("error") for r in self.call_all(
                "wake", CONTROL_TIMEOUT, master_addr=addr, master_port=port, env=env,
                peers=peers) if not r.get("ok")]
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
