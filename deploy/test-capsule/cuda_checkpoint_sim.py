#!/usr/bin/python3 -I
"""cuda-checkpoint SIMULATOR for the ColdSnap test capsule. Not NVIDIA's tool.

CI machines have no GPU, so the test capsule installs this as /usr/local/bin/cuda-checkpoint.
It mirrors the real CLI (--get-state, --action lock|checkpoint|restore|unlock, --timeout,
--device-map OLD=NEW,..., --pid) and the real per-process state machine

    running --lock--> locked --checkpoint--> checkpointed --restore--> locked --unlock--> running

and refuses any action that does not start from the right state, as the driver does.

The simulated driver keeps one JSON file per CUDA process in CUDA_SIM_STATE_DIR (default
/var/lib/cuda-sim, inside the container's rootfs). A worker of the test engine "initialises
CUDA" by writing its file; the engine reads it before serving. Because the directory lives in
the rootfs, a capsule commit carries the checkpointed state and the restored process finds it.
Only the GPU is simulated: the process itself is real and is checkpointed by the real CRIU.

Python 3 standard library only: it runs inside the capsule.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

DEFAULT_STATE_DIR = "/var/lib/cuda-sim"
# Devices that exist "on this machine" for the simulated driver: the container's visible set.
VISIBLE_ENV = "COLDSNAP_SIMULATED_GPUS"

# action -> (state it requires, state it leaves)
TRANSITIONS: dict[str, tuple[str, str]] = {
    "lock": ("running", "locked"),
    "checkpoint": ("locked", "checkpointed"),
    "restore": ("checkpointed", "locked"),
    "unlock": ("locked", "running"),
}


class SimError(Exception):
    pass


def state_dir() -> str:
    return os.environ.get("CUDA_SIM_STATE_DIR", DEFAULT_STATE_DIR)


def state_path(pid: int) -> str:
    return os.path.join(state_dir(), f"{pid}.json")


@contextlib.contextmanager
def driver_lock() -> Iterator[None]:
    # One lock for the whole simulated driver: the engine and concurrent CLI calls do
    # read-modify-write on the same files.
    os.makedirs(state_dir(), exist_ok=True)
    fd = os.open(os.path.join(state_dir(), ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def read_state(pid: int) -> dict[str, Any]:
    if not os.path.exists(f"/proc/{pid}"):
        raise SimError(f"process {pid} not found")
    try:
        with open(state_path(pid), encoding="utf-8") as f:
            data: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        raise SimError(
            f"process {pid} is not a CUDA process (CUDA_ERROR_NOT_INITIALIZED)"
        ) from None
    return data


def write_state(pid: int, data: dict[str, Any]) -> None:
    path = state_path(pid)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, sort_keys=True)
    os.replace(tmp, path)


def register(pid: int, devices: list[str]) -> None:
    """Called by the test engine's worker when it 'initialises CUDA'."""
    with driver_lock():
        write_state(pid, {"pid": pid, "state": "running", "devices": devices, "history": []})


def parse_device_map(text: str) -> dict[str, str]:
    mapping: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise SimError(f"invalid --device-map entry {item!r}: expected OLD=NEW")
        if old in mapping:
            raise SimError(f"--device-map names {old} twice")
        mapping[old] = new
    return mapping


