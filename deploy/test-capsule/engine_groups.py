"""The groups of the ColdSnap test engine beyond the world group, and the prefill a decode
service needs: what a worker reads from its unit's identity and the placement.

The unit's identity (COLDSNAP_UNIT, written by coldsnapd from the request) carries the
request's `groups` ({id, kind, service, members}), `services` ({id, role, workers}) and
`peers` ({id, unit, service, global_rank, host_address} of every worker, at launch). A restore's
placement file lists the same workers with their new `host_address`; it wins once read.

Every group whose kind's name part is not `world` (tensor, pipeline, expert, context...) is
formed like the world group (engine_group.py): its member at position 0 leads it and listens
on (its host's address, port); the others connect there. The port is derived from the request
alone, so a restore that moves hosts changes only addresses: the service's master port + 1 +
the group's index among that service's non-world groups, in request order.

Python 3 standard library only: it runs inside the capsule.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Membership:
    """One worker's place in one non-world group."""

    group: str
    kind: str
    rank: int
    size: int
    leader: str  # the worker at position 0
    index: int  # among its service's non-world groups: the port offset

    def port(self, master_port: int) -> int:
        return master_port + 1 + self.index

    def who(self, worker: str) -> str:
        return f"worker {worker} (rank {self.rank} of {self.size} in group {self.group} " \
               f"{self.kind})"


def is_world(kind: str) -> bool:
    return kind.rpartition(":")[2] == "world"


def memberships(manifest: Mapping[str, Any], worker: str) -> list[Membership]:
    """The non-world groups `worker` belongs to, in request order."""
    out = []
    seen: dict[str, int] = {}
    for g in manifest.get("groups") or []:
        kind, service = str(g.get("kind", "")), str(g.get("service", ""))
        if is_world(kind):
            continue
        index = seen.get(service, 0)
        seen[service] = index + 1
        members = [str(m) for m in g.get("members") or []]
        if worker in members:
            out.append(Membership(str(g["id"]), kind, members.index(worker), len(members),
                                  members[0], index))
    return out


def addresses(manifest: Mapping[str, Any], placement: Mapping[str, Any] | None
              ) -> dict[str, str]:
    """worker id -> the address of its host: the placement's when one was read (a restore
    moved them), else the identity's from launch."""
    out = {str(p["id"]): str(p["host_address"]) for p in manifest.get("peers") or []
           if p.get("host_address")}
    for w in (placement or {}).get("workers") or []:
        if w.get("id") and w.get("host_address"):
            out[str(w["id"])] = str(w["host_address"])
    return out


def prefill_head(manifest: Mapping[str, Any]) -> str | None:
    """The worker at position 0 of the world group of the service whose role's name part is
    `prefill` (SGLang prefill/decode disaggregation), or None without one."""
    services: Sequence[Mapping[str, Any]] = manifest.get("services") or []
    prefill = next((str(s["id"]) for s in services
                    if str(s.get("role", "")).rpartition(":")[2] == "prefill"), None)
    if prefill is None:
        return None
    for g in manifest.get("groups") or []:
        if g.get("service") == prefill and is_world(str(g.get("kind", ""))) and g.get("members"):
            return str(g["members"][0])
    return None


def post_json(address: str, port: int, path: str, body: Mapping[str, Any],
              timeout: float) -> tuple[int, str]:
    """One HTTP POST of a JSON body: (status, body text)."""
    conn = http.client.HTTPConnection(address, port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        answer = conn.getresponse()
        return answer.status, answer.read().decode(errors="replace")
    finally:
        conn.close()
