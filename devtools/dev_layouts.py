"""The format's representative layouts as dev-cluster requests (scripts/dev-requests), for a
cluster of four hosts with 8 simulated GPUs each (`scripts/dev-cluster up 4 --gpus 8`).

Each layout is a list of units, each placed on a host with a device count, its workers, and
the groups and services over them; `capture_request` and `restore_request` make the requests.
Written (every one also as `<name>-restore-moved`: each unit on another host, its devices in
reverse order, the master address and NCCL/GLOO interfaces of its new host):
  tp8-one-host   one unit, 8 workers, one world/tensor group
  tp4-dp2        two services (dp-0, dp-1), one TP4 unit each on its own host, own master and
                 serving ports (also `tp4-dp2-restore-swapped`: the replicas' hosts swapped)
  tp4-pp2        one service, a unit per pipeline stage (4 workers each): two tensor groups
                 and four pipeline groups across the hosts
  tp4-ep2        one service, two TP4 units, plus two expert groups that overlap both tensor
                 groups and cross the hosts
  sglang-pd      SGLang prefill (TP2, unit-0) and decode (TP2, unit-1) services; the decode
                 sends every prompt to the prefill's bootstrap port first
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MASTER_PORT = 29500
BOOTSTRAP_PORT = 8998


@dataclass(frozen=True)
class LayoutUnit:
    service: str
    gpus: int
    port: int  # serving port
    master_port: int
    extra: tuple[str, ...] = ()  # further engine arguments


@dataclass(frozen=True)
class Layout:
    name: str
    engine: str
    units: tuple[LayoutUnit, ...]
    # (id, kind suffix, service, member worker indexes); world groups come from the services.
    groups: tuple[tuple[str, str, str, tuple[int, ...]], ...] = ()
    roles: dict[str, str] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return sum(u.gpus for u in self.units)


def _tp_pp(name: str, second: str) -> Layout:
    """Two TP4 units of one service, and groups of kind `second` across them."""
    units = (LayoutUnit("engine", 4, 8000, MASTER_PORT), LayoutUnit("engine", 4, 8000,
                                                                      MASTER_PORT))
    tensor = (("tp-0", "tensor", "engine", (0, 1, 2, 3)), ("tp-1", "tensor", "engine",
                                                            (4, 5, 6, 7)))
    extra: tuple[tuple[str, str, str, tuple[int, ...]], ...]
    if second == "pipeline":  # stage s of every tensor rank: (i, i + 4)
        extra = tuple((f"pp-{i}", "pipeline", "engine", (i, i + 4)) for i in range(4))
    else:  # expert groups overlapping both tensor groups, across both hosts
        extra = (("ep-0", "expert", "engine", (0, 1, 4, 5)),
                 ("ep-1", "expert", "engine", (2, 3, 6, 7)))
    return Layout(name, "vllm", units, tensor + extra)


LAYOUTS = (
    Layout("tp8-one-host", "vllm", (LayoutUnit("engine", 8, 8000, MASTER_PORT),),
           (("tp", "tensor", "engine", tuple(range(8))),)),
    Layout("tp4-dp2", "vllm",
           (LayoutUnit("dp-0", 4, 8000, MASTER_PORT), LayoutUnit("dp-1", 4, 8001, 29600)),
           (("dp-0-tp", "tensor", "dp-0", (0, 1, 2, 3)),
            ("dp-1-tp", "tensor", "dp-1", (4, 5, 6, 7)))),
    _tp_pp("tp4-pp2", "pipeline"),
    _tp_pp("tp4-ep2", "expert"),
    Layout("sglang-pd", "sglang",
           (LayoutUnit("prefill", 2, 30000, MASTER_PORT,
                       ("--disaggregation-mode", "prefill",
                        "--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT))),
            LayoutUnit("decode", 2, 30001, 29600,
                       ("--disaggregation-mode", "decode",
                        "--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)))),
           (("prefill-tp", "tensor", "prefill", (0, 1)),
            ("decode-tp", "tensor", "decode", (2, 3))),
           {"prefill": "sglang:prefill", "decode": "sglang:decode"}),
)


def interface(host: str) -> str:
    """The dev cluster names host-N's network interface ensN (scripts/dev-cluster)."""
    return "ens" + host.rsplit("-", 1)[-1]


