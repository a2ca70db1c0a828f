#!/usr/bin/env python3
"""ColdSnap test engine: a small stand-in for vLLM/SGLang inside the test capsule.

    engine.py serve [--api vllm|sglang] [--host 0.0.0.0] [--port P] --model-dir D
                    [--served-model-name NAME] [--master-addr A] [--master-port P2]
                    [--disaggregation-mode null|prefill|decode]
                    [--disaggregation-bootstrap-port P3]
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
- every other group the request declares (tensor, pipeline, expert, context... any kind whose
  name part is not `world`; COLDSNAP_UNIT's `groups`) is formed the same way
  (engine_groups.py): its first member listens on its host's address (COLDSNAP_UNIT's
  `peers`, else the placement's `workers`) at master port + 1 + the group's index among its
  service's non-world groups; every completion's step is run across each of them by its
  leader, so a member that cannot reach one of its groups fails the completion. /health
  needs every group up.
- SGLang prefill/decode (--disaggregation-mode): a prefill also serves its HTTP surface on
  --disaggregation-bootstrap-port (default 8998); a decode sends every completion's prompt
  to the head of the service whose role is `*:prefill` there first (its address from the
  identity or placement, as the groups'), so a decode that cannot reach its prefill answers
  503 naming it.

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
With --api-key KEY (or, for --api vllm, VLLM_API_KEY in the environment), every path but the
probes and metrics (/health, /health_generate, /metrics, /load, /ping, /version) answers 401
{"error": "Unauthorized"} without `Authorization: Bearer KEY`, as recent vLLM does.
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

Python 3 standard library only: it runs inside the capsule, with its modules next to it:
engine_api.py (the API process: intake, sleep/wake, placement, calls into the workers),
engine_worker.py (a worker process), engine_state.py (shards, weight memory, counters, the
unit's identity), engine_group.py (the group), engine_http.py (the HTTP surfaces),
io_uring_probe.py and cuda_checkpoint_sim.py.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
from typing import Any

# The capsule runs this file through a symlink (/usr/local/bin/test-engine).
HERE = os.path.realpath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
import engine_http  # noqa: E402
import io_uring_probe  # noqa: E402
from engine_api import Channel, Engine  # noqa: E402
from engine_state import load_manifest, make_shards  # noqa: E402
from engine_worker import worker_main  # noqa: E402

DEFAULT_PORTS = {"vllm": 8000, "sglang": 30000}


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


def read_cache(cache_dir: str, name: str) -> dict[str, Any]:
    """{"path", "content"} of the cache file (content None when there is none)."""
    path = os.path.join(cache_dir, name)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            content: str | None = f.read(4096)
    except OSError:
        content = None
    return {"path": path, "content": content}


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
    # Read once at start, as a compiler cache is: what a seeded runtime cache held then is
    # what the engine reports for its life (and, restored, for its snapshot's).
    cache_seen = read_cache(args.cache_dir, args.cache_file)
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
    engine.cache_seen = cache_seen
    surface_cls = engine_http.VllmSurface if args.api == "vllm" else engine_http.SglangSurface
    surface = surface_cls(engine, args.served_model_name or args.model_dir)
    engine_http.Server.address_family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    # Like vLLM: --api-key, else VLLM_API_KEY in the environment (the vLLM surface only).
    api_key = args.api_key or (os.environ.get("VLLM_API_KEY") if args.api == "vllm" else None)
    server = engine_http.Server((args.host, port),
                                engine_http.make_handler(surface, api_key or None))
    if args.disaggregation_mode == "prefill":
        # SGLang's prefill serves its decode peers on a bootstrap port besides --port.
        bootstrap = engine_http.Server((args.host, args.disaggregation_bootstrap_port),
                                       engine_http.make_handler(surface, api_key or None))
        threading.Thread(target=bootstrap.serve_forever, name="bootstrap", daemon=True).start()
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
    s.add_argument("--api-key", default=None,
                   help="answer 401 without `Authorization: Bearer KEY` (probes excepted)")
    s.add_argument("--served-model-name", default=None, help="default: the model dir")
    s.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR") or "127.0.0.1",
                   help="default: $MASTER_ADDR, else 127.0.0.1")
    s.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT") or 29500),
                   help="default: $MASTER_PORT, else 29500")
    s.add_argument("--disaggregation-mode", choices=("null", "prefill", "decode"),
                   default="null",
                   help="SGLang prefill/decode: a prefill serves --disaggregation-bootstrap-port "
                        "too; a decode sends every completion's prompt there first")
    s.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    s.add_argument("--warmup-rounds", type=int, default=4,
                   help="digest rounds per weight chunk: the CPU cost of warm-up")
    s.add_argument("--try-io-uring", action="store_true",
                   help="ask for an io_uring instance at start and keep it, as libuv does "
                        "(the capsule's seccomp filter answers ENOSYS)")
    s.add_argument("--cache-dir", default="/var/cache/coldsnap/runtime",
                   help="the runtime cache whose --cache-file is read at start and reported "
                        "at GET /coldsnap-test/cache")
    s.add_argument("--cache-file", default="seed.txt")
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
