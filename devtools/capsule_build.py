"""Build the ColdSnap test capsule image and publish it by digest on the local registry.

    scripts/build-test-capsule [--docker-host unix:///path/docker.sock] [--force]
    scripts/build-test-capsule stop-registry

Debian forky rootfs (mmdebstrap, minbase + criu 4.2.1, python3, iproute2) + the test engine,
the cuda-checkpoint SIMULATOR, the in-capsule HTTP client and the quiet PID-1 shim from
deploy/test-capsule/ -> `docker import` into one host's dockerd (default: host-0's socket from
.dev-cluster/inventory.yaml) -> `docker push` to the registry on the dev cluster's bridge,
198.18.0.1:5000 (Debian's docker-registry, started here when it is not answering; storage under
.dev-cluster/registry, pid in .dev-cluster/registry/registry.pid). The hosts live in their own
network namespaces and reach the registry over the bridge; each dockerd trusts it without TLS
(`--insecure-registry`), so the bridge must exist first (`scripts/dev-cluster up`).

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
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TextIO

import yaml

from devtools.layout import BRIDGE, REGISTRY_ADDR, REPO

STATE = Path(os.environ.get("COLDSNAP_DEV_CLUSTER_DIR", REPO / ".dev-cluster"))
SOURCES = REPO / "deploy" / "test-capsule"
CACHE = STATE / "cache" / "test-capsule"
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
LINKS = {
    "usr/local/bin/cuda-checkpoint-sim": "/opt/coldsnap-test/cuda_checkpoint_sim.py",
    # The simulator takes the real tool's name so coldsnap runs one code path for both.
    "usr/local/bin/cuda-checkpoint": "cuda-checkpoint-sim",
    "usr/local/bin/capsule-http": "/opt/coldsnap-test/capsule_http.py",
    "usr/local/bin/capsule-init": "/opt/coldsnap-test/capsule_init.py",
    "usr/local/bin/test-engine": "/opt/coldsnap-test/engine.py",
}
DIRS = ["var/lib/cuda-sim", "var/lib/test-engine", "var/lib/coldsnap", "models"]
# Fixed mtime: the same inputs give the same layer, hence the same image digest.
EPOCH = 1_700_000_000


def log(msg: str) -> None:
    print(f"build-test-capsule: {msg}", file=sys.stderr, flush=True)


def run(argv: list[str], *, env: dict[str, str] | None = None,
        stdout: int | TextIO | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=True, text=True, env=env, stdout=stdout)


def ensure_tools() -> None:
    missing = [pkg for tool, pkg in (("mmdebstrap", "mmdebstrap"),
                                     ("docker-registry", "docker-registry"))
               if shutil.which(tool) is None]
    if missing:
        log(f"installing {' '.join(missing)}")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run(["apt-get", "update", "-q"], env=env, stdout=sys.stderr)
        run(["apt-get", "install", "-y", "-q", *missing], env=env, stdout=sys.stderr)


def default_docker_host() -> str:
    inv = STATE / "inventory.yaml"
    if not inv.exists():
        raise SystemExit(f"build-test-capsule: {inv} missing: run scripts/dev-cluster up, "
                         "or pass --docker-host")
    data = yaml.safe_load(inv.read_text())
    for h in data.get("hosts", []):
        if h.get("name") == "host-0" and h.get("docker_socket"):
            return f"unix://{h['docker_socket']}"
    raise SystemExit(f"build-test-capsule: host-0 has no docker_socket in {inv}")


def sha256_bytes(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()


def base_rootfs() -> Path:
    key = sha256_bytes(SUITE.encode(), " ".join(PACKAGES).encode(), b"minbase")[:16]
    path = CACHE / f"base-{SUITE}-{key}.tar"
    if path.exists():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tar.tmp")
    if tmp.is_dir():
        shutil.rmtree(tmp)  # an interrupted earlier run
    log(f"mmdebstrap {SUITE} (minbase + {', '.join(PACKAGES)}) -> {path.name}")
    # The machine's configured Debian mirror is used; no mirror address is written here.
    # --format=tar: mmdebstrap guesses the format from the name, and ".tmp" is no tarball name.
    run(["mmdebstrap", "--variant=minbase", "--format=tar",
         *(f"--aptopt={opt}" for opt in APT_OPTIONS),
         f"--include={','.join(PACKAGES)}", SUITE, str(tmp)], stdout=sys.stderr)
    os.replace(tmp, path)
    return path


def inputs_key(base: Path) -> str:
    parts = [base.name.encode(), Path(__file__).read_bytes()]
    for name, (src, mode) in sorted(FILES.items()):
        parts += [name.encode(), str(mode).encode(), (SOURCES / src).read_bytes()]
    return sha256_bytes(*parts)


def compose(base: Path, out: Path) -> None:
    tmp = out.with_suffix(".tmp")
    shutil.copyfile(base, tmp)
    with tarfile.open(tmp, "a") as tar:
        for d in DIRS:
            ti = tarfile.TarInfo(f"./{d}")
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, EPOCH
            tar.addfile(ti)
        for name, (src, mode) in sorted(FILES.items()):
            data = (SOURCES / src).read_bytes()
            ti = tarfile.TarInfo(f"./{name}")
            ti.size, ti.mode, ti.mtime = len(data), mode, EPOCH
            tar.addfile(ti, io.BytesIO(data))
        for name, target in sorted(LINKS.items()):
            ti = tarfile.TarInfo(f"./{name}")
            ti.type, ti.linkname, ti.mode, ti.mtime = tarfile.SYMTYPE, target, 0o777, EPOCH
            tar.addfile(ti)
    os.replace(tmp, out)


def registry_up() -> bool:
    try:
        with urllib.request.urlopen(f"http://{REGISTRY_ADDR}/v2/", timeout=2) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def ensure_registry() -> None:
    if registry_up():
        return
    host = REGISTRY_ADDR.rsplit(":", 1)[0]
    addrs = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", BRIDGE],
                           capture_output=True, text=True, check=False).stdout
    if f" {host}/" not in addrs:
        raise SystemExit(f"build-test-capsule: the registry listens on {host}, the address of "
                         f"the dev cluster's bridge {BRIDGE}, which does not exist: run "
                         "scripts/dev-cluster up first")
    (REGISTRY_DIR / "data").mkdir(parents=True, exist_ok=True)
    config = REGISTRY_DIR / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: warn\n"
        "storage:\n  filesystem:\n"
        f"    rootdirectory: {REGISTRY_DIR / 'data'}\n"
        "  delete:\n    enabled: true\n"
        f"http:\n  addr: {REGISTRY_ADDR}\n"
    )
    log(f"starting docker-registry on {REGISTRY_ADDR} (storage {REGISTRY_DIR / 'data'})")
    with open(REGISTRY_DIR / "registry.log", "ab") as logf:
        proc = subprocess.Popen(["docker-registry", "serve", str(config)],
                                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                start_new_session=True)
    (REGISTRY_DIR / "registry.pid").write_text(f"{proc.pid}\n")
    for _ in range(100):
        if registry_up():
            return
        if proc.poll() is not None:
            raise SystemExit(f"build-test-capsule: docker-registry exited; see "
                             f"{REGISTRY_DIR / 'registry.log'}")
        time.sleep(0.1)
    raise SystemExit("build-test-capsule: docker-registry did not answer")


def stop_registry() -> int:
    pidfile = REGISTRY_DIR / "registry.pid"
    if not pidfile.exists():
        log("no registry pidfile; nothing to stop")
        return 0
    pid = int(pidfile.read_text().strip())
    try:
        os.kill(pid, signal.SIGTERM)
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.1)
    except ProcessLookupError:
        pass
    pidfile.unlink(missing_ok=True)
    log(f"registry (pid {pid}) stopped")
    return 0


def registry_has(digest: str) -> bool:
    req = urllib.request.Request(
        f"http://{REGISTRY_ADDR}/v2/coldsnap/test-capsule/manifests/{digest}", method="HEAD",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:  # noqa: S310  (http, a fixed address)
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def docker(docker_host: str, *args: str, capture: bool = False) -> str:
    out = run(["docker", "-H", docker_host, *args],
              stdout=subprocess.PIPE if capture else sys.stderr)
    return out.stdout or ""


def image_present(docker_host: str, ref: str) -> bool:
    r = subprocess.run(["docker", "-H", docker_host, "image", "inspect", ref],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return r.returncode == 0


def build(docker_host: str, force: bool) -> str:
    ensure_tools()
    base = base_rootfs()
    key = inputs_key(base)
    tag = f"{REPOSITORY}:{key[:16]}"
    stamp = CACHE / "last-build.json"
    ensure_registry()
    if not force and stamp.exists():
        last = json.loads(stamp.read_text())
        if last.get("key") == key and registry_has(last["digest"]):
            if not image_present(docker_host, tag):
                docker(docker_host, "pull", f"{REPOSITORY}@{last['digest']}")
            log("inputs unchanged; image already in the registry")
            return f"{REPOSITORY}@{last['digest']}"
    rootfs = CACHE / f"capsule-{key[:16]}.tar"
    compose(base, rootfs)
    log(f"docker import -> {tag}")
    docker(docker_host, "import",
           "--change", 'CMD ["/usr/local/bin/capsule-init"]',
           "--change", "LABEL org.coldsnap.capsule=test",
           "--change", "LABEL org.coldsnap.cuda-checkpoint=simulated",
           str(rootfs), tag)
    rootfs.unlink()
    out = docker(docker_host, "push", tag, capture=True)
    digest = ""
    for line in out.splitlines():
        if "digest: sha256:" in line:
            digest = line.split("digest: ", 1)[1].split()[0]
    if not digest:
        raise SystemExit(f"build-test-capsule: no digest in push output:\n{out}")
    stamp.write_text(json.dumps({"key": key, "digest": digest, "tag": tag}) + "\n")
    return f"{REPOSITORY}@{digest}"


def main() -> int:
    p = argparse.ArgumentParser(prog="build-test-capsule", description=__doc__.split("\n\n")[0]
                                if __doc__ else None)
    p.add_argument("command", nargs="?", choices=["build", "stop-registry"], default="build")
    p.add_argument("--docker-host", help="unix:///path/to/docker.sock (default: host-0's)")
    p.add_argument("--force", action="store_true", help="rebuild even when inputs are unchanged")
    args = p.parse_args()
    if args.command == "stop-registry":
        return stop_registry()
    t0 = time.monotonic()
    ref = build(args.docker_host or default_docker_host(), args.force)
    STATE.mkdir(parents=True, exist_ok=True)
    REF_FILE.write_text(ref + "\n")
    log(f"done in {time.monotonic() - t0:.1f}s")
    print(ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
