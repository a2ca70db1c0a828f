"""coldsnap's vLLM plugin: the KV cache's pages given back before a CRIU dump, on the CPU.

Installed by the vLLM-CPU capsule's builder as a `vllm.general_plugins` entry point, which vLLM
loads in every process it starts. On the CPU vLLM has no sleep mode: its KV cache
(VLLM_CPU_KVCACHE_SPACE) is one anonymous allocation that CRIU would dump byte for byte, data
or zeros. After coldsnapd drained the engine it runs, inside the unit's own container,

    /usr/bin/python3 -I -m coldsnap_vllm_plugin release

which asks the engine core, through a directory only the container's own processes see
(REQUESTS; no network route, so no other engine on the host can ask it, and vLLM's dev-mode
routes stay off), to release its KV cache. The engine core does it in its own busy loop,
between two steps, so nothing runs on the cache meanwhile: it refuses while any request is
running or waiting, resets its prefix cache (no cached block may point into memory that is
gone), and has every worker (vLLM's collective_rpc, which reaches the workers of every node)
hand its KV cache's pages back with madvise(MADV_DONTNEED). The mapping stays, so every
tensor view of it stays valid; the next touch of a page gets a fresh zero page. CRIU dumps
only the pages a mapping has, so none of these are in the images. A drained engine with an
empty prefix cache never reads a KV block before writing it (vLLM's CPU runner zeroes every
block it hands out), so the engine answers exactly as before, captured or restored.

The answer, one JSON line on stdout: {"kv_bytes": N, "released_bytes": M, "workers": W}
(`kv_bytes` advised, `released_bytes` of them in memory just before: what the images do not
hold), or {"error": "..."} with exit status 1.

Python standard library only, besides vLLM and torch inside the engine's processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import mmap
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

METHOD = "coldsnap_release_kv_cache"
MADV_DONTNEED = 4  # <sys/mman.h> on Linux (every architecture vLLM's CPU build runs on)
PAGE = mmap.PAGESIZE
# Inside the container, in a path only it holds (a volume of its own, archived with its
# snapshot): a request is a file named `<nonce>.request`, the answer `<nonce>.answer`.
REQUESTS = "/var/lib/coldsnap/vllm-kv"
POLL_S = 0.1
# The request type the engine core's loop is handed (vLLM's are EngineCoreRequestType bytes).
_REQUEST_TYPE = "coldsnap-release-kv"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.mincore.restype = ctypes.c_int


# --- in each worker: the pages themselves -----------------------------------------------------

def _tensors(value: Any) -> Iterable[Any]:
    """Every tensor in a layer's or runner's KV cache (a tensor, or lists of them; never
    asked for its truth: a tensor of many values has none)."""
    if value is None:
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif hasattr(value, "untyped_storage"):
        yield value


def _os_error(call: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{METHOD}: {call}: {os.strerror(err)}")


def _resident(start: int, length: int) -> int:
    """Bytes of [start, start + length) that are in memory now (mincore)."""
    vec = (ctypes.c_ubyte * (length // PAGE))()
    if _libc.mincore(start, length, vec) != 0:
        raise _os_error("mincore")
    return sum(1 for b in vec if b & 1) * PAGE


def release_tensors(tensors: Iterable[Any]) -> dict[str, int]:
    """Discard the pages of every distinct storage behind `tensors` (CPU memory only), only
    whole pages inside each storage: `kv_bytes` is what was advised, `released_bytes` what of
    it was in memory just before."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.device.type != "cpu":
            raise RuntimeError(f"{METHOD}: a KV cache tensor is on {storage.device}, not the "
                               "CPU; on a GPU, vLLM's sleep drops the KV cache")
        if storage.nbytes():
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    advised = released = 0
    for ptr, nbytes in sorted(seen.items()):
        # A page shared with a neighbouring allocation is kept.
        start = -(-ptr // PAGE) * PAGE
        end = (ptr + nbytes) // PAGE * PAGE
        if end <= start:
            continue
        released += _resident(start, end - start)
        if _libc.madvise(start, end - start, MADV_DONTNEED) != 0:
            raise _os_error("madvise(MADV_DONTNEED)")
        advised += end - start
    return {"kv_bytes": advised, "released_bytes": released, "storages": len(seen)}


def _kv_tensors(worker: Any) -> list[Any]:
    """The worker's KV cache tensors: the model runner's list and every attention layer's
    `kv_cache` (vLLM binds views of one allocation to both)."""
    found: list[Any] = []
    runner = getattr(worker, "model_runner", None)
    found += _tensors(getattr(runner, "kv_caches", None))
    config = getattr(worker, "vllm_config", None)
    context = getattr(getattr(config, "compilation_config", None),
                      "static_forward_context", None)
    for layer in (context or {}).values():
        found += _tensors(getattr(layer, "kv_cache", None))
    return found


def _release_kv_cache(self: Any) -> dict[str, int]:
    """The workers' collective_rpc method: `self` is vLLM's WorkerWrapperBase."""
    tensors = _kv_tensors(getattr(self, "worker", self))
    if not tensors:
        raise RuntimeError(f"{METHOD}: the worker holds no KV cache tensor")
    return release_tensors(tensors)


# --- in the engine core: the request, handled in its own loop ------------------------------

def release_in_loop(core: Any) -> dict[str, Any]:
    """Run by the engine core's busy loop, between steps: refused while requests are there."""
    if core.scheduler.has_requests():
        return {"error": "the engine still has requests running or waiting; drain it first"}
    if not core.reset_prefix_cache():
        return {"error": "vLLM could not reset its prefix cache (a request holds KV blocks)"}
    results = core.collective_rpc(METHOD)
    return {"kv_bytes": sum(int(r["kv_bytes"]) for r in results),
            "released_bytes": sum(int(r["released_bytes"]) for r in results),
            "workers": len(results)}


def _answer(path: str, doc: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def _serve(core: Any, handed: Callable[[str], None]) -> None:
    """The engine core's listener thread: a request file is claimed (renamed, so that one
    engine core takes it), handed to the busy loop, and answered with what the loop did."""
    # Made by the engine, so that it may rename and remove what the exec writes there.
    os.makedirs(REQUESTS, exist_ok=True)
    while True:
        time.sleep(POLL_S)
        try:
            names = sorted(n for n in os.listdir(REQUESTS) if n.endswith(".request"))
        except FileNotFoundError:
            continue
        for name in names:
            nonce = name.removesuffix(".request")
            claimed = os.path.join(REQUESTS, f"{nonce}.claimed")
            try:
                os.rename(os.path.join(REQUESTS, name), claimed)
            except FileNotFoundError:
                continue
            handed(nonce)
            try:
                doc = _LOOP_ANSWERS.get(timeout=600)
            except queue.Empty:
                doc = {"error": "the engine core's loop did not take the request in 600 s"}
            _answer(os.path.join(REQUESTS, f"{nonce}.answer"), doc)
            os.unlink(claimed)


_LOOP_ANSWERS: queue.Queue[dict[str, Any]] = queue.Queue()


def _patch_engine_core() -> None:
    from vllm.v1.engine.core import EngineCoreProc  # type: ignore[import-not-found]

    if getattr(EngineCoreProc, "_coldsnap_patched", False):
        return
    handle = EngineCoreProc._handle_client_request
    busy_loop = EngineCoreProc.run_busy_loop

    def _handle_client_request(self: Any, request_type: Any, request: Any) -> None:
        if request_type == _REQUEST_TYPE:
            try:
                doc = release_in_loop(self)
            except Exception as exc:  # answered to coldsnapd, never fatal to the engine
                doc = {"error": f"{type(exc).__name__}: {exc}"}
            _LOOP_ANSWERS.put(doc)
            return
        handle(self, request_type, request)

    def run_busy_loop(self: Any) -> Any:
        threading.Thread(target=_serve, name="coldsnap-kv", daemon=True,
                         args=(self, lambda n: self.input_queue.put((_REQUEST_TYPE, n)))
                         ).start()
        return busy_loop(self)

    EngineCoreProc._handle_client_request = _handle_client_request
    EngineCoreProc.run_busy_loop = run_busy_loop
    EngineCoreProc._coldsnap_patched = True


def register() -> None:
    """The entry point: vLLM calls it in every process it starts, maybe more than once."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase  # type: ignore[import-not-found]

    if not hasattr(WorkerWrapperBase, METHOD):
        setattr(WorkerWrapperBase, METHOD, _release_kv_cache)
    _patch_engine_core()


# --- coldsnapd's side, run by `docker exec` in the unit's container ---------------------------

def request_release(timeout_s: float) -> dict[str, Any]:
    """Ask the engine core and wait for its answer. This runs with the container's
    capabilities in a directory the engine can write: every name is opened relative to the
    directory itself, opened without following a link, and none is followed."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(REQUESTS, 0o700)
    d = os.open(REQUESTS, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        nonce = f"{os.getpid()}-{time.time_ns()}"
        os.close(os.open(f"{nonce}.request", os.O_WRONLY | os.O_CREAT | os.O_EXCL
                         | os.O_NOFOLLOW, 0o600, dir_fd=d))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fd = os.open(f"{nonce}.answer", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=d)
                break
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                with contextlib.suppress(FileNotFoundError):  # not claimed: taken back
                    os.unlink(f"{nonce}.request", dir_fd=d)
                return {"error": f"no answer from the engine core in {timeout_s:.0f} s (is "
                                 "the coldsnap plugin loaded, and the engine serving?)"}
            time.sleep(POLL_S / 2)
        with os.fdopen(fd) as f:
            text = f.read(1 << 16)
        os.unlink(f"{nonce}.answer", dir_fd=d)
    finally:
        os.close(d)
    try:
        doc = json.loads(text)
    except ValueError:
        return {"error": f"the engine core answered {text[:200]!r}"}
    return doc if isinstance(doc, dict) else {"error": f"the engine core answered {doc!r}"}


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[0] != "release":
        print("usage: python3 -I -m coldsnap_vllm_plugin release [TIMEOUT_S]", file=sys.stderr)
        return 2
    doc = request_release(float(argv[1]) if len(argv) == 2 else 120.0)
    print(json.dumps(doc))
    return 1 if "error" in doc else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
