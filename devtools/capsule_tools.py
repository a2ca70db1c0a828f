"""What every capsule build on the dev machines shares: the Debian base rootfs (mmdebstrap),
rootfs tarball entries with a fixed mtime, the dev cluster's local OCI registry, and
`docker import` + `docker push` to it.

Used by devtools/capsule_build.py (the test capsule) and devtools/vllm_capsule.py (a real
vLLM-CPU capsule). Every function takes the caller's program name (`prog`) for its messages.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

import yaml

# The cache that other runs and clones trust must never hold half a tarball after a crash:
# the file and its rename are synced (coldsnap's own publish, stdlib only).
from coldsnap.durable import publish
from devtools import procs, registry_host
from devtools.layout import REGISTRY_ADDR, RegistryNet, current_net_base

# Fixed mtime of every entry a build adds: the same inputs give the same layer, hence the same
# image digest.
EPOCH = 1_700_000_000


def log(prog: str, msg: str) -> None:
    print(f"{prog}: {msg}", file=sys.stderr, flush=True)


def run(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
        stdout: int | TextIO | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=True, text=True, env=env, stdout=stdout)


def sha256_bytes(*parts: bytes) -> str:
    """The sha256 of the parts' own sha256s: a boundary between parts cannot move unnoticed."""
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()


def ensure_tools(prog: str) -> None:
    missing = [pkg for tool, pkg in (("mmdebstrap", "mmdebstrap"),
                                     ("docker-registry", "docker-registry"))
               if shutil.which(tool) is None]
    if missing:
        log(prog, f"installing {' '.join(missing)}")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run(["apt-get", "update", "-q"], env=env, stdout=sys.stderr)
        run(["apt-get", "install", "-y", "-q", *missing], env=env, stdout=sys.stderr)


def default_docker_host(state: Path, prog: str) -> str:
    """unix://<host-0's docker_socket> from the dev cluster's inventory."""
    inv = state / "inventory.yaml"
    if not inv.exists():
        raise SystemExit(f"{prog}: {inv} missing: run scripts/dev-cluster up, "
                         "or pass --docker-host")
    data = yaml.safe_load(inv.read_text())
    for h in data.get("hosts", []):
        if h.get("name") == "host-0" and h.get("docker_socket"):
            return f"unix://{h['docker_socket']}"
    raise SystemExit(f"{prog}: host-0 has no docker_socket in {inv}")


def record_ref(ref_file: Path, ref: str, prog: str, started: float) -> None:
    """A build's end: its digest-pinned reference written where scripts/dev-requests and the
    tests read it, and printed as the last line of stdout."""
    ref_file.parent.mkdir(parents=True, exist_ok=True)
    ref_file.write_text(ref + "\n")
    log(prog, f"done in {time.monotonic() - started:.1f}s")
    print(ref)


def base_rootfs(cache: Path, suite: str, packages: Sequence[str], apt_options: Sequence[str],
                prog: str) -> Path:
    """A minbase Debian `suite` with `packages`, as a tarball cached under `cache` (the name
    carries a hash of suite and packages)."""
    key = sha256_bytes(suite.encode(), " ".join(packages).encode(), b"minbase")[:16]
    path = cache / f"base-{suite}-{key}.tar"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    # Its own name per builder: the cache is shared by every clone on the machine.
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tar.tmp")
    log(prog, f"mmdebstrap {suite} (minbase + {', '.join(packages)}) -> {path.name}")
    # The machine's configured Debian mirror is used; no mirror address is written here.
    # --format=tar: mmdebstrap guesses the format from the name, and ".tmp" is no tarball name.
    run(["mmdebstrap", "--variant=minbase", "--format=tar",
         *(f"--aptopt={opt}" for opt in apt_options),
         f"--include={','.join(packages)}", suite, str(tmp)], stdout=sys.stderr)
    publish(tmp, path)
    return path


def add_dirs(tar: tarfile.TarFile, dirs: Sequence[str]) -> None:
    for d in dirs:
        ti = tarfile.TarInfo(f"./{d}")
        ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, EPOCH
        tar.addfile(ti)