def _place(unit: dict[str, Any], lu: LayoutUnit, engine: str, host: str, master: str,
           devices: list[str]) -> None:
    unit["host"] = host
    unit["devices"] = devices
    unit["command"] = ["test-engine", "serve", "--api", engine, "--host", "0.0.0.0",  # noqa: S104
                       "--port", str(lu.port), "--model-dir", "/models",
                       "--master-addr", master, "--master-port", str(lu.master_port),
                       *lu.extra]
    unit["environment"] = {"NCCL_SOCKET_IFNAME": interface(host),
                           "GLOO_SOCKET_IFNAME": interface(host)}


def _masters(layout: Layout, hosts: list[str], addresses: dict[str, str]) -> list[str]:
    """Each unit's master address: the host of its service's first unit."""
    first: dict[str, str] = {}
    for lu, host in zip(layout.units, hosts, strict=True):
        first.setdefault(lu.service, addresses[host])
    return [first[lu.service] for lu in layout.units]


def capture_request(layout: Layout, image: str, digest: str, hosts: list[str],
                    models: dict[str, Path], output_dir: Path, addresses: dict[str, str],
                    validation: dict[str, str], adapter: dict[str, Any]) -> dict[str, Any]:
    """`models`: service -> the directory of its shards (one per worker of its world)."""
    units, workers = [], []
    by_service: dict[str, list[str]] = {}
    masters = _masters(layout, hosts, addresses)
    n = 0
    for u, (lu, host) in enumerate(zip(layout.units, hosts, strict=True)):
        unit: dict[str, Any] = {"id": f"unit-{u}", "index": u, "image": image,
                                "image_digest": digest,
                                "mounts": [{"source": str(models[lu.service]),
                                            "target": "/models", "read_only": True}]}
        _place(unit, lu, layout.engine, host, masters[u], [str(d) for d in range(lu.gpus)])
        units.append(unit)
        for slot in range(lu.gpus):
            wid = f"worker-{n}"
            n += 1
            workers.append({"id": wid, "unit": unit["id"], "service": lu.service,
                            "process_slot": slot, "device_slots": [slot]})
            by_service.setdefault(lu.service, []).append(wid)
    ids = [w["id"] for w in workers]
    groups = [{"id": f"{s}-world" if len(by_service) > 1 else "world",
               "kind": f"{layout.engine}:world", "service": s, "members": members}
              for s, members in by_service.items()]
    groups += [{"id": gid, "kind": f"{layout.engine}:{kind}", "service": s,
                "members": [ids[i] for i in idx]} for gid, kind, s, idx in layout.groups]
    services = [{"id": s, "role": layout.roles.get(s, f"{layout.engine}:serve"),
                 "workers": members} for s, members in by_service.items()]
    # Each service's shards are numbered by its own world rank.
    files = {wid: f"shard-{r:05d}-of-{len(m):05d}.bin"
             for m in by_service.values() for r, wid in enumerate(m)}
    return {
        "format": 4, "kind": "coldsnap-operation-request", "operation": "capture",
        "id": f"{layout.name}-capture", "snapshot_driver": {"id": "n610"},
        "output": str(output_dir / f"{layout.name}-capture.json"),
        "policy": {"weights": {"native": {"files_by_worker": files}}},
        "launch": {
            "engine": layout.engine,
            "model": {"id": f"coldsnap-test/{layout.name}", "revision": "dev",
                      "source": "local"},
            "units": units,
            "execution": {"workers": workers, "groups": groups, "services": services,
                          "adapter": adapter},
        },
        "validation": validation,
    }


def restore_request(layout: Layout, capture: dict[str, Any], hosts: list[str],
                    addresses: dict[str, str], suffix: str = "restore-moved"
                    ) -> dict[str, Any]:
    """The capture placed on `hosts` (one per unit), each unit's devices in reverse order."""
    launch = json.loads(json.dumps(capture["launch"]))
    masters = _masters(layout, hosts, addresses)
    for unit, lu, host, master in zip(launch["units"], layout.units, hosts, masters,
                                      strict=True):
        _place(unit, lu, layout.engine, host, master, list(reversed(unit["devices"])))
    return {"format": 4, "kind": "coldsnap-operation-request", "operation": "restore",
            "id": f"{capture['id']}-{suffix}", "snapshot_driver": capture["snapshot_driver"],
            "artifact": capture["id"], "launch": launch, "validation": capture["validation"]}
