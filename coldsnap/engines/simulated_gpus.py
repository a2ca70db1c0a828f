"""The simulation seam of worker discovery: the one place coldsnapd reads the GPU simulator.

On a simulated host (`UnitSpec.gpu_mode == "simulated"`, the dev cluster's hosts) no process
holds `/dev/nvidia<N>` open: the cuda-checkpoint simulator in the test capsule
(deploy/test-capsule/cuda_checkpoint_sim.py) keeps a driver state file per GPU process inside
the container's rootfs instead, its stand-in for NVML's compute processes. Discovery
(coldsnap.engines.discovery) asks this module for the probe lines that read that state, for
the devices one state names, and whether a worker holds the devices its slots select.
Nothing else in coldsnapd knows the simulator's files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

# The simulator's state directory inside the container's rootfs (its DEFAULT_STATE_DIR).
STATE_DIR = "/var/lib/cuda-sim"

# Discovery's host probe runs these lines for each PID `$p` when SIM=1: the driver state file
# of the process (named by its PID inside the container, the last NSpid field), on one line.
PROBE_LINES = r"""  if [ "$SIM" = 1 ]; then
    n=$(grep '^NSpid:' "/proc/$p/status" 2>/dev/null | awk '{print $NF}')
    s="/proc/$p/root$SIMDIR/$n.json"
    [ -f "$s" ] && { printf 'sim '; head -c 65536 "$s"; echo; }
  fi
"""
# How the probe marks that line.
PROBE_TAG = "sim "


def probe_env(simulated: bool) -> list[str]:
    """The probe's environment: whether to read the simulator's state, and where."""
    return [f"SIM={1 if simulated else 0}", f"SIMDIR={STATE_DIR}"]


def state_devices(state_text: str) -> list[str]:
    """The devices a process's driver state names; unreadable state names none."""
    try:
        state = json.loads(state_text)
        return [str(d) for d in state.get("devices", [])]
    except (ValueError, AttributeError):
        return []


def device_mismatch(worker_id: str, pid: int, held: Sequence[str] | None,
                    device_slots: Sequence[int], unit_devices: Sequence[str]) -> str | None:
    """Why worker `worker_id` (process `pid`, holding the simulated devices `held`) does not
    hold the devices its device slots select among the unit's, or None when it does."""
    want = [unit_devices[s] for s in device_slots if s < len(unit_devices)]
    if held != want:
        return (f"worker {worker_id} (process {pid}) holds devices {held}, its device slots "
                f"select {want}")
    return None
