"""What a test sees of the test engine from outside, as an operator would: the worker
processes in the unit's container (their rank variables), the simulated driver's state for
each (GPU state and devices) and the warm-up counters the engine keeps in its rootfs. Nothing
is asked of the engine itself."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from coldsnap.capsule import CapsuleSession
from coldsnap.capsule.containers import launch_argv
from coldsnap.capsule.docker_exec import exec_in_container
from coldsnap.capsule.handle import UnitHandle
from coldsnap.capsule.spec import UnitSpec

_SCRIPT = r"""
import json, os
out = {"workers": [], "warmups": {}}
sim = "/var/lib/cuda-sim"
for name in os.listdir("/proc"):
    if not name.isdigit() or not os.path.exists(f"{sim}/{name}.json"):
        continue
    try:
        env = dict(x.split("=", 1) for x in open(f"/proc/{name}/environ", "rb").read()
                   .decode().split("\0") if "=" in x)
        state = json.load(open(f"{sim}/{name}.json"))
    except OSError:
        continue
    out["workers"].append({"pid": int(name), "rank": int(env.get("RANK", -1)),
                           "local_rank": int(env.get("LOCAL_RANK", -1)),
                           "world_size": int(env.get("WORLD_SIZE", -1)),
                           "gpu_state": state["state"], "devices": state["devices"]})
d = "/var/lib/test-engine"
for f in os.listdir(d) if os.path.isdir(d) else []:
    if f.startswith("warmups-") and not f.endswith(".tmp"):
        out["warmups"][f[len("warmups-"):]] = int(open(f"{d}/{f}").read().strip() or 0)
out["workers"].sort(key=lambda w: w["rank"])
print(json.dumps(out))
"""


def _parse(code: int, out: str) -> dict[str, Any]:
    assert code == 0, out
    view: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return view


async def engine_view(s: CapsuleSession, container: Any) -> dict[str, Any]:
    """{"workers": [{pid, rank, local_rank, world_size, gpu_state, devices}] by rank,
    "warmups": {worker id: count}} through an async capsule session."""
    out = await s.exec(container, ["/usr/bin/python3", "-I", "-c", _SCRIPT])
    return _parse(out.exit_status, out.stdout + out.stderr)


def engine_view_sync(container: Any) -> dict[str, Any]:
    """The same through a docker SDK container object."""
    code, out, _ = exec_in_container(container.client.api, container.id,
                                     ["python3", "-c", _SCRIPT])
    return _parse(-1 if code is None else code, out.decode(errors="replace"))


_CONFINEMENT = r"""
import json, sys
out = {}
for pid in sys.argv[1:]:
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status") if ":" in line)
    out[pid] = {k: fields[k].strip() for k in ("CapBnd", "CapEff", "CapPrm", "NoNewPrivs",
                                               "Seccomp")}
print(json.dumps(out))
"""


async def confinement(s: CapsuleSession, container: Any, pids: list[int]) -> dict[int, dict[
        str, str]]:
    """What /proc/PID/status says of each process's capabilities, no-new-privs and seccomp."""
    out = await s.exec(container, ["/usr/bin/python3", "-I", "-c", _CONFINEMENT, *map(str, pids)])
    assert out.ok, out.tail()
    return {int(k): v for k, v in json.loads(out.stdout).items()}


CONFINED = {"CapBnd": "0000000000000000", "CapEff": "0000000000000000",
            "CapPrm": "0000000000000000", "NoNewPrivs": "1", "Seccomp": "2"}


async def run_as_engine(s: CapsuleSession, handle: UnitHandle, spec: UnitSpec,
                     script: str, done: str) -> str:
    """Run `script` with sh as the engine runs (the same launcher: no capability, its seccomp
    filter, the container's environment); returns what it wrote to `done`."""
    container = await s.container(handle.container_id, spec.unit_id, "test")
    probe = replace(spec, command=("/bin/sh", "-c", f"{{ {script}\n}} > {done}.tmp 2>&1; "
                                                    f"mv {done}.tmp {done}"))
    launched = await s.exec(container, launch_argv(probe), timeout_s=60)
    assert launched.ok, launched.tail()
    for _ in range(200):
        read = await s.exec(container, ["/bin/cat", done])
        if read.ok:
            return read.stdout
        await s.exec(container, ["/bin/sleep", "0.05"])
    raise AssertionError(f"{done} never appeared")
