"""The cuda-checkpoint SIMULATOR: real CLI, real state machine, refuses what the driver refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SIM = Path(__file__).resolve().parents[2] / "deploy" / "test-capsule" / "cuda_checkpoint_sim.py"
GPU_A, GPU_B, GPU_X, GPU_Y = "GPU-aaaa", "GPU-bbbb", "GPU-xxxx", "GPU-yyyy"


@pytest.fixture
def driver(tmp_path: Path) -> Path:
    return tmp_path / "cuda-sim"


@pytest.fixture
def proc() -> Iterator[int]:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait()


def sim(driver: Path, *args: str, visible: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_SIM_STATE_DIR": str(driver)}
    env.pop("COLDSNAP_SIMULATED_GPUS", None)
    if visible is not None:
        env["COLDSNAP_SIMULATED_GPUS"] = visible
    return subprocess.run([sys.executable, str(SIM), *args], env=env, capture_output=True,
                          text=True, check=False)


def register(driver: Path, pid: int, devices: list[str]) -> None:
    code = (f"import sys; sys.path.insert(0, {str(SIM.parent)!r}); import cuda_checkpoint_sim "
            f"as s; s.register({pid}, {devices!r})")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "CUDA_SIM_STATE_DIR": str(driver)})


def state(driver: Path, pid: int) -> str:
    r = sim(driver, "--get-state", "--pid", str(pid))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_full_cycle_with_device_map(driver: Path, proc: int) -> None:
    register(driver, proc, [GPU_A, GPU_B])
    assert state(driver, proc) == "running"
    assert sim(driver, "--action", "lock", "--pid", str(proc), "--timeout", "500").returncode == 0
    assert state(driver, proc) == "locked"
    assert sim(driver, "--action", "checkpoint", "--pid", str(proc)).returncode == 0
    assert state(driver, proc) == "checkpointed"
    r = sim(driver, "--action", "restore", "--pid", str(proc), "--device-map",
            f"{GPU_A}={GPU_X},{GPU_B}={GPU_Y}", visible=f"{GPU_X},{GPU_Y}")
    assert r.returncode == 0, r.stderr
    assert state(driver, proc) == "locked"
    assert sim(driver, "--action", "unlock", "--pid", str(proc)).returncode == 0
    assert state(driver, proc) == "running"
    data = json.loads((driver / f"{proc}.json").read_text())
    assert data["devices"] == [GPU_X, GPU_Y]
    assert [h[0] for h in data["history"]] == ["lock", "checkpoint", "restore", "unlock"]


@pytest.mark.parametrize(
    ("setup", "action", "needs"),
    [
        ([], "checkpoint", "needs locked"),
        ([], "unlock", "needs locked"),
        ([], "restore", "needs checkpointed"),
        (["lock"], "lock", "needs running"),
        (["lock"], "restore", "needs checkpointed"),
        (["lock", "checkpoint"], "unlock", "needs locked"),
        (["lock", "checkpoint"], "checkpoint", "needs locked"),
        (["lock", "checkpoint"], "lock", "needs running"),
    ],
)
def test_out_of_order_actions_are_refused(
    driver: Path, proc: int, setup: list[str], action: str, needs: str
) -> None:
    register(driver, proc, [GPU_A])
    for a in setup:
        assert sim(driver, "--action", a, "--pid", str(proc)).returncode == 0
    before = state(driver, proc)
    r = sim(driver, "--action", action, "--pid", str(proc))
    assert r.returncode == 1
    assert needs in r.stderr and "CUDA_ERROR_ILLEGAL_STATE" in r.stderr
    assert state(driver, proc) == before  # a refused action changes nothing


def test_device_map_only_with_restore(driver: Path, proc: int) -> None:
    register(driver, proc, [GPU_A])
    r = sim(driver, "--action", "lock", "--pid", str(proc), "--device-map", f"{GPU_A}={GPU_X}")
    assert r.returncode == 1 and "only valid with --action restore" in r.stderr
    assert state(driver, proc) == "running"


def test_restore_refuses_absent_devices_and_incomplete_maps(driver: Path, proc: int) -> None:
    register(driver, proc, [GPU_A, GPU_B])
    for a in ("lock", "checkpoint"):
        assert sim(driver, "--action", a, "--pid", str(proc)).returncode == 0
    # moved to a machine whose GPUs differ, without a map
    r = sim(driver, "--action", "restore", "--pid", str(proc), visible=f"{GPU_X},{GPU_Y}")
    assert r.returncode == 1 and "not present" in r.stderr
    # a map that forgets one device
    r = sim(driver, "--action", "restore", "--pid", str(proc), "--device-map", f"{GPU_A}={GPU_X}",
            visible=f"{GPU_X},{GPU_Y}")
    assert r.returncode == 1 and GPU_B in r.stderr
    # a map to a GPU this machine does not have
    r = sim(driver, "--action", "restore", "--pid", str(proc), "--device-map",
            f"{GPU_A}={GPU_X},{GPU_B}=GPU-zzzz", visible=f"{GPU_X},{GPU_Y}")
    assert r.returncode == 1 and "GPU-zzzz" in r.stderr
    assert state(driver, proc) == "checkpointed"


def test_malformed_device_map(driver: Path, proc: int) -> None:
    register(driver, proc, [GPU_A])
    for a in ("lock", "checkpoint"):
        sim(driver, "--action", a, "--pid", str(proc))
    for bad in (GPU_A, f"{GPU_A}=", f"{GPU_A}={GPU_X},{GPU_A}={GPU_Y}"):
        r = sim(driver, "--action", "restore", "--pid", str(proc), "--device-map", bad)
        assert r.returncode == 1, bad
    assert state(driver, proc) == "checkpointed"


def test_non_cuda_and_missing_processes(driver: Path, proc: int) -> None:
    r = sim(driver, "--get-state", "--pid", str(proc))
    assert r.returncode == 1 and "not a CUDA process" in r.stderr
    r = sim(driver, "--action", "lock", "--pid", "999999999")
    assert r.returncode == 1 and "not found" in r.stderr


def test_cli_requires_exactly_one_of_get_state_and_action(driver: Path, proc: int) -> None:
    assert sim(driver, "--pid", str(proc)).returncode == 2
    assert sim(driver, "--get-state", "--action", "lock", "--pid", str(proc)).returncode == 2
    assert sim(driver, "--action", "toggle", "--pid", str(proc)).returncode == 2


def test_cli_takes_both_option_forms_and_refuses_malformed_ones(driver: Path, proc: int) -> None:
    register(driver, proc, [GPU_A])
    assert sim(driver, "--action=lock", f"--pid={proc}", "--timeout=500").returncode == 0
    assert state(driver, proc) == "locked"
    for bad in (["--action", "unlock", "--pid"], ["--action", "unlock", "--pid", "x"],
                ["--action", "unlock", "--pid", str(proc), "--timeout", "soon"],
                ["--action", "unlock", f"--pid=--{proc}"],
                ["--action", "unlock", "--pid", str(proc), "--verbose"],
                ["--get-state=yes", "--pid", str(proc)]):
        r = sim(driver, *bad)
        assert r.returncode == 2 and "usage: cuda-checkpoint" in r.stderr, (bad, r.stderr)
    assert state(driver, proc) == "locked"  # nothing was applied
    helped = sim(driver, "--help")
    assert helped.returncode == 0 and "SIMULATED" in helped.stdout
