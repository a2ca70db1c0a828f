"""The test engine's groups beyond the world group (engine_groups.py) and its SGLang
prefill/decode pair, as local processes on 127.0.0.1: every group the identity lists is
formed over TCP, every completion crosses each of them, and a member that cannot reach one of
its groups (or a decode its prefill) cannot answer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.unit.test_test_engine import (
    ANSWER,
    PROMPT,
    TCP_LISTEN,
    Engine,
    free_ports,
    make_engine,
    make_model,
    tcp_sockets,
    wait_for,
)

__all__ = ["make_engine"]  # the fixture, shared with test_test_engine.py

GPUS = [f"GPU-{i:04d}" for i in range(8)]


def unit_env(unit: str, workers: list[dict[str, Any]], groups: list[dict[str, Any]],
             services: list[dict[str, Any]]) -> dict[str, str]:
    peers = [{"id": w["id"], "unit": u, "service": w.get("service", "engine"),
              "global_rank": w["global_rank"], "host_address": "127.0.0.1"}
             for u, ws in UNITS.items() for w in ws]
    return {"COLDSNAP_SIMULATED_GPUS": ",".join(GPUS),
            "COLDSNAP_UNIT": json.dumps({
                "unit_id": unit, "devices": [GPUS[w["global_rank"]] for w in workers],
                "workers": [{**w, "device_slots": [slot]} for slot, w in enumerate(workers)],
                "groups": groups, "services": services, "peers": peers})}


def w(i: int, rank: int, world: int, service: str = "engine") -> dict[str, Any]:
    return {"id": f"w{rank}" if service == "engine" else f"{service}-w{rank}",
            "global_rank": rank, "world_size": world, "process_slot": i, "service": service}


# TP2 x PP2 over two units: u0 holds the first pipeline stage's tensor group, u1 the second's.
UNITS: dict[str, list[dict[str, Any]]] = {}
PP_GROUPS = [
    {"id": "world", "kind": "vllm:world", "service": "engine", "members": ["w0", "w1", "w2", "w3"]},
    {"id": "tp-0", "kind": "vllm:tensor", "service": "engine", "members": ["w0", "w1"]},
    {"id": "tp-1", "kind": "vllm:tensor", "service": "engine", "members": ["w2", "w3"]},
    {"id": "pp-0", "kind": "vllm:pipeline", "service": "engine", "members": ["w0", "w2"]},
    {"id": "pp-1", "kind": "vllm:pipeline", "service": "engine", "members": ["w1", "w3"]},
]
ENGINE_SERVICE = [{"id": "engine", "role": "vllm:serve", "workers": ["w0", "w1", "w2", "w3"]}]


def test_every_group_is_formed_and_crossed_by_each_completion(
        tmp_path: Path, make_engine: Callable[..., Engine]) -> None:
    model = make_model(tmp_path, 4)
    p0, p1, master = free_ports(3)
    UNITS.clear()
    UNITS.update(u0=[w(0, 0, 4), w(1, 1, 4)], u1=[w(0, 2, 4), w(1, 3, 4)])
    u0 = make_engine("u0", UNITS["u0"], model, p0, master,
                     env=unit_env("u0", UNITS["u0"], PP_GROUPS, ENGINE_SERVICE))
    u1 = make_engine("u1", UNITS["u1"], model, p1, master,
                     env=unit_env("u1", UNITS["u1"], PP_GROUPS, ENGINE_SERVICE))
    for e in (u0, u1):
        e.wait_up()
    for e in (u0, u1):
        e.wait_healthy()
    assert u0.http("POST", "/v1/completions", {"prompt": PROMPT})[1]["choices"][0]["text"] \
        == ANSWER
    # Each group's leader listens at master port + 1 + its index among the non-world groups:
    # tp-0 (w0, u0) +1, tp-1 (w2, u1) +2, pp-0 (w0) +3, pp-1 (w1, u0's second worker) +4.
    listening = {pid: {s[1] for s in tcp_sockets(pid) if s[0] == TCP_LISTEN}
                 for pid in u0.workers + u1.workers}
    assert listening[u0.workers[0]] == {master, master + 1, master + 3}
    assert listening[u0.workers[1]] == {master + 4}
    assert listening[u1.workers[0]] == {master + 2}

    # u1 told (by a placement) that w1 lives where nothing listens: w3 cannot reach pp-1, its
    # world group is intact, and no completion is answered; the error names the group.
    for e in (u0, u1):
        assert e.http("POST", "/sleep?level=1")[0] == 200
    u1.place(master_port=master, workers=[
        {"id": f"w{r}", "global_rank": r, "unit": "u0" if r < 2 else "u1",
         "host_address": "127.0.0.2" if r == 1 else "127.0.0.1"} for r in range(4)])
    for e in (u0, u1):
        assert e.http("POST", "/wake_up")[0] == 200
    assert u1.health() == 503
    # The world group's ranks reconnect after the wake too, and until they have, a completion
    # fails on the world group; once they have, the failure is pp-1's. Never an answer.
    answers: list[tuple[int, Any]] = []

    def pp1_named() -> bool:
        answers.append(u0.http("POST", "/v1/completions", {"prompt": PROMPT}))
        code, body = answers[-1]
        assert code == 503, answers[-1]
        return "pp-1" in body["error"]["message"]

    wait_for("the completion's error to name pp-1", pp1_named)
    # put right: the group forms again and completions are answered
    assert u1.http("POST", "/sleep?level=1")[0] == 200
    u1.place(master_port=master)
    assert u1.http("POST", "/wake_up")[0] == 200
    for e in (u0, u1):
        e.wait_healthy()
    assert u0.http("POST", "/v1/completions", {"prompt": PROMPT})[0] == 200
    # every group socket closes on sleep, the other groups' too
    assert u0.http("POST", "/sleep?level=1")[0] == 200
    assert all(not tcp_sockets(pid) for pid in u0.workers)


def test_a_decode_needs_its_prefill(tmp_path: Path, make_engine: Callable[..., Engine]) -> None:
    model = make_model(tmp_path, 1)
    pp, dp, pm, dm, boot = free_ports(5)
    groups = [{"id": "prefill-world", "kind": "sglang:world", "service": "prefill",
               "members": ["prefill-w0"]},
              {"id": "decode-world", "kind": "sglang:world", "service": "decode",
               "members": ["decode-w0"]}]
    services = [{"id": "prefill", "role": "sglang:prefill", "workers": ["prefill-w0"]},
                {"id": "decode", "role": "sglang:decode", "workers": ["decode-w0"]}]
    UNITS.clear()
    UNITS.update(prefill=[w(0, 0, 1, "prefill")], decode=[w(0, 0, 1, "decode")])
    prefill = make_engine("prefill", UNITS["prefill"], model, pp, pm, api="sglang",
                          env=unit_env("prefill", UNITS["prefill"], groups, services),
                          args=("--disaggregation-mode", "prefill",
                                "--disaggregation-bootstrap-port", str(boot)))
    decode = make_engine("decode", UNITS["decode"], model, dp, dm, api="sglang",
                         env=unit_env("decode", UNITS["decode"], groups, services),
                         args=("--disaggregation-mode", "decode",
                               "--disaggregation-bootstrap-port", str(boot)))
    for e in (prefill, decode):
        e.wait_up()
        e.wait_healthy()
    code, body = decode.http("POST", "/generate", {"text": PROMPT})
    assert code == 200 and body["text"] == ANSWER
    # the prefill asleep: the decode cannot answer, and says why
    assert prefill.http("POST", "/release_memory_occupation", {})[0] == 200
    code, body = decode.http("POST", "/generate", {"text": PROMPT})
    assert code == 503 and "prefill prefill-w0" in body["error"]["message"], body
