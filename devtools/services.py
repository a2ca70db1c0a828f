"""sshd and dockerd of one simulated host, both inside the host's network namespace."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

from devtools import procs
from devtools.layout import HostNet, HostPaths

SSHD = "/usr/sbin/sshd"


class ServiceError(RuntimeError):
    """sshd or dockerd refused to start (the message names the log to read)."""


def log(msg: str) -> None:
    print(f"dev-cluster: {msg}", file=sys.stderr, flush=True)


# --- sshd --------------------------------------------------------------------------------------


def sshd_config_ok(config: Path) -> None:
    # sshd refuses even to check a config without its privilege separation directory,
    # which a fresh machine's /run lacks until openssh's own service first ran.
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    Path("/run/sshd").chmod(0o755)
    r = subprocess.run([SSHD, "-t", "-f", str(config)], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        raise ServiceError(f"sshd config {config} rejected: {r.stderr.strip()}")


def write_sshd_config(paths: HostPaths, text: str) -> None:
    """Write the config when it changed; a running sshd re-reads it on SIGHUP (open sessions
    stay)."""
    paths.home.mkdir(parents=True, exist_ok=True)
    paths.home.chmod(0o700)
    if paths.sshd_config.exists() and paths.sshd_config.read_text() == text:
        return
    tmp = paths.sshd_config.with_suffix(".new")
    tmp.write_text(text)
    tmp.replace(paths.sshd_config)
    pid = procs.pid_alive(paths.sshd_pid)
    if pid is not None:
        sshd_config_ok(paths.sshd_config)
        os.kill(pid, 1)  # SIGHUP


def start_sshd(net: HostNet, paths: HostPaths) -> None:
    """sshd inside the host's namespace, listening on the host's address only."""
    if procs.pid_alive(paths.sshd_pid):
        return
    paths.sshd_pid.unlink(missing_ok=True)
    sshd_config_ok(paths.sshd_config)
    # `ip netns exec` also gives sshd (and so every session) the namespace's own /sys.
    r = subprocess.run(
        ["ip", "netns", "exec", net.netns, SSHD, "-f", str(paths.sshd_config),
         "-E", str(paths.sshd_log)],
        capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise ServiceError(f"{net.name}: sshd did not start: {r.stderr.strip()} "
                           f"(see {paths.sshd_log})")
    for _ in range(100):
        if procs.pid_alive(paths.sshd_pid):
            return
        time.sleep(0.05)
    raise ServiceError(f"{net.name}: sshd did not start (see {paths.sshd_log})")


def stop_sshd(paths: HostPaths) -> None:
    """Kill the listener and every per-connection child: a lost host loses its open
    connections too, so killing only the listener would not do."""
    pid = procs.pid_alive(paths.sshd_pid)
    if pid is not None:
        victims = [pid, *procs.descendants(pid)]
        procs.kill_all(victims)
        procs.wait_gone([pid], 5)
    paths.sshd_pid.unlink(missing_ok=True)


# --- dockerd -----------------------------------------------------------------------------------


def dockerd_argv(name: str, paths: HostPaths, registry: str) -> list[str]:
    # No --containerd: each dockerd supervises its own containerd (state under its own data and
    # exec roots), so the engines share nothing; the containerd namespaces keep them apart even
    # if a system containerd is found and shared.
    return [
        "dockerd",
        "--data-root", str(paths.docker / "root"),
        "--exec-root", str(paths.docker / "exec"),
        "-H", f"unix://{paths.docker_sock}",
        "--pidfile", str(paths.docker_pid),
        "--bridge=none", "--iptables=false", "--ip-masq=false", "--ip-forward=false",
        "--containerd-namespace", f"coldsnap-{name}",
        "--containerd-plugins-namespace", f"coldsnap-{name}-p",
        "--insecure-registry", registry,
    ]


def dockerd_running(paths: HostPaths) -> bool:
    return procs.pid_alive(paths.docker_pid) is not None


def dockerd_trusts(paths: HostPaths, registry: str) -> bool:
    """Whether the running dockerd was started trusting `registry` (`--insecure-registry`)."""
    pid = procs.pid_alive(paths.docker_pid)
    if pid is None:
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a == b"--insecure-registry" and b == registry.encode()
               for a, b in itertools.pairwise(argv))


def start_dockerd(net: HostNet, paths: HostPaths, registry: str) -> None:
    """dockerd entered into the host's network namespace ONLY (nsenter --net): `ip netns exec`
    would also give it a fresh /sys without the cgroup mounts, and it dies with "Devices cgroup
    isn't mounted". `--network host` containers then live in the host's namespace.
    A dockerd started trusting another registry (before the registry host had its own
    address) is restarted: the flag is read only at start. Its images stay."""
    (paths.docker / "root").mkdir(parents=True, exist_ok=True)
    (paths.docker / "exec").mkdir(parents=True, exist_ok=True)
    if dockerd_running(paths):
        if dockerd_trusts(paths, registry):
            return
        log(f"{net.name}: restarting dockerd to trust the registry {registry}")
        stop_dockerd(paths)
    paths.docker_sock.unlink(missing_ok=True)
    with open(paths.docker_log, "ab") as logf:
        subprocess.Popen(
            ["nsenter", f"--net={net.netns_path}", *dockerd_argv(net.name, paths, registry)],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)


def docker_answers(paths: HostPaths) -> bool:
    if not paths.docker_sock.is_socket():
        return False
    r = subprocess.run(
        ["docker", "-H", f"unix://{paths.docker_sock}", "version", "--format",
         "{{.Server.Version}}"],
        capture_output=True, check=False)
    return r.returncode == 0


def wait_dockerd(name: str, paths: HostPaths, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if docker_answers(paths):
            return
        time.sleep(0.1)
    raise ServiceError(f"{name}: dockerd did not answer (see {paths.docker_log})")


def stop_dockerd(paths: HostPaths) -> None:
    pid = procs.pid_alive(paths.docker_pid)
    if pid is not None:
        procs.terminate([pid], grace=30)
    # A dockerd killed hard can leave its containerd and shims behind; they are ours when their
    # command line points into this host's docker directory.
    stray = procs.cmdline_contains(f"{paths.docker}/")
    if stray:
        procs.kill_all(stray)
        procs.wait_gone(stray, 5)
    paths.docker_pid.unlink(missing_ok=True)
    paths.docker_sock.unlink(missing_ok=True)
    # Mounts the engine left (overlay layers, netns) keep the data root busy.
    for point in procs.mounts_under(paths.docker):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
