"""Services, one by one: how an error names the service a unit belongs to, and the validation
prompt sent to every service on its own serving unit and port.

A request may hold several services (data-parallel replicas, a prefill and a decode service),
each its own world group and serving port. Each is validated on its own, all at once, each
within its own timeout: one that does not answer fails the operation (whose rollback then
removes every unit of every service), and the error says which service, on which units and
hosts, while the receipt says for each service whether it answered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from coldsnap.capsule.engine_steps import endpoint, validate
from coldsnap.formats.receipt import ServiceAnswer, reply_excerpt
from coldsnap.operations.context import OperationContext, OperationFailed
from coldsnap.operations.unit_runs import UnitRun, explain
from coldsnap.operations.units import service_heads
from coldsnap.topology import Topology

# What one service gets to answer: its readiness probe polled until 200, then the prompt.
# A restored engine rebuilds its groups and, when its quiesce released them, reloads its
# weights before it is ready.
VALIDATE_TIMEOUT_S = 120.0
# Beyond a service's own timeout, for the calls that carry it (one SSH round trip per poll):
# a host that stops answering still ends the service's validation.
_TRANSPORT_GRACE_S = 15.0


@dataclass(frozen=True)
class ServiceUnits:
    service: str
    units: tuple[str, ...]  # in the order of their first rank
    hosts: tuple[str, ...]  # the units' hosts, in the same order, each once

    def label(self) -> str:
        """`service decode (units u2,u3 on host-2,host-3)`."""
        return (f"service {self.service} (unit{'s' if len(self.units) > 1 else ''} "
                f"{','.join(self.units)} on {','.join(self.hosts)})")


def services_units(topology: Topology) -> list[ServiceUnits]:
    """Every service with the units its workers run in, in request order."""
    out = []
    for service in topology.services:
        ranked = sorted((topology.worker(w) for w in service.workers),
                        key=lambda w: (w.global_rank, w.id))
        units = tuple(dict.fromkeys(w.unit for w in ranked))
        hosts = tuple(dict.fromkeys(w.host for w in ranked))
        out.append(ServiceUnits(service.id, units, hosts))
    return out


def unit_labels(topology: Topology) -> dict[str, str]:
    """unit id -> the service(s) it serves, as an error names them (OperationContext.
    unit_services: a failed step of a unit names its service first)."""
    labels: dict[str, list[str]] = {}
    for s in services_units(topology):
        for unit in s.units:
            labels.setdefault(unit, []).append(s.label())
    return {unit: "; ".join(names) for unit, names in labels.items()}


def failure_message(failed: Sequence[tuple[ServiceUnits, str]],
                    answered: Sequence[str]) -> str:
    """`service decode (units u2,u3 on host-2,host-3): validation failed: WHY`, one per
    service that failed, then which services did answer."""
    text = "; ".join(f"{s.label()}: validation failed: {why}" for s, why in failed)
    if answered:
        text += f" (answered: {', '.join(answered)})"
    return text


def answers_line(answers: Sequence[ServiceAnswer]) -> str:
    """The human line: which services answered, where and how fast, and which did not."""
    def one(a: ServiceAnswer) -> str:
        return f"{a.service} (unit {a.unit} on {a.host}, {a.address}, {a.seconds:.1f} s)"

    ok = [one(a) for a in answers if a.answered]
    text = (f"service{'s' if len(ok) > 1 else ''} {', '.join(ok)} answered the validation "
            "prompt") if ok else "no service answered the validation prompt"
    missing = [a.service for a in answers if not a.answered]
    return text + (f"; not answered: {', '.join(missing)}" if missing else "")


async def validate_services(ctx: OperationContext, runs: Sequence[UnitRun],
                            topology: Topology, *,
                            timeout_s: float = VALIDATE_TIMEOUT_S) -> list[ServiceAnswer]:
    """Send every service its validation prompt on the unit that holds its first world rank
    (where the engine adapter serves it), all services at once, each within `timeout_s`.
    Every answer is kept on `ctx.record.services` (the receipt's `result.services`, also when one
    failed); raises OperationFailed "validate-failed" naming each service that did not
    answer."""
    heads = service_heads(topology)
    by_unit = {r.placed.unit_id: r for r in runs}
    # Only the services whose head is among `runs` (a repair wakes some units only).
    services = [s for s in services_units(topology) if heads[s.service] in by_unit]

    async def one(s: ServiceUnits) -> tuple[ServiceAnswer, str | None]:
        run = by_unit[heads[s.service]]
        _, ep = endpoint(run.session, run.started)
        t0 = time.monotonic()
        error: str | None = None
        text = ""
        with ctx.span(f"{ctx.operation}.validate", host=run.placed.host,
                      unit=run.placed.unit_id, service=s.service):
            try:
                async with asyncio.timeout(timeout_s + _TRANSPORT_GRACE_S):
                    text = (await validate(run.session, run.started, timeout_s=timeout_s)).text
            except TimeoutError:
                error = (f"no answer from {ep.address}:{ep.port} on host {run.placed.host} "
                         f"within {timeout_s + _TRANSPORT_GRACE_S:.0f} s")
            except Exception as exc:
                error = explain(exc)
        answer = ServiceAnswer(service=s.service, units=list(s.units), unit=run.placed.unit_id,
                               host=run.placed.host, address=f"{ep.address}:{ep.port}",
                               answered=error is None, seconds=time.monotonic() - t0,
                               reply=reply_excerpt(text if error is None else error))
        return answer, error

    results = await asyncio.gather(*(one(s) for s in services))
    answers = [a for a, _ in results]
    ctx.record.services = answers
    failed = [(s, why) for s, (_, why) in zip(services, results, strict=True)
              if why is not None]
    if failed:
        raise OperationFailed("validate-failed", failure_message(
            failed, [a.service for a in answers if a.answered]))
    return answers
