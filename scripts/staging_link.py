"""Staging at the link's speed: every coldsnapd staging path beside the raw floors of the same
bytes, to the same host, in one run, rounds alternating.

    scripts/bench staging --link [--inventory FILE] [--host NAME] [--size-mib 1024]
        [--chunk-mib 64] [--rounds 5] [--shapes chunks,file] [--paths P,...] [--floors F,...]

(`scripts/bench staging` without --link is the older put-vs-scp of one file.) One JSON line,
`"mode": "link"`, to bench-results/staging.jsonl.

The bytes: --size-mib of random data, as a set of --chunk-mib objects (the CRIU image chunk
size, `capsule.images.CHUNK_BYTES`: what staging moves for a unit's images) and, in the
`file` shape, as one object of the whole size. Each is staged through the real staging code
(`operations.staging.stage_host`, as restore calls it, the source's `in_flight` objects at
once) into a scratch data_dir on the host, with the ObjectSource of each path:

    store-openssh    StoreSource, put through the OpenSSH client (`bulk_transport: openssh`)
    store-asyncssh   StoreSource, put over the pooled asyncssh connection
    store-auto       StoreSource, the transport `auto` picks (the store's default)
    registry         RegistrySource: the host's helper pulls each blob from the dev registry
                     (plain HTTP inside the cluster) by digest: what `--stage-from auto`
                     takes for a published artifact, the default for a cold host

Each of them checks every byte's digest on the host and fsyncs before the rename. The floors
move the same bytes with nothing checked and nothing fsync'd:

    curl   `curl` run on the host (over ssh, in its network namespace) fetching the same
           blob(s) from the dev registry into its data_dir (all chunks in one curl)
    scp    `scp` of the same file(s) (all chunks in one scp)
    cat    `ssh host 'cat > FILE' < FILE` (the chunks as one stream: the same bytes)

and, beside them but not a floor (`--floors curl-sync`, on by default): `curl-sync`, the curl
floor followed by a `sync` of what it wrote, timed together: what durability costs on this
disk, which every coldsnapd path pays and the floors do not. The line also gives the hash
speeds of this CPU (`openssl speed -evp sha256`, Python's hashlib over 1 MiB pieces): every
coldsnapd path hashes each byte once on the host.

Every figure includes its own connection setup (a fresh SSH connection per run). Each round
runs every path and floor once, the order reversed every other round; the line gives the
median seconds and MB/s (10^6 bytes/s) of each, the min and max (the spread: the machine is
shared), the best floor, and `ratio` = default path's throughput / best floor's per shape
(the goal: at least 0.9).

Without --inventory it runs against the dev cluster; when that is not running it starts one
without Docker (enough hosts for --host) and stops it again at the end. The dev registry is
started when it is not answering (and stopped again when this run started it); the blobs are
pushed to it once (repository `bench/link`) and stay there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import shlex
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_common import REPO, cluster_inventory, emit, log, push_blob, sized
from bench_staging import make_source

from coldsnap.capsule.images import CHUNK_BYTES
from coldsnap.formats.artifact import ROLE_WEIGHTS, ArtifactObject, payload_path
from coldsnap.hosts.inventory import HostEntry, Inventory, load_inventory
from coldsnap.hosts.registry.access import access_for
from coldsnap.hosts.settings import SSHSettings
from coldsnap.hosts.ssh import SSHHost
from coldsnap.hosts.transfer.driver import Transport
from coldsnap.operations.sources import ObjectSource, RegistrySource, StoreSource
from coldsnap.operations.staging import stage_host
from coldsnap.store import LocalStore

PATHS = ("store-openssh", "store-asyncssh", "store-auto", "registry")
FLOORS = ("curl", "scp", "cat")
# Measured beside the floors, never the best of them: see the module docstring.
EXTRAS = ("curl-sync",)
SHAPES = ("chunks", "file")
# What restore stages from for a cold host by default: `--stage-from auto` takes the registry
# when the artifact is published (docs/operations.md, "Where staging takes the bytes from").
DEFAULT_PATH = "registry"
REPOSITORY = "bench/link"


@dataclass(frozen=True)
class Shape:
    name: str
    files: list[Path]  # in the store's objects directory, named by digest
    objects: list[ArtifactObject]


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 20):
            h.update(b)
    return "sha256:" + h.hexdigest()


def make_shapes(store: LocalStore, src: Path, chunk: int, wanted: list[str]) -> list[Shape]:
    """The source cut into `chunk`-sized objects, and whole, each in `store` under its
    digest (hard links where the bytes are the same file)."""
    store.ensure()
    shapes: list[Shape] = []
    size = src.stat().st_size
    if "chunks" in wanted:
        objs: list[ArtifactObject] = []
        files: list[Path] = []
        with open(src, "rb") as f:
            for i in range(0, size, chunk):
                data = f.read(chunk)
                digest = "sha256:" + hashlib.sha256(data).hexdigest()
                path = store.object_path(digest)
                if not path.exists():
                    tmp = path.with_suffix(".tmp")
                    tmp.write_bytes(data)
                    tmp.replace(path)
                files.append(path)
                objs.append(_object(digest, len(data), f"worker/chunk-{i // chunk}"))
        shapes.append(Shape("chunks", files, objs))
    if "file" in wanted:
        digest = _digest(src)
        path = store.object_path(digest)
        if not path.exists():
            path.hardlink_to(src)
        shapes.append(Shape("file", [path], [_object(digest, size, "worker/file")]))
    return shapes


def _object(digest: str, size: int, owner: str) -> ArtifactObject:
    # Role `weights`: staged as a CRIU chunk is (the same transfer), without the placement
    # into an image directory, which is not the link's to measure.
    return ArtifactObject(role=ROLE_WEIGHTS, owner=owner, path=payload_path(digest),
                          bytes=size, sha256=digest)


def push_blobs(registry: str, shapes: list[Shape]) -> None:
    """Every object as a blob of the bench repository (once: a blob there is kept)."""
    for shape in shapes:
        for path, obj in zip(shape.files, shape.objects, strict=True):
            if push_blob(registry, REPOSITORY, path, obj.sha256, obj.bytes):
                log(f"pushed {obj.sha256[:19]} ({obj.bytes} bytes) to {registry}/{REPOSITORY}")


def ssh_argv(entry: HostEntry) -> list[str]:
    argv = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={entry.known_hosts}"]
    if entry.identity_file:
        argv += ["-i", str(entry.identity_file)]
    return argv


def ssh(entry: HostEntry, command: str, stdin: Any = None) -> None:
    subprocess.run(["ssh", *ssh_argv(entry), "-p", str(entry.port),
                    f"{entry.user}@{entry.address}", command], stdin=stdin, check=True)


class Runner:
    def __init__(self, inventory: Inventory, entry: HostEntry, store: LocalStore,
                 registry: str) -> None:
        self.inventory = inventory
        self.entry = entry
        self.store = store
        self.registry = registry
        self.scratch = f"{entry.data_dir}/bench-link"

    def clean(self) -> None:
        ssh(self.entry, f"rm -rf -- {shlex.quote(self.scratch)}; mkdir -p -m 0700 -- "
                        f"{shlex.quote(self.scratch)}; sync")

    def path(self, kind: str, shape: Shape) -> float:
        transports: dict[str, Transport] = {"store-openssh": "openssh",
                                             "store-asyncssh": "asyncssh"}
        transport = transports.get(kind, "auto")
        source: ObjectSource = (
            RegistrySource(access_for(self.inventory, self.registry), REPOSITORY,
                           store=self.store)
            if kind == "registry" else StoreSource(self.store))

        async def go() -> float:
            t0 = time.perf_counter()
            host = SSHHost(self.entry, SSHSettings(bulk_transport=transport))
            try:
                staged = await stage_host(host, self.scratch, shape.objects, source)
            finally:
                await host.close()
            took = time.perf_counter() - t0
            if sorted(staged.sent) != sorted(o.sha256 for o in shape.objects):
                raise SystemExit(f"{kind}: staged {len(staged.sent)} of "
                                 f"{len(shape.objects)} objects")
            return took

        return asyncio.run(go())

    def floor(self, kind: str, shape: Shape) -> float:
        t0 = time.perf_counter()
        dest = self.scratch
        if kind in ("curl", "curl-sync"):
            args = []
            for obj in shape.objects:
                args += [f"http://{self.registry}/v2/{REPOSITORY}/blobs/{obj.sha256}",
                         "-o", f"{dest}/{obj.sha256[7:]}"]
            command = shlex.join(["curl", "-sSf", *args])
            ssh(self.entry, command + (f" && sync -f {shlex.quote(dest)}"
                                       if kind == "curl-sync" else ""))
        elif kind == "scp":
            subprocess.run(["scp", "-q", *ssh_argv(self.entry), "-P", str(self.entry.port),
                            *map(str, shape.files),
                            f"{self.entry.user}@{self.entry.address}:{dest}/"], check=True)
        else:
            # The chunks are the same bytes as the whole file: one stream of them.
            with subprocess.Popen(["cat", *map(str, shape.files)],
                                  stdout=subprocess.PIPE) as cat:
                ssh(self.entry, f"cat > {shlex.quote(dest + '/cat.bin')}", stdin=cat.stdout)
        return time.perf_counter() - t0


def run_rounds(args: argparse.Namespace, runner: Runner,
               shapes: list[Shape]) -> dict[str, dict[str, list[float]]]:
    times: dict[str, dict[str, list[float]]] = {s.name: {} for s in shapes}
    kinds = [*args.paths, *args.floors, *args.extras]
    for r in range(args.rounds):
        order = kinds if r % 2 == 0 else kinds[::-1]
        for shape in shapes:
            for kind in order:
                runner.clean()
                measure: Callable[[str, Shape], float] = (
                    runner.path if kind in PATHS else runner.floor)
                t = measure(kind, shape)
                times[shape.name].setdefault(kind, []).append(t)
                mb = sum(o.bytes for o in shape.objects) / t / 1e6
                log(f"round {r + 1}/{args.rounds} {shape.name:<6} {kind:<15} {t:6.2f} s "
                    f"({mb:6.0f} MB/s)")
    runner.clean()
    ssh(runner.entry, f"rm -rf -- {shlex.quote(runner.scratch)}")
    return times


def summary(size: int, samples: dict[str, list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, ts in samples.items():
        med = statistics.median(ts)
        out[kind] = {"seconds": round(med, 3), "mb_s": round(size / med / 1e6, 1),
                     "min_s": round(min(ts), 3), "max_s": round(max(ts), 3),
                     "samples": [round(t, 3) for t in ts]}
    return out


def hash_speeds() -> dict[str, float | None]:
    """SHA-256 on this CPU, MB/s: OpenSSL's (what Python's hashlib calls) and hashlib's
    through Python, 1 MiB pieces."""
    piece = bytes(1 << 20)
    h = hashlib.sha256()
    n = sized(512, 8)
    t0 = time.perf_counter()
    for _ in range(n):
        h.update(piece)
    py = n * len(piece) / (time.perf_counter() - t0) / 1e6
    openssl: float | None = None
    out = subprocess.run(["openssl", "speed", "-evp", "sha256", "-bytes", str(len(piece)),
                          "-seconds", "1"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        if line.startswith("sha256") and line.split()[-1].endswith("k"):
            openssl = float(line.split()[-1][:-1]) * 1000 / 1e6
    return {"openssl": None if openssl is None else round(openssl, 1),
            "hashlib": round(py, 1)}


def names(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    got = [v for v in value.split(",") if v]
    bad = [v for v in got if v not in allowed]
    if bad:
        raise SystemExit(f"scripts/bench staging --link: {flag}: unknown {', '.join(bad)} "
                         f"(choose from {', '.join(allowed)})")
    return got


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="scripts/bench staging --link", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inventory", type=Path,
                    help="hosts to use as they are (default: the dev cluster)")
    ap.add_argument("--host", default="host-0")
    ap.add_argument("--size-mib", type=int, default=sized(1024, 8))
    ap.add_argument("--chunk-mib", type=int, default=sized(CHUNK_BYTES >> 20, 2))
    ap.add_argument("--rounds", type=int, default=sized(5, 1))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--floors", default=",".join((*FLOORS, *EXTRAS)))
    args = ap.parse_args(argv)
    if args.size_mib <= 0 or args.chunk_mib <= 0 or args.rounds <= 0:
        ap.error("--size-mib, --chunk-mib and --rounds must be positive")
    shapes_wanted = names(args.shapes, SHAPES, "--shapes")
    args.paths = names(args.paths, PATHS, "--paths")
    floors = names(args.floors, (*FLOORS, *EXTRAS), "--floors")
    args.floors = [f for f in floors if f in FLOORS]
    args.extras = [f for f in floors if f in EXTRAS]
    size = args.size_mib << 20

    src = make_source(size)
    store = LocalStore(REPO / ".cache" / "bench" / "link-store")
    shapes = make_shapes(store, src, args.chunk_mib << 20, shapes_wanted)
    with cluster_inventory(args.inventory, [args.host], docker=False) as path:
        inventory = load_inventory(path)
        registry = inventory.registry or next(
            (r for r, s in inventory.registries.items() if s.insecure), None)
        if not registry:
            raise SystemExit("scripts/bench staging --link: the inventory names no plain-HTTP "
                             "registry")
        with dev_registry(args.inventory is None):
            push_blobs(registry, shapes)
            runner = Runner(inventory, inventory.get(args.host), store, registry)
            times = run_rounds(args, runner, shapes)

    doc: dict[str, Any] = {"mode": "link", "host": args.host, "bytes": size,
                           "chunk_bytes": args.chunk_mib << 20, "rounds": args.rounds,
                           "default_path": DEFAULT_PATH}
    for shape in shapes:
        figures = summary(size, times[shape.name])
        floors = {k: v for k, v in figures.items() if k in FLOORS}
        best = min(floors, key=lambda k: floors[k]["seconds"]) if floors else None
        entry: dict[str, Any] = {"objects": len(shape.objects), **figures}
        if best is not None:
            entry["best_floor"] = best
            if DEFAULT_PATH in figures:
                entry["ratio"] = round(figures[DEFAULT_PATH]["mb_s"] / floors[best]["mb_s"], 3)
        doc[shape.name] = entry
    doc["target_ratio_min"] = 0.9
    doc["sha256_mb_s"] = hash_speeds()
    emit("staging", doc)


@contextlib.contextmanager
def dev_registry(dev: bool) -> Iterator[None]:
    """The dev cluster's plain registry answering for the run; started (and stopped after)
    when it is not, for a run on the dev cluster."""
    from devtools import capsule_tools
    from devtools.layout import Layout

    state = Layout.from_env().state / "registry"
    started = dev and not capsule_tools.registry_up()
    if started:
        capsule_tools.ensure_registry(state, "bench staging")
    try:
        yield
    finally:
        if started:
            capsule_tools.stop_registry(state, "bench staging")
