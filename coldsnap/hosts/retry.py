"""When a failure is worth another try, and how many tries and waits each retry loop gets.

The rule (`is_transient`): a refusal (the host's key changed or is unknown, our login was
refused) is never tried again; a lost connection is. What a lost connection looks like, and
what is final besides the refusals, depends on where the failure is seen, its stage:

  connect   opening the SSH connection: any socket error or timeout, and a disconnect, are
            lost; asyncssh's own refusals (host key, login, key exchange, protocol) are final,
            and so is a failure already named by the transport (a jump host's connection,
            which had its own tries)
  reopen    opening a channel: only a connection found dead under the open (`LostOnOpen`);
            the command has not started, so one more try cannot run it twice
  transfer  a resumable transfer: a lost connection, a disconnect or a closed channel, a
            stream cut short, or the transfer's own `Retry`; a `TransferError` is final
  session   a clean-up step on a host's Docker session, seen through a capsule step's own
            error: a lost connection or a dead Docker relay anywhere in what it was raised
            from

The policies (attempts, backoff) of the loops that use the rule: `connect_policy`,
`REOPEN_POLICY`, `transfer_policy`, `session_policy`.

asyncssh is imported only by the stages that need it (`connect_stage`, `transfer_stage`):
the operations and capsule layers, which use the session stage, never load it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import requests.exceptions
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_incrementing,
    wait_none,
    wait_random_exponential,
)
from tenacity.wait import wait_base

from coldsnap.hosts.base import (
    HostAuthFailed,
    HostError,
    HostKeyRejected,
    HostUnreachable,
    TransferError,
)
from coldsnap.hosts.settings import SSHSettings
from coldsnap.hosts.transfer.protocol import Retry

Types = tuple[type[BaseException], ...]

# Never worth another try, wherever seen: a changed key or a refused login stays so.
REFUSED: Types = (HostKeyRejected, HostAuthFailed)
# A lost connection, as the transport names it or as a socket reports it.
LOST: Types = (HostUnreachable, ConnectionError)


class LostOnOpen(HostUnreachable):
    """A channel open found its connection dead: nothing started on the host."""


@dataclass(frozen=True)
class Stage:
    """What is final and what is lost where a failure is seen (final is looked at first)."""

    final: Types
    lost: Types
    causes: bool = False  # also look through what the failure was raised from


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


SESSION = Stage(final=REFUSED, lost=(*LOST, requests.exceptions.ConnectionError), causes=True)
REOPEN = Stage(final=(), lost=(LostOnOpen,))


@functools.cache
def connect_stage() -> Stage:
    import asyncssh

    refused = (asyncssh.HostKeyNotVerifiable, asyncssh.PermissionDenied,
               asyncssh.KeyExchangeFailed, asyncssh.ProtocolNotSupported)
    return Stage(final=(*REFUSED, *refused, HostError),
                 lost=(OSError, TimeoutError, asyncssh.DisconnectError))


@functools.cache
def transfer_stage() -> Stage:
    import asyncssh

    return Stage(final=(*REFUSED, TransferError),
                 lost=(*LOST, Retry, asyncssh.DisconnectError, asyncssh.ChannelOpenError,
                       asyncio.IncompleteReadError))


def is_transient(exc: BaseException, stage: Stage = SESSION) -> bool:
    """Whether `exc`, seen at `stage`, is a lost connection worth another try."""
    for cur in _chain(exc) if stage.causes else (exc,):
        if isinstance(cur, stage.final):
            return False
        if isinstance(cur, stage.lost):
            return True
    return False


@dataclass(frozen=True)
class Policy:
    """How one retry loop tries: its stage's rule, how many attempts, the waits between."""

    stage: Stage
    attempts: int
    wait: wait_base

    def retrying(self, *, before_sleep: Callable[[RetryCallState], None] | None = None,
                 reraise: bool = True) -> AsyncRetrying:
        stage = self.stage
        return AsyncRetrying(stop=stop_after_attempt(self.attempts), wait=self.wait,
                             retry=retry_if_exception(lambda exc: is_transient(exc, stage)),
                             before_sleep=before_sleep, reraise=reraise)


def connect_policy(settings: SSHSettings) -> Policy:
    """The SSH connect: `settings.connect_attempts`, jittered exponential backoff."""
    return Policy(connect_stage(), settings.connect_attempts,
                  wait_random_exponential(multiplier=settings.retry_initial,
                                          max=settings.retry_max))


# A channel open that found its connection dead: once more, at once, on a fresh connection.
REOPEN_POLICY = Policy(REOPEN, 2, wait_none())


def transfer_policy(attempts: int) -> Policy:
    """A resumable transfer: each try continues the last one's partial file."""
    return Policy(transfer_stage(), attempts, wait_random_exponential(multiplier=0.5, max=8.0))


# Between fresh sessions to a host that was lost: 2, 4, then 5 s. With on_session's 8
# reconnects that is about 36 s, for a host whose connection dropped to come back; a rollback
# (ROLLBACK_UNIT_S per unit) is never held longer by one that won't.
RECONNECT_WAIT = wait_incrementing(start=2.0, increment=2.0, max=5.0)


def session_policy(reconnects: int) -> Policy:
    """A clean-up step on a lost host: its own session, then `reconnects` fresh ones."""
    return Policy(SESSION, 1 + reconnects, RECONNECT_WAIT)


__all__ = [
    "LOST",
    "RECONNECT_WAIT",
    "REFUSED",
    "REOPEN_POLICY",
    "SESSION",
    "LostOnOpen",
    "Policy",
    "Stage",
    "connect_policy",
    "connect_stage",
    "is_transient",
    "session_policy",
    "transfer_policy",
    "transfer_stage",
]
