"""Transport rules that need no host: what is retried, how the OpenSSH client is pinned."""

from __future__ import annotations

from pathlib import Path

import asyncssh
import pytest

from coldsnap.hosts.base import HostAuthFailed, HostKeyRejected
from coldsnap.hosts.host_keys import known_hosts_pattern
from coldsnap.hosts.inventory import HostEntry
from coldsnap.hosts.retry import connect_stage, is_transient
from coldsnap.hosts.ssh import SSHSettings
from coldsnap.hosts.transfer.openssh_client import openssh_argv


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionRefusedError(111, "refused"),
        ConnectionResetError(),
        TimeoutError(),
        asyncssh.ConnectionLost("gone"),
    ],
)
def test_connection_errors_are_retried(exc: BaseException) -> None:
    assert is_transient(exc, connect_stage())


@pytest.mark.parametrize(
    "exc",
    [
        asyncssh.PermissionDenied("no"),
        asyncssh.HostKeyNotVerifiable("no"),
        HostKeyRejected("h", "no"),
        HostAuthFailed("h", "no"),
        ValueError("bug"),
        asyncssh.KeyExchangeFailed("no"),
    ],
)
def test_refusals_and_bugs_are_not_retried(exc: BaseException) -> None:
    assert not is_transient(exc, connect_stage())


def entry(**over: object) -> HostEntry:
    base: dict[str, object] = {
        "name": "h",
        "address": "10.1.2.3",
        "port": 2200,
        "data_dir": "/d",
        "identity_file": Path("/k/id"),
        "known_hosts": Path("/k/known_hosts"),
    }
    base.update(over)
    return HostEntry.model_validate(base)


def test_openssh_client_is_pinned_to_the_inventory_trust() -> None:
    argv = openssh_argv(entry(), SSHSettings())
    if argv is None:
        pytest.fail("no `ssh` client on this machine (apt-get install openssh-client)")
    joined = " ".join(argv)
    for option in (
        "BatchMode=yes",
        "StrictHostKeyChecking=yes",
        "UserKnownHostsFile=/k/known_hosts",
        "GlobalKnownHostsFile=/dev/null",
        "IdentitiesOnly=yes",
        "-i /k/id",
        "-p 2200",
    ):
        assert option in joined
    assert argv[-2:] == ["--", "10.1.2.3"]
    assert argv[argv.index("-c") + 1].startswith("aes128-gcm@openssh.com,")


def test_openssh_client_not_used_through_a_jump_host() -> None:
    assert openssh_argv(entry(proxy_jump="bastion"), SSHSettings()) is None


def test_known_hosts_pattern() -> None:
    assert known_hosts_pattern("10.0.0.1", 22) == "10.0.0.1"
    assert known_hosts_pattern("10.0.0.1", 2222) == "[10.0.0.1]:2222"