def add_file(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    ti = tarfile.TarInfo(f"./{name}")
    ti.size, ti.mode, ti.mtime = len(data), mode, EPOCH
    tar.addfile(ti, io.BytesIO(data))


def add_links(tar: tarfile.TarFile, links: Mapping[str, str]) -> None:
    for name, target in sorted(links.items()):
        ti = tarfile.TarInfo(f"./{name}")
        ti.type, ti.linkname, ti.mode, ti.mtime = tarfile.SYMTYPE, target, 0o777, EPOCH
        tar.addfile(ti)


def normalized(ti: tarfile.TarInfo) -> tarfile.TarInfo:
    """A `tar.add` filter: owned by root, fixed mtime, 0755 or 0644 (as the x bit says)."""
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    ti.mtime = EPOCH
    if ti.isdir() or (ti.isfile() and ti.mode & 0o111):
        ti.mode = 0o755
    elif ti.isfile():
        ti.mode = 0o644
    return ti


def registry_up() -> bool:
    try:
        with urllib.request.urlopen(f"http://{REGISTRY_ADDR}/v2/", timeout=2) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def ensure_registry(registry_dir: Path, prog: str) -> None:
    """The plain registry on the dev cluster's registry host (devtools/registry_host.py, which
    `scripts/dev-cluster up` makes), started in its namespace when it is not answering."""
    if registry_up():
        return
    reg = RegistryNet(current_net_base())
    log(prog, f"starting docker-registry on {reg.plain} (storage {registry_dir / 'data'})")
    try:
        registry_host.ensure_plain(reg, registry_dir)
    except registry_host.RegistryError as exc:
        raise SystemExit(f"{prog}: {exc}") from None


def stop_registry(registry_dir: Path, prog: str) -> int:
    """The plain registry stopped (the registry host stays: `dev-cluster down` removes it)."""
    pid = procs.pid_alive(registry_dir / "registry.pid")
    if pid is None:
        log(prog, "no registry running; nothing to stop")
        (registry_dir / "registry.pid").unlink(missing_ok=True)
        return 0
    procs.terminate([pid], grace=5)
    (registry_dir / "registry.pid").unlink(missing_ok=True)
    log(prog, f"registry (pid {pid}) stopped")
    return 0


def registry_has(repository: str, digest: str) -> bool:
    """Whether the local registry serves `digest` under `repository` (`ADDR/name/...`)."""
    name = repository.removeprefix(f"{REGISTRY_ADDR}/")
    req = urllib.request.Request(
        f"http://{REGISTRY_ADDR}/v2/{name}/manifests/{digest}", method="HEAD",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:  # noqa: S310  (http, a fixed address)
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def recorded_build(stamp: Path, key: str, repository: str, docker_host: str,
                   tag: str) -> str | None:
    """The image that the last build recorded in `stamp` pushed, when it was built from this
    same `key` and the registry still has it (pulled onto `docker_host` if that engine lacks
    it); None when the image must be built."""
    if not stamp.exists():
        return None
    last = json.loads(stamp.read_text())
    if last.get("key") != key or not registry_has(repository, last["digest"]):
        return None
    if not image_present(docker_host, tag):
        docker(docker_host, "pull", f"{repository}@{last['digest']}")
    return f"{repository}@{last['digest']}"


def docker(docker_host: str, *args: str, capture: bool = False) -> str:
    out = run(["docker", "-H", docker_host, *args],
              stdout=subprocess.PIPE if capture else sys.stderr)
    return out.stdout or ""


def image_present(docker_host: str, ref: str) -> bool:
    r = subprocess.run(["docker", "-H", docker_host, "image", "inspect", ref],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return r.returncode == 0


def import_image(docker_host: str, rootfs: Path, tag: str, changes: Sequence[str],
                 prog: str) -> None:
    """`docker import` with Dockerfile `changes` (CMD, LABEL, ...)."""
    log(prog, f"docker import -> {tag}")
    docker(docker_host, "import", *(a for c in changes for a in ("--change", c)),
           str(rootfs), tag)


def push(docker_host: str, tag: str, prog: str) -> str:
    """`docker push`; the digest it printed."""
    out = docker(docker_host, "push", tag, capture=True)
    digest = ""
    for line in out.splitlines():
        if "digest: sha256:" in line:
            digest = line.split("digest: ", 1)[1].split()[0]
    if not digest:
        raise SystemExit(f"{prog}: no digest in push output:\n{out}")
    return digest
