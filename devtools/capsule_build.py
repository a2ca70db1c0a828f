"""Build the ColdSnap test capsule image and publish it by digest on the local registry.

    scripts/build-test-capsule [--docker-host unix:///path/docker.sock] [--force]
    scripts/build-test-capsule stop-registry

Debian forky rootfs (mmdebstrap, minbase + criu 4.2.1, python3, iproute2) + the test engine
and the cuda-checkpoint SIMULATOR from deploy/test-capsule/ + the production capsule programs
from deploy/capsule/ (the quiet PID 1 and confined launcher, the in-capsule HTTP client)
-> `docker import` into one host's dockerd (default: host-0's socket from
.dev-cluster/inventory.yaml) -> `docker push` to the dev cluster's registry host, 198.18.0.254:5000
for the default network base (Debian's docker-registry in its own network namespace, started
here when it is not answering; storage under .dev-cluster/registry, pid in
.dev-cluster/registry/registry.pid; devtools/registry_host.py). The hosts reach it over the
bridge; each dockerd trusts it without TLS (`--insecure-registry`), so the cluster must be up
first (`scripts/dev-cluster up`).

Why forky: CRIU < 4.2 cannot dump any inet socket on Linux >= 6.16 (the kernel restricted
SO_PASSCRED to unix and netlink sockets; fixed in checkpoint-restore/criu pull request 2719),
and the engines serve on TCP. Debian forky ships criu 4.2.1; the mirror's forky Release files
carry an expired Valid-Until, hence Acquire::Check-Valid-Until "false".

The digest-pinned reference is printed as the last line of stdout and written to
.dev-cluster/test-capsule.ref. Inputs are hashed: when nothing changed, a rerun only checks
that the registry still serves the image and returns in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

from coldsnap.durable import publish
from devtools import capsule_tools as tools
from devtools.capsule_tools import EPOCH as EPOCH  # the tests read it here
from devtools.layout import REGISTRY_ADDR, REPO

PROG = "build-test-capsule"
STATE = Path(os.environ.get("COLDSNAP_DEV_CLUSTER_DIR", REPO / ".dev-cluster"))
SOURCES = REPO / "deploy" / "test-capsule"
CAPSULE_SOURCES = REPO / "deploy" / "capsule"
CACHE = STATE / "cache" / "test-capsule"
# The Debian base, keyed by suite and packages, outside the clone with the vLLM capsule's
# cache: `dev-cluster down --purge` (which scripts/test ends with) removes the state, and the
# next cluster then imports the base instead of running mmdebstrap again.
BASE_CACHE = Path(os.environ.get("COLDSNAP_CAPSULE_CACHE", "/var/cache/coldsnap/capsules"))
REGISTRY_DIR = STATE / "registry"

REPOSITORY = f"{REGISTRY_ADDR}/coldsnap/test-capsule"
REF_FILE = STATE / "test-capsule.ref"

SUITE = "forky"
# Release files whose Valid-Until has passed (forky's, on the configured mirror) are accepted.
APT_OPTIONS = ['Acquire::Check-Valid-Until "false"']
PACKAGES = ["criu", "python3", "iproute2"]
# name in the image -> (source file, mode): every module of deploy/test-capsule, side by side
# (the engine imports its siblings, e.g. engine_http and engine_group, from its own directory).
FILES = {
    f"opt/coldsnap-test/{src.name}": (src.name, 0o755) for src in sorted(SOURCES.glob("*.py"))
}
# name in the image -> (source file in deploy/capsule, mode): the programs every real capsule
# carries, so the test capsule starts and confines its engine as production does.
CAPSULE_FILES = {
    f"opt/coldsnap-test/{src}": (src, 0o755) for src in ("capsule_init.py", "capsule_http.py")
}
LINKS = {
    "usr/local/bin/cuda-checkpoint-sim": "/opt/coldsnap-test/cuda_checkpoint_sim.py",
    # The simulator takes the real tool's name so coldsnap runs one code path for both.
    "usr/local/bin/cuda-checkpoint": "cuda-checkpoint-sim",
    "usr/local/bin/capsule-http": "/opt/coldsnap-test/capsule_http.py",
    "usr/local/bin/capsule-init": "/opt/coldsnap-test/capsule_init.py",
    "usr/local/bin/test-engine": "/opt/coldsnap-test/engine.py",
}
DIRS = ["var/lib/cuda-sim", "var/lib/test-engine", "var/lib/coldsnap", "models"]


def log(msg: str) -> None:
    tools.log(PROG, msg)


def base_rootfs() -> Path:
    return tools.base_rootfs(BASE_CACHE, SUITE, PACKAGES, APT_OPTIONS, PROG)


def sources() -> list[tuple[str, Path, int]]:
    """(name in the image, source file, mode) of every file the build adds, by name."""
    return sorted([*((name, SOURCES / src, mode) for name, (src, mode) in FILES.items()),
                   *((name, CAPSULE_SOURCES / src, mode)
                     for name, (src, mode) in CAPSULE_FILES.items())])


def inputs_key(base: Path) -> str:
    # The shared helpers shape the image too (tar entries, import), so they are inputs as well.
    parts = [base.name.encode(), Path(__file__).read_bytes(),
             Path(tools.__file__).read_bytes()]
    for name, path, mode in sources():
        parts += [name.encode(), str(mode).encode(), path.read_bytes()]
    return tools.sha256_bytes(*parts)


def compose(base: Path, out: Path) -> None:
    tmp = out.with_suffix(".tmp")
    shutil.copyfile(base, tmp)
    with tarfile.open(tmp, "a") as tar:
        tools.add_dirs(tar, DIRS)
        for name, path, mode in sources():
            tools.add_file(tar, name, path.read_bytes(), mode)
        tools.add_links(tar, LINKS)
    publish(tmp, out)


def build(docker_host: str, force: bool) -> str:
    tools.ensure_tools(PROG)
    base = base_rootfs()
    key = inputs_key(base)
    tag = f"{REPOSITORY}:{key[:16]}"
    stamp = CACHE / "last-build.json"
    tools.ensure_registry(REGISTRY_DIR, PROG)
    recorded = None if force else tools.recorded_build(stamp, key, REPOSITORY, docker_host, tag)
    if recorded is not None:
        log("inputs unchanged; image already in the registry")
        return recorded
    rootfs = CACHE / f"capsule-{key[:16]}.tar"
    CACHE.mkdir(parents=True, exist_ok=True)
    compose(base, rootfs)
    tools.import_image(docker_host, rootfs, tag,
                       ['CMD ["/usr/local/bin/capsule-init"]',
                        "LABEL org.coldsnap.capsule=test",
                        "LABEL org.coldsnap.cuda-checkpoint=simulated",
                        # What the test engine writes besides coldsnapd's defaults: its state
                        # and the simulated driver's (the GPU simulator's seam: a real driver
                        # keeps that state in the kernel, out of the engine's reach).
                        "LABEL org.coldsnap.writable=/var/lib/cuda-sim,/var/lib/test-engine"],
                       PROG)
    rootfs.unlink()
    digest = tools.push(docker_host, tag, PROG)
    stamp.write_text(json.dumps({"key": key, "digest": digest, "tag": tag}) + "\n")
    return f"{REPOSITORY}@{digest}"


def main() -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0]
                                if __doc__ else None)
    p.add_argument("command", nargs="?", choices=["build", "stop-registry"], default="build")
    p.add_argument("--docker-host", help="unix:///path/to/docker.sock (default: host-0's)")
    p.add_argument("--force", action="store_true", help="rebuild even when inputs are unchanged")
    args = p.parse_args()
    if args.command == "stop-registry":
        return tools.stop_registry(REGISTRY_DIR, PROG)
    t0 = time.monotonic()
    ref = build(args.docker_host or tools.default_docker_host(STATE, PROG), args.force)
    tools.record_ref(REF_FILE, ref, PROG, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
