"""What the capsule layer needs to know about one launch unit, placed on one host.

A unit's mounts and its validation prompt are the request's own models (`Mount`, `Validation`
from `coldsnap.formats.request`); the rest is resolved for the host the unit runs on.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from coldsnap.engines import adapter_for
from coldsnap.formats.capsule import CapsuleManifest
from coldsnap.formats.request.launch import Mount
from coldsnap.formats.request.models import Validation
from coldsnap.formats.request.mount_targets import CAPSULE_LOG_DIR
from coldsnap.formats.request.mount_targets import CAPSULE_STATE_DIR as CAPSULE_STATE_DIR
from coldsnap.hosts.base import Host

# Exactly what in-capsule CRIU needs, and no more (no --privileged):
#   SYS_ADMIN, SYS_PTRACE: dump/restore of the process tree; SYS_TIME: restore writes the
#   time-namespace offsets; NET_ADMIN: socket and netns state; DAC_READ_SEARCH: open files by
#   handle and read /proc of other tasks.
# Only CRIU, cuda-checkpoint and the helpers coldsnapd runs through `docker exec` hold them: the
# engine tree is started with an empty bounding set, no-new-privs and its own seccomp filter
# (ENGINE_LAUNCHER, coldsnap/capsule/seccomp.py).
CRIU_CAPABILITIES: tuple[str, ...] = (
    "SYS_ADMIN",
    "SYS_PTRACE",
    "SYS_TIME",
    "NET_ADMIN",
    "DAC_READ_SEARCH",
)
# No Docker-level seccomp filter: Docker would put it on CRIU too, and the kernel refuses to
# let a filtered tracer suspend a filtered task's seccomp (PTRACE_O_SUSPEND_SECCOMP), which
# CRIU needs to dump the engine. The engine gets its filter from the launcher instead.
# Docker's masked and read-only /proc paths stay as Docker sets them.
CRIU_SECURITY_OPT: tuple[str, ...] = (
    "seccomp=unconfined",
    "apparmor=unconfined",
)
# Starts the engine confined (deploy/capsule/capsule_init.py, copied into every capsule):
# `launch --pid-floor N --stdin F --log F --seccomp-filter B64 -- ARGV...` prints its PID.
ENGINE_LAUNCHER: tuple[str, ...] = ("/usr/local/bin/capsule-init", "launch")

# Paths inside the capsule. They live in the container's rootfs, so a commit carries them,
# except the CRIU images: a host directory is mounted there (coldsnap.capsule.images).
# (CAPSULE_STATE_DIR and the engine log's directory are defined with the mount-target rule,
# which keeps every request mount off them: coldsnap.formats.request.mount_targets.)
CRIU_IMAGES_DIR = f"{CAPSULE_STATE_DIR}/images"
# CRIU's logs and the lazy-pages socket: never in the images directory, which a restore
# mounts read-only; removed before a commit.
CRIU_WORK_DIR = f"{CAPSULE_STATE_DIR}/criu-work"
# The unit's runtime directory: where the controller hands the engine what only it knows, such
# as the placement after a restore (CRIU brings back the captured argv and environment).
RUNTIME_DIR = f"{CAPSULE_STATE_DIR}/runtime"
PLACEMENT_FILE = "placement.json"
RUNTIME_DIR_ENV = "COLDSNAP_RUNTIME_DIR"
ENGINE_STDIN = f"{CAPSULE_STATE_DIR}/engine.stdin"
ENGINE_LOG = f"{CAPSULE_LOG_DIR}/engine.log"
# CRIU refuses to reopen a file whose mode differs from the one it dumped. ENGINE_LOG may be a
# file of the rootfs, the host's workload.log_path mounted over it, or the empty mount point
# that a commit leaves of that mount (Docker makes it 0755), so the engine log always gets
# this mode before the engine starts and before it is restored.
ENGINE_LOG_MODE = "0644"
# The engine tree is started above this PID so that the helpers a fresh container runs at
# restore (criu itself, docker exec'd tools) never hold a PID the tree needs. The launcher
# gets there by starting short-lived threads (/proc/sys/kernel/ns_last_pid stays read-only).
ENGINE_PID_FLOOR = 9999

# The capsule's rootfs is read-only (Docker's ReadonlyRootfs): the engine, root in its container
# but without a capability, cannot replace anything that coldsnapd runs there with capabilities
# (criu, cuda-checkpoint, sh, capsule-init and the libraries they load all live in the rootfs).
# It writes only these paths, each an anonymous volume of the container that Docker fills with
# the image's own content first: coldsnapd's (CAPSULE_STATE_DIR, the engine log's directory),
# WRITABLE_DEFAULT, and what the capsule image declares writable beside them
# (`org.coldsnap.writable=/var/lib/engine,/srv/cache`). A commit carries no volume: each path
# is archived into the image set while the tree is frozen (WRITABLE_IMAGE) and put back
# before every CRIU restore, as /dev/shm is.
LABEL_WRITABLE = "org.coldsnap.writable"
WRITABLE_DEFAULT: tuple[str, ...] = ("/root", "/tmp", "/var/tmp")  # noqa: S108 (container)
WRITABLE_OWN: tuple[str, ...] = (CAPSULE_STATE_DIR, posixpath.dirname(ENGINE_LOG))
_NOT_WRITABLE = ("/", "/proc", "/sys", "/dev", "/usr", "/bin", "/sbin", "/lib", "/lib64",
                 "/etc", "/var", "/var/lib")


def writable_paths(labels: Mapping[str, str]) -> tuple[str, ...]:
    """The paths an engine writes in its container, from its image's labels: sorted, a path
    inside another one left out (it is in that one's volume). ValueError names a declared
    path that is not clean and absolute, or one that would make a program directory
    writable."""
    declared = [p.strip() for p in (labels.get(LABEL_WRITABLE) or "").split(",") if p.strip()]
    for path in declared:
        bad = (not path.startswith("/") or posixpath.normpath(path) != path
               or any(path == n or (n not in ("/", "/var", "/var/lib") and _within(path, n))
                      for n in _NOT_WRITABLE))
        if bad:
            raise ValueError(f"{LABEL_WRITABLE}: {path!r} cannot be made writable (a clean "
                             "absolute path outside /proc, /sys, /dev, /etc and the program "
                             "directories)")
    paths = sorted({*WRITABLE_OWN, *WRITABLE_DEFAULT, *declared})
    return tuple(p for p in paths if not any(q != p and _within(p, q) for q in paths))


def writable_image(path: str) -> str:
    """The file of a unit's image set that holds writable `path` as the dump left it."""
    return "rootfs" + path.replace("/", "-") + ".tar"


# The tmpfs of the unit's container that CRIU does not put in its images: it reopens the files
# an engine maps from /dev/shm (vLLM's shared-memory message queues, POSIX semaphores) by
# path. Their content is captured into this file of the image set, with the tree frozen, and
# put back, exactly, before every CRIU restore (coldsnap.capsule.criu_dump / .criu_restore).
SHM_DIR = "/dev/shm"  # noqa: S108 (inside the container, not a temp file)
SHM_IMAGE = "tmpfs-dev-shm.tar"
# Docker's default /dev/shm is 64 MiB; vLLM's CPU build alone maps about 420 MB there. A
# tmpfs size is a ceiling, not a reservation: pages count only once written.
SHM_SIZE_BYTES = 8 << 30
# The label of a capsule image built for the CPU (`org.coldsnap.accelerator=cpu`): its engine
# holds no GPU, so its workers are its engine processes, cuda-checkpoint has nothing to do,
# and its quiesce is a drain (vLLM's sleep mode does nothing on CPU).
LABEL_ACCELERATOR = "org.coldsnap.accelerator"

# What every `docker exec` coldsnapd runs with the container's capabilities starts from: an
# EMPTY environment plus these values alone (and the exec's own, e.g. CRIU's action script),
# never the container's (the request's `environment`: a CRIU_LIBS_DIR, a CRIU_CONFIG_FILE, a
# PATH or a preload). Docker merges an exec's environment over the container's and cannot
# drop a name, so the exec is `EXEC_ENV -i K=V... PROGRAM ...` (CapsuleSession.exec). HOME is
# a path that does not exist in any capsule and cannot be made (the rootfs is read-only):
# no ~/.criu/default.conf, no ~/.local user site. PATH lists read-only rootfs directories,
# which no mount may cover (coldsnap.formats.request.mount_targets); every exec names its
# program by absolute path anyway. The launcher gives the engine the container's
# environment back (--environ-from).
TRUSTED_EXEC_ENV: Mapping[str, str] = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/nonexistent",
}
EXEC_ENV = "/usr/bin/env"
# Blanked in Docker's own exec environment, over the container's: what the dynamic loader
# and libc read (glibc's list of variables unsafe for a setuid program) while EXEC_ENV
# itself starts, before it clears the environment for the program it runs; an empty value
# means unset for each. LD_SHOW_AUXV and LD_DYNAMIC_WEAK act when merely present, so they
# cannot be blanked: a request naming them changes only how EXEC_ENV starts (a listing on
# its unit's exec output), nothing of what runs after it.
LOADER_ENV: tuple[str, ...] = (
    "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LD_AUDIT", "LD_BIND_NOT",
    "LD_BIND_NOW", "LD_DEBUG", "LD_DEBUG_OUTPUT", "LD_LIBRARY_PATH", "LD_ORIGIN_PATH",
    "LD_PRELOAD", "LD_PROFILE", "LD_PROFILE_OUTPUT", "LD_USE_LOAD_BIAS", "LOCALDOMAIN",
    "LOCPATH", "MALLOC_TRACE", "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS",
    "TMPDIR", "TZDIR",
)
# The programs coldsnapd runs with the capabilities, by absolute path in the read-only rootfs
# of every capsule (Debian's and Ubuntu's places; deploy/capsule installs criu there too).
SH = "/bin/sh"
# -I: no PYTHON* variable, no user site, no script or working directory on sys.path.
PYTHON: tuple[str, ...] = ("/usr/bin/python3", "-I")
# --no-default-config: neither /etc/criu/default.conf nor ~/.criu/default.conf (and with the
# empty environment, no CRIU_CONFIG_FILE nor CRIU_LIBS_DIR: its plugins come only from its
# compiled-in directory in the rootfs). Written into shell scripts as is.
CRIU = "/usr/sbin/criu --no-default-config"

