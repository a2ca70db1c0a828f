"""State of the ColdSnap test engine: weight shards on disk, weight memory and its digests,
warm-up counters, and the unit's identity (COLDSNAP_UNIT).

Python 3 standard library only: it runs inside the capsule.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import random
import zlib
from typing import Any

SHARD_FORMAT = "coldsnap-test-shard/1"
CHUNK = 1 << 20
DEFAULT_STATE_DIR = "/var/lib/test-engine"


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
    # A view still out (a completion in flight) keeps it mapped: unmapped when it goes.
    with contextlib.suppress(BufferError):
        weights.close()


def state_dir() -> str:
    return os.environ.get("TEST_ENGINE_STATE_DIR", DEFAULT_STATE_DIR)


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
