"""`coldsnapd serve`: the service's process, from its socket to its exit status.

Start: lock the state dir (one service per state dir), open the job store, listen on the
socket (or take the one systemd passes), recover the jobs a previous process left (jobs
submitted meanwhile wait for that), then tell systemd READY=1. While it runs: STATUS= with
the jobs running and queued, watchdog pings when systemd asks for them.

SIGTERM (or SIGINT): STOPPING=1, no new job; queued jobs are cancelled (nothing of them ran);
running jobs get `--drain-seconds` to finish, then are cancelled and rolled back, shielded.
A second signal ends the grace period at once. The exit status is 0 when every job ended and
no rollback failed, else 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import grp
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from aiohttp import web

from coldsnap import logs
from coldsnap.formats.service_policy import ServicePolicy
from coldsnap.hosts.inventory import Inventory
from coldsnap.logs import get_logger
from coldsnap.runner.ledger import Ledger
from coldsnap.service.api import build_app, build_metrics_app
from coldsnap.service.job_store import JobStore
from coldsnap.service.metrics import Metrics
from coldsnap.service.notify import Notifier
from coldsnap.service.recovery import recover
from coldsnap.service.scheduler import Scheduler

SD_LISTEN_FDS_START = 3


class ServeError(Exception):
    """The service cannot start; the message says why."""


@dataclass(frozen=True)
class ServeConfig:
    socket: Path
    state_dir: Path
    inventory_path: Path
    inventory: Inventory
    store: Path
    drain_seconds: float
    metrics_listen: tuple[str, int] | None
    socket_group: str | None
    host_check_s: float
    verbose: bool
    # None: no policy file (only root submits, unrestricted)
    policy: ServicePolicy | None = None


def serve(config: ServeConfig) -> int:
    logs.configure(verbose=config.verbose)
    lock = _lock_state_dir(config.state_dir)
    try:
        return asyncio.run(_serve(config))
    finally:
        lock.close()


def _lock_state_dir(state_dir: Path) -> IO[bytes]:
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    lock = (state_dir / "coldsnapd.lock").open("ab")
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ServeError(f"another coldsnapd serve uses the state dir {state_dir}") from None
    return lock


def listening_socket(path: Path, group: str | None) -> tuple[socket.socket, bool]:
    """The API socket and whether this process created it (else systemd passed it)."""
    if os.environ.get("LISTEN_PID") == str(os.getpid()) and \
            int(os.environ.get("LISTEN_FDS", "0") or 0) >= 1:
        sock = socket.socket(fileno=SD_LISTEN_FDS_START)
        sock.setblocking(False)
        return sock, False
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    if path.is_socket():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(2.0)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # left by a process that is gone
        else:
            raise ServeError(f"another coldsnapd answers on {path}")
        finally:
            probe.close()
    elif path.exists() or path.is_symlink():
        raise ServeError(f"{path} exists and is not a socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)  # never a moment with a wider mode than 0660
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    if group:
        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        except KeyError:
            get_logger(component="serve").warning(
                "serve.no-group", group=group, detail="socket left to its owner's group")
    sock.listen(128)
    sock.setblocking(False)
    return sock, True


async def _serve(config: ServeConfig) -> int:
    log = get_logger(component="serve")
    notifier = Notifier()
    jobs = JobStore(config.state_dir / "jobs.sqlite3", Ledger(config.store))
    metrics = Metrics(jobs)
    scheduler = Scheduler(jobs, metrics, inventory=config.inventory_path,
                          store_root=config.store, policy=config.policy)
    scheduler.on_change = lambda: notifier.status(scheduler.status_line())
    stop = asyncio.Event()
    hurry = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        log.info("serve.signal", signal=sig.name)
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    sock, created = listening_socket(config.socket, config.socket_group)
    runner = web.AppRunner(build_app(scheduler, metrics, inventory=config.inventory_path,
                                     store=config.store), handle_signals=False, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    metrics_runner: web.AppRunner | None = None
    if config.metrics_listen is not None:
        metrics_runner = web.AppRunner(build_metrics_app(metrics), access_log=None)
        await metrics_runner.setup()
        host, port = config.metrics_listen
        await web.TCPSite(metrics_runner, host, port).start()
    background = [asyncio.create_task(notifier.watchdog()),
                  asyncio.create_task(metrics.watch_hosts(config.inventory_path,
                                                          config.host_check_s))]
    log.info("serve.listening", socket=str(config.socket), pid=os.getpid())
    try:
        for line in await recover(jobs, config.inventory, config.store):
            log.warning("serve.recovered", detail=line)
        scheduler.recovering = False
        scheduler.pump()
        notifier.ready(scheduler.status_line())
        log.info("serve.ready", status=scheduler.status_line())
        await stop.wait()
        notifier.stopping(f"draining: {scheduler.status_line()}")
        clean = await scheduler.drain(config.drain_seconds, hurry)
        log.info("serve.stopped", clean=clean, unclean=scheduler.unclean)
        return 0 if clean else 1
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await runner.cleanup()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        jobs.close()
        if created:
            with contextlib.suppress(OSError):
                config.socket.unlink()
