"""Transport settings shared by every host of a pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# OpenSSH's per-connection default MaxSessions; the pool keeps below it.
OPENSSH_DEFAULT_MAX_SESSIONS = 10


@dataclass(frozen=True)
class SSHSettings:
    """Transport knobs shared by every host of a pool."""

    connect_timeout: float = 10.0  # TCP connect + key exchange
    login_timeout: float = 15.0  # authentication, on top of connect_timeout
    keepalive_interval: float = 10.0
    keepalive_count_max: int = 3
    # Sessions (exec/sftp channels) open at once per host. Must stay below the host sshd's
    # MaxSessions (OpenSSH default 10); one slot is kept free for the kill channel.
    max_channels: int = OPENSSH_DEFAULT_MAX_SESSIONS - 2
    connect_attempts: int = 4
    retry_initial: float = 0.2
    retry_max: float = 3.0
    # aes128-gcm is the fastest here (AES-NI on both ends, AEAD: no separate MAC pass);
    # the others stay acceptable so a host that disables it still works.
    encryption_algs: tuple[str, ...] = (
        "aes128-gcm@openssh.com",
        "aes256-gcm@openssh.com",
        "chacha20-poly1305@openssh.com",
        "aes128-ctr",
        "aes256-ctr",
    )
    # A bigger receive window than asyncssh's 2 MiB keeps get() streaming.
    recv_window: int = 16 * 1024 * 1024
    # How put() moves bulk bytes: "auto" (the OpenSSH client when usable, else asyncssh),
    # "openssh" or "asyncssh". See coldsnap.hosts.transfer.driver.put_file.
    bulk_transport: Literal["auto", "openssh", "asyncssh"] = "auto"