MANIFEST_ENV = "COLDSNAP_UNIT"
SIMULATED_GPUS_ENV = "COLDSNAP_SIMULATED_GPUS"

_NAME_BAD = re.compile(r"[^a-z0-9_.-]+")


def docker_name(text: str) -> str:
    """A string usable in container names, repositories and tags."""
    cleaned = _NAME_BAD.sub("-", text.lower()).strip("-.")
    return cleaned[:100] or "x"


def docker_tag(text: str) -> str:
    """An OCI tag that names `text` alone: its Docker-safe form (lowercased, cut) for the
    reader, and a digest of the exact text, so that ids differing only in case or past the
    cut (`Model-A`, `model-a`) never share a tag and one's rollback never deletes the
    other's image."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{docker_name(text)[:100]}-{digest}"


def container_name(unit_id: str, role: str, suffix: str, cluster_id: str | None = None) -> str:
    """`coldsnap-[<cluster id>-]<unit>-<role>-<suffix>`, each part sanitized for Docker and
    cut so that a long cluster or unit id cannot make the name unwieldy."""
    parts = [docker_name(cluster_id)[:48]] if cluster_id else []
    parts += [docker_name(unit_id)[:48], docker_name(role), docker_name(suffix)]
    return "-".join(["coldsnap", *(p.strip("-.") or "x" for p in parts)])


def _within(path: str, root: str) -> bool:
    root = root.rstrip("/") or "/"
    return path == root or path.startswith(root + "/") or root == "/"


def host_path_for(mounts: Sequence[Mount], container_path: str) -> str | None:
    """Where a path inside the capsule lies on the host, through the unit's bind mounts (the
    deepest mount wins). A path that `..` would take outside its mount maps to nothing."""
    if not container_path.startswith("/"):
        return None
    path = posixpath.normpath(container_path)
    best: Mount | None = None
    for m in mounts:
        target = posixpath.normpath(m.target)
        if _within(path, target) and (best is None or len(target) > len(best.target)):
            best = m
    if best is None:
        return None
    rel = posixpath.relpath(path, posixpath.normpath(best.target))
    source = posixpath.normpath(best.source)
    out = posixpath.normpath(posixpath.join(source, rel))
    return out if _within(out, source) else None


def container_path_for(mounts: Sequence[Mount], host_path: str) -> str | None:
    """Where a host file appears inside the unit's container, through its bind mounts."""
    path = posixpath.normpath(host_path)
    best: Mount | None = None
    for m in mounts:
        source = posixpath.normpath(m.source)
        if _within(path, source) and (
                best is None or len(source) > len(posixpath.normpath(best.source))):
            best = m
    if best is None:
        return None
    rel = posixpath.relpath(path, posixpath.normpath(best.source))
    return posixpath.normpath(posixpath.join(best.target, rel))


