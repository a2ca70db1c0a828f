"""The dev cluster's registry host: the local OCI registry in its own network namespace.

The registry runs at its own address on the bridge (198.18.0.254 for network base 0; see
devtools/layout.py), not on the control node's, so that the bytes crossing the control node's
link (the bridge device csd-br0's own counters) and the registry's link (its veth) can be told
apart and shaped separately (devtools/shaping.py). Hosts and the control node both reach it
over the bridge.

    ADDR:5000   plain-HTTP docker-registry (Debian's CNCF distribution): capsules, artifacts.
                Storage in <state>/registry/data, kept by `down`, so pushed images survive.
    ADDR:5001   TLS + token auth (token server on ADDR:5002; devtools.registry_server), its
                CA and credentials under <state>/registry/auth.

Every registry process is started by `_start_plain` / `start_auth`, inside the namespace.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from devtools import net, procs
from devtools.layout import REGISTRY_AUTH_PORT, AuthRegistry, RegistryNet
from devtools.registry_server import start_registry


class RegistryError(RuntimeError):
    """The registry host or its registry could not be brought up (the message says why)."""


def answers(address: str, timeout: float = 2) -> bool:
    """GET /v2/ on a plain-HTTP registry answers 200."""
    try:
        with urllib.request.urlopen(f"http://{address}/v2/", timeout=timeout) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def ensure_host(reg: RegistryNet, state: Path) -> None:
    """Its namespace and veth on the bridge, as a simulated host's (idempotent)."""
    net.ensure_host_net(reg, state)


def _stop_pidfile(pidfile: Path) -> int | None:
    """Stop the process a pidfile names when it is still a docker-registry; its pid if so."""
    pid = procs.pid_alive(pidfile)
    if pid is not None:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            cmdline = b""
        if b"registry" in cmdline:  # not a recycled pid
            procs.terminate([pid], grace=10)
        else:
            pid = None
    pidfile.unlink(missing_ok=True)
    return pid


def _start_plain(reg: RegistryNet, registry_dir: Path) -> subprocess.Popen[bytes]:
    """docker-registry serving <registry_dir>/data on ADDR:5000 inside the registry's namespace.

    Started here rather than through devtools.registry_server to keep its storage layout and
    pidfile (<registry_dir>/registry.pid) as clusters made before it have them."""
    (registry_dir / "data").mkdir(parents=True, exist_ok=True)
    config = registry_dir / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: warn\n"
        "storage:\n  filesystem:\n"
        f"    rootdirectory: {registry_dir / 'data'}\n"
        "  delete:\n    enabled: true\n"
        f"http:\n  addr: {reg.plain}\n"
    )
    with open(registry_dir / "registry.log", "ab") as logf:
        # `ip netns exec` execs the registry itself: the pid is the registry's.
        proc = subprocess.Popen(
            ["ip", "netns", "exec", reg.netns, "docker-registry", "serve", str(config)],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
    (registry_dir / "registry.pid").write_text(f"{proc.pid}\n")
    return proc


def ensure_plain(reg: RegistryNet, registry_dir: Path, timeout: float = 10) -> bool:
    """The plain registry answering on ADDR:5000; True when it was started now."""
    if not net.netns_exists(reg.netns):
        raise RegistryError(f"the registry host's namespace {reg.netns} does not exist: run "
                            "scripts/dev-cluster up first")
    if answers(reg.plain):
        return False
    registry_dir.mkdir(parents=True, exist_ok=True)
    # A registry from before the registry host (on the bridge's own address, in the root
    # namespace) or one that stopped answering holds the storage: stop it first.
    _stop_pidfile(registry_dir / "registry.pid")
    proc = _start_plain(reg, registry_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if answers(reg.plain, timeout=1):
            return True
        if proc.poll() is not None:
            raise RegistryError(f"docker-registry exited; see {registry_dir / 'registry.log'}")
        time.sleep(0.1)
    raise RegistryError(f"docker-registry did not answer on {reg.plain} within {timeout:.0f} s; "
                        f"see {registry_dir / 'registry.log'}")


def start_auth(reg: RegistryNet, registry_dir: Path) -> AuthRegistry:
    """The TLS + token-auth registry on ADDR:5001 (token server ADDR:5002), inside the
    registry's namespace (devtools.registry_server); its CA and a docker-style credentials
    file stay under <registry_dir>/auth, for the inventory's `registries:`. A running one is
    kept (its password lives in that credentials file)."""
    auth_dir = registry_dir / "auth"
    ca, creds = auth_dir / "ca.pem", auth_dir / "config.json"
    running = all(procs.pid_alive(auth_dir / f"{name}.pid") is not None
                  for name in ("registry", "token"))
    if running and ca.is_file() and creds.is_file():
        return AuthRegistry(reg.authenticated, ca, creds)
    _stop_auth(auth_dir)
    srv = start_registry(auth_dir, reg.address, REGISTRY_AUTH_PORT, auth=True, netns=reg.netns)
    assert srv.ca_file is not None and srv.credentials_file is not None
    return AuthRegistry(reg.authenticated, srv.ca_file, srv.credentials_file)


def _stop_auth(auth_dir: Path) -> list[int]:
    return [pid for name in ("registry", "token")
            if (pid := _stop_pidfile(auth_dir / f"{name}.pid")) is not None]


def stop(reg: RegistryNet, registry_dir: Path, state: Path) -> list[str]:
    """Stop the registries, then remove the registry host (only when this cluster made it).
    The storage stays. Returns what was stopped, for the log."""
    done: list[str] = []
    pid = _stop_pidfile(registry_dir / "registry.pid")
    if pid is not None:
        done.append(f"registry (pid {pid})")
    for pid in _stop_auth(registry_dir / "auth"):
        done.append(f"authenticated registry process (pid {pid})")
    if net.owner(reg) == str(state):
        left = net.netns_pids(reg.netns)
        if left:
            procs.terminate(left, grace=5)
        net.remove_host_net(reg, state)
        done.append(f"registry host {reg.netns}")
    return done