def _container_env(name: str) -> str | None:
    """`name` in the container's own environment (PID 1's): coldsnapd runs this tool with an
    empty one, as it runs every program with the capsule's capabilities."""
    try:
        with open("/proc/1/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return None
    prefix = name.encode() + b"="
    return next((i[len(prefix):].decode() for i in items if i.startswith(prefix)), None)


def visible_devices() -> set[str] | None:
    # The simulated driver's view of the container's devices, which coldsnapd set there.
    raw = os.environ.get(VISIBLE_ENV) or _container_env(VISIBLE_ENV)
    if raw is None:
        return None
    return {d for d in raw.split(",") if d}


def refused_by_test(action: str) -> bool:
    """A driver failing an action, for fault tests: a file `refuse-<action>` in the state
    directory (the test writes it into the running unit; the rootfs is read-only)."""
    return os.path.exists(os.path.join(state_dir(), f"refuse-{action}"))


def apply_action(pid: int, action: str, device_map: dict[str, str] | None) -> dict[str, Any]:
    with driver_lock():
        data = read_state(pid)
        need, leave = TRANSITIONS[action]
        if data["state"] != need:
            raise SimError(
                f"cannot {action} process {pid}: it is {data['state']}, {action} needs {need} "
                "(CUDA_ERROR_ILLEGAL_STATE)"
            )
        if device_map is not None and action != "restore":
            raise SimError("--device-map is only valid with --action restore")
        if action == "restore":
            devices = list(data["devices"])
            if device_map is not None:
                missing = [d for d in devices if d not in device_map]
                if missing:
                    raise SimError(f"--device-map does not map {', '.join(missing)}")
                devices = [device_map[d] for d in devices]
            present = visible_devices()
            if present is not None:
                absent = [d for d in devices if d not in present]
                if absent:
                    raise SimError(
                        f"cannot restore process {pid}: device {', '.join(absent)} not present "
                        "(CUDA_ERROR_NO_DEVICE); pass --device-map"
                    )
            data["devices"] = devices
        data["state"] = leave
        data.setdefault("history", []).append([action, time.time()])
        write_state(pid, data)
        return data


USAGE = ("usage: cuda-checkpoint (--get-state | --action {checkpoint,lock,restore,unlock}) "
         "--pid PID [--timeout MS] [--device-map OLD=NEW,...]\n"
         "SIMULATED cuda-checkpoint (ColdSnap test capsule; no GPU involved)\n")
_FLAGS = {"--get-state"}
_VALUED = {"--action", "--pid", "--timeout", "--device-map"}


class UsageError(Exception):
    pass


def parse_args(argv: list[str]) -> dict[str, str]:
    """The real tool's options, `--opt value` or `--opt=value`. By hand rather than with
    argparse: the real tool is a native binary that starts in a millisecond, and argparse's
    imports alone tripled this simulator's start (about 40 ms of each call)."""
    opts: dict[str, str] = {}
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        name, eq, value = arg.partition("=")
        if name in _FLAGS and not eq:
            opts[name] = ""
        elif name in _VALUED:
            if not eq:
                if not rest:
                    raise UsageError(f"argument {name}: expected one argument")
                value = rest.pop(0)
            opts[name] = value
        else:
            raise UsageError(f"unrecognized argument: {arg}")
    if ("--get-state" in opts) == ("--action" in opts):
        raise UsageError("exactly one of --get-state and --action is required")
    if "--action" in opts and opts["--action"] not in TRANSITIONS:
        raise UsageError(f"argument --action: invalid choice: {opts['--action']!r}")
    if "--pid" not in opts:
        raise UsageError("the following arguments are required: --pid")
    for name in ("--pid", "--timeout"):
        if name in opts:
            try:
                int(opts[name])
            except ValueError:
                raise UsageError(f"argument {name}: invalid int value: {opts[name]!r}") from None
    return opts


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        sys.stdout.write(USAGE)
        return 0
    try:
        opts = parse_args(args)
    except UsageError as exc:
        sys.stderr.write(f"{USAGE}cuda-checkpoint: error: {exc}\n")
        return 2
    pid = int(opts["--pid"])
    try:
        if "--get-state" in opts:
            with driver_lock():
                print(read_state(pid)["state"])
            return 0
        dmap = parse_device_map(opts["--device-map"]) if "--device-map" in opts else None
        if refused_by_test(opts["--action"]):
            print(f"{opts['--action']} refused (test)", file=sys.stderr)
            return 1
        apply_action(pid, opts["--action"], dmap)
    except SimError as exc:
        print(f"cuda-checkpoint (simulated): error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
