"""Host key trust for the SSH transport: only the inventory's known_hosts file, strict by
default, with an explicit `accept-new` policy for a first contact."""

from __future__ import annotations

import fcntl
import os

import asyncssh
import structlog

from coldsnap.hosts.base import HostKeyRejected
from coldsnap.hosts.inventory import HostEntry

log = structlog.get_logger("coldsnap.hosts")


def known_hosts_pattern(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


class TrustingClient(asyncssh.SSHClient):
    """Tracks connection loss and implements the explicit `accept-new` host key policy."""

    def __init__(self, entry: HostEntry) -> None:
        self._entry = entry
        self.lost = False
        self.key_problem: str | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True

    def validate_host_public_key(
        self, host: str, addr: str, port: int, key: asyncssh.SSHKey
    ) -> bool:
        # asyncssh calls this only for a key that known_hosts does not already trust.
        entry = self._entry
        path = entry.known_hosts
        try:
            with open(path, "a+") as fh:
                # The lock serialises concurrent first contacts (several coldsnapd processes
                # or hosts sharing one file); the file is only ever appended to.
                fcntl.flock(fh, fcntl.LOCK_EX)
                fh.seek(0)
                current = asyncssh.import_known_hosts(fh.read())
                trusted = asyncssh.match_known_hosts(current, entry.address, addr, port)[0]
                if trusted:
                    if key in trusted:
                        return True  # another process accepted it a moment ago
                    self.key_problem = "changed"
                    return False
                if entry.host_key_policy != "accept-new":
                    self.key_problem = "unknown"
                    return False
                algo, b64 = key.export_public_key("openssh").decode().split()[:2]
                fh.seek(0, os.SEEK_END)
                fh.write(f"{known_hosts_pattern(entry.address, entry.port)} {algo} {b64}\n")
                fh.flush()
                os.fsync(fh.fileno())
                log.warning(
                    "host key accepted on first contact",
                    host=entry.name,
                    key_type=algo,
                    fingerprint=key.get_fingerprint(),
                    known_hosts=str(path),
                )
                return True
        except OSError as exc:
            self.key_problem = f"cannot read/append {path}: {exc.strerror or exc}"
            return False


def host_key_error(name: str, entry: HostEntry, problem: str | None) -> HostKeyRejected:
    """What to say when the host's key was not trusted (`problem`, as `TrustingClient`
    recorded it)."""
    kh = entry.known_hosts
    target = known_hosts_pattern(entry.address, entry.port)
    if problem == "changed":
        msg = (
            f"host key of {target} DIFFERS from the one recorded in {kh}: refusing to "
            "connect (possible man-in-the-middle, or the host was reinstalled; remove the "
            "old entry by hand if the change is expected)"
        )
    elif problem == "unknown" or problem is None:
        msg = (
            f"host key of {target} is unknown to {kh}: refusing to connect (add the key "
            "to known_hosts, or set `host_key_policy: accept-new` for a first contact)"
        )
    else:
        msg = f"host key of {target} could not be checked: {problem}"
    return HostKeyRejected(name, msg)


def load_known_hosts(name: str, entry: HostEntry) -> asyncssh.SSHKnownHosts:
    path = entry.known_hosts
    try:
        text = path.read_text()
    except FileNotFoundError:
        if entry.host_key_policy != "accept-new":
            raise HostKeyRejected(
                name,
                f"known_hosts file {path} does not exist; with strict host keys nothing "
                "can be trusted (create it, or use `host_key_policy: accept-new`)",
            ) from None
        text = ""
    except OSError as exc:
        raise HostKeyRejected(name, f"cannot read {path}: {exc}") from None
    return asyncssh.import_known_hosts(text)
