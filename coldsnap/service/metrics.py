"""The service's Prometheus metrics (prometheus_client), served at `GET /metrics` on the
socket and on `--metrics-listen`.

- `coldsnapd_jobs{operation,state}`: jobs in the job store, read from it at each scrape (so
  the figure survives restarts);
- `coldsnapd_operation_duration_seconds{operation,state}`: a histogram of finished jobs;
- `coldsnapd_staged_bytes_total{host}` and `coldsnapd_sent_bytes_total{host}`: bytes of the
  objects a restore staged on a host, and the part of them actually sent (the rest was there);
- `coldsnapd_rollback_units_total{operation,outcome}`: units a rollback undid, by outcome;
- `coldsnapd_host_reachable{host}`: 1 when the host answered the last SSH check, else 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coldsnap.formats.receipt import Receipt
from coldsnap.hosts.inventory import InventoryError, load_inventory
from coldsnap.hosts.pool import HostPool
from coldsnap.logs import get_logger
from coldsnap.operations.context import OperationContext
from coldsnap.runner.service_api import JOB_STATES
from coldsnap.service.job_store import JobStore

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_DURATION_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600)
HOST_CHECK_TIMEOUT_S = 20.0


class _JobCounts(Collector):
    def __init__(self, store: JobStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("coldsnapd_jobs", "Jobs in the job store, by operation and "
                                   "state", labels=["operation", "state"])
        counts = self.store.counts()
        for operation in sorted({op for op, _ in counts}):
            for state in JOB_STATES:
                family.add_metric([operation, state], counts.get((operation, state), 0))
        yield family


class Metrics:
    def __init__(self, store: JobStore) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_JobCounts(store))
        self.duration = Histogram(
            "coldsnapd_operation_duration_seconds", "Wall time of finished jobs",
            ["operation", "state"], buckets=_DURATION_BUCKETS, registry=self.registry)
        self.staged = Counter("coldsnapd_staged_bytes", "Bytes of the objects staged on a host",
                              ["host"], registry=self.registry)
        self.sent = Counter("coldsnapd_sent_bytes", "Bytes actually sent to a host",
                            ["host"], registry=self.registry)
        self.rollbacks = Counter("coldsnapd_rollback_units",
                                 "Units a rollback undid, by outcome", ["operation", "outcome"],
                                 registry=self.registry)
        self.reachable = Gauge("coldsnapd_host_reachable",
                               "1 when the host answered the last SSH check", ["host"],
                               registry=self.registry)

    def job_ended(self, receipt: Receipt, ctx: OperationContext) -> None:
        self.duration.labels(receipt.operation, receipt.state).observe(receipt.duration_seconds)
        for host, (staged, sent) in ctx.record.staged.items():
            self.staged.labels(host).inc(staged)
            self.sent.labels(host).inc(sent)
        for unit in ctx.record.rollback or ():
            self.rollbacks.labels(receipt.operation, unit.outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def watch_hosts(self, inventory_path: Path, interval_s: float) -> None:
        """Every `interval_s`, whether each inventory host answers over SSH (a `true` run
        on a fresh connection, HOST_CHECK_TIMEOUT_S at most)."""
        log = get_logger(component="host-check")
        while True:
            try:
                inventory = load_inventory(inventory_path)
            except InventoryError as exc:
                log.warning("host-check.inventory", error=str(exc))
            else:
                async with HostPool(inventory) as pool:
                    outcomes = await pool.gather(lambda h: h.run(["true"], timeout=10),
                                                 timeout=HOST_CHECK_TIMEOUT_S)
                for o in outcomes:
                    self.reachable.labels(o.host).set(1 if o.ok else 0)
            await asyncio.sleep(interval_s)