@dataclass(frozen=True)
class WorkerSpec:
    id: str
    global_rank: int
    world_size: int
    process_slot: int
    device_slots: tuple[int, ...]
    # Host path of the worker's weight payload, located from the request (mounts and
    # policy.weights.native), never from a path the engine reports. None: not known.
    payload_path: str | None = None
    # What the request says that payload is, for a staged one: (the field that says it,
    # bytes, "sha256:<hex>"); collect compares it with what it hashes on the host.
    payload_expected: tuple[str, int, str] | None = None


@dataclass(frozen=True)
class UnitSpec:
    """One launch unit as placed on one host. `devices` are that host's GPU UUIDs, by slot."""

    unit_id: str
    image: str
    image_digest: str
    command: tuple[str, ...]
    devices: tuple[str, ...]
    workers: tuple[WorkerSpec, ...]
    validation: Validation
    environment: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    # `launch.engine`: selects the adapter that speaks the engine's public HTTP surface.
    engine: str = "vllm"
    # The host's address: units share their host's network, so the engine serves there and
    # the controller reaches it from the host itself (coldsnap.hosts.http).
    address: str = "127.0.0.1"
    # Quiesce releases the weights too, so that no snapshot holds them: they come back on
    # resume through the engine's reload call, from its model directory, where the worker's
    # payload lies (a capture: the request's mounts; a restore: its staged payload).
    release_weights: bool = False
    # policy.weights.mode 'native': the weights must leave the snapshot, so an engine that
    # cannot release them (a CPU build) is refused rather than captured with them.
    must_release_weights: bool = False
    # Quiesce drops the KV cache: policy.process.kv_discard, unless the engine cannot keep it
    # where it runs (vLLM's sleep on a GPU; see `kv_discard_asked`).
    discard_kv: bool = True
    # policy.process.kv_discard itself: `discard_kv` is decided again once the capsule says
    # the engine runs on the CPU (coldsnap.capsule.containers.with_accelerator).
    kv_discard_asked: bool = True
    # "nvidia": a Docker device request for exactly these UUIDs. "simulated": devices go only
    # into the environment (test capsule, cuda-checkpoint simulator), chosen only for the
    # inventory's `simulated` hosts (coldsnap.operations.units).
    gpu_mode: Literal["simulated", "nvidia"] = "nvidia"
    init_command: tuple[str, ...] = ("/usr/local/bin/capsule-init",)
    launcher: tuple[str, ...] = ENGINE_LAUNCHER
    # Set on every container of the unit, e.g. the operation that started it, so that a
    # rollback also finds a container whose creation was still in flight when it failed.
    labels: Mapping[str, str] = field(default_factory=dict)
    # The workload's cluster id (request `workload.cluster_id`): leads the container names, so
    # that its manager finds them with `docker ps` as it finds the containers it starts itself.
    cluster_id: str | None = None
    # Host file that receives the engine's output (request `workload.log_path`).
    log_path: str | None = None
    # The request's groups and services, and every worker's host address at launch
    # (`execution_view`): in the unit's identity, so that an engine forms every group it
    # belongs to and finds the services it depends on. A restore hands it the new addresses
    # in the placement file (coldsnap.operations.network.placement_documents).
    execution: Mapping[str, Any] = field(default_factory=dict)
    # The roots the host's realpath of each mount source, and of the log path, must stay
    # under (the service's policy: mounts.allow, log_paths.allow; coldsnap.capsule.host_paths).
    # None: unrestricted.
    mount_roots: tuple[str, ...] | None = None
    log_roots: tuple[str, ...] | None = None
    # What the engine computes on, from its capsule image's LABEL_ACCELERATOR ("gpu" when the
    # label is absent). A "cpu" engine is drained, not put to sleep, keeps its weights in its
    # CRIU images, and has no GPU state to checkpoint.
    accelerator: Literal["gpu", "cpu"] = "gpu"
    # A capture's policy.cache.paths: each is writable (a volume, like WRITABLE_DEFAULT), so
    # the snapshot carries what the engine compiled there, and the capsule declares them
    # writable (LABEL_WRITABLE) for every restore.
    cache_paths: tuple[str, ...] = ()
    # The unit's policy.cache.staged entry (its field, and the host directory): copied into
    # cache_paths[0] before the engine starts (coldsnap.capsule.cache_seed).
    cache_seed: tuple[str, str] | None = None

    @property
    def drains(self) -> bool:
        """Whether quiesce drains the engine instead of putting it to sleep: an engine on the
        CPU has no sleep mode (vLLM answers /sleep but logs that it ignores it)."""
        return self.accelerator == "cpu"

    def container_mounts(self) -> tuple[Mount, ...]:
        """The unit's mounts plus, with `log_path`, that host file over ENGINE_LOG.

        The file itself is mounted, not its directory: the engine's stdout and stderr stay
        open on ENGINE_LOG across a snapshot, and CRIU reopens them by that path in the
        restored container, so the container path must not depend on the log_path of the
        capture (a restore may name another file, or none)."""
        if self.log_path is None:
            return self.mounts
        return (*self.mounts, Mount(source=self.log_path, target=ENGINE_LOG))

    def manifest(self, devices: Sequence[str] | None = None) -> dict[str, Any]:
        return {
            "unit_id": self.unit_id,
            "devices": list(self.devices if devices is None else devices),
            "workers": [
                {
                    "id": w.id,
                    "global_rank": w.global_rank,
                    "world_size": w.world_size,
                    "process_slot": w.process_slot,
                    "device_slots": list(w.device_slots),
                }
                for w in sorted(self.workers, key=lambda w: w.process_slot)
            ],
            **self.execution,
        }

    def container_environment(self, devices: Sequence[str] | None = None) -> dict[str, str]:
        devs = list(self.devices if devices is None else devices)
        env = dict(self.environment)
        env[MANIFEST_ENV] = json.dumps(self.manifest(devs), sort_keys=True)
        env[RUNTIME_DIR_ENV] = RUNTIME_DIR
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(devs)
        if self.gpu_mode == "simulated":
            env[SIMULATED_GPUS_ENV] = ",".join(devs)
        return env


@dataclass(frozen=True)
class CapsuleHost:
    """A host as the capsule layer uses it: transport, its Docker socket and its data dir."""

    host: Host
    docker_socket: str  # path of dockerd's unix socket on that host
    data_dir: str  # coldsnap's directory on that host

    @property
    def name(self) -> str:
        return self.host.name


def spec_as_captured(spec: UnitSpec, meta: CapsuleManifest) -> UnitSpec:
    """The unit as its capture left it, for whatever brings its snapshot back: quiesced the
    way the manifest says (its engine is woken, or not, accordingly) on the accelerator its
    capsule was built for."""
    return replace(spec, release_weights=meta.weights_released, discard_kv=meta.kv_discarded,
                   accelerator=meta.accelerator)


def on_cpu(spec: UnitSpec) -> UnitSpec:
    """The unit as it runs on the CPU: drained, its weights kept in its snapshot, and its KV
    cache released after the drain unless the policy keeps it (policy.process.kv_discard
    decided again: on the CPU vLLM can keep it, where its GPU sleep cannot)."""
    keeps = not spec.kv_discard_asked and adapter_for(spec.engine).can_keep_kv_cache("cpu")
    return replace(spec, accelerator="cpu", release_weights=False, discard_kv=not keeps)
