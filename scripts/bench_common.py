"""Helpers shared by the scripts/bench_*.py benchmarks."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coldsnap.logs import configure as _configure_logging  # noqa: E402
from devtools.layout import UsageError, host_index  # noqa: E402
from devtools.session import ClusterUnfit, dev_cluster  # noqa: E402

# stdout carries exactly one JSON line; logs go to stderr.
_configure_logging(stream=sys.stderr)

# COLDSNAP_BENCH_SMOKE=1 (or `scripts/bench NAME --smoke`): every benchmark runs one round of
# MiB of state in seconds, so that the test suite can check each still runs and prints every
# figure (tests/integration/test_bench_smoke.py); the real sizes stay the defaults.
SMOKE = os.environ.get("COLDSNAP_BENCH_SMOKE", "") not in ("", "0")
# Where emit() appends its line: bench-results/ in the repository unless
# COLDSNAP_BENCH_RESULTS names another directory (the smoke tests' tmp path: their lines are
# no measurement and must not land among the real ones).
RESULTS_ENV = "COLDSNAP_BENCH_RESULTS"
T = TypeVar("T")


def sized(real: T, smoke: T) -> T:
    """A benchmark's default: `smoke` in a smoke run, else `real`."""
    return smoke if SMOKE else real


def results_dir() -> Path:
    return Path(os.environ.get(RESULTS_ENV) or REPO / "bench-results")


def git_rev() -> str | None:
    r = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return r.stdout.strip() or None


def emit(name: str, doc: dict[str, Any]) -> None:
    """One JSON line on stdout, appended to <results_dir()>/<name>.jsonl as well
    (bench-results/ unless COLDSNAP_BENCH_RESULTS says otherwise)."""
    doc = {
        "bench": name,
        "at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git": git_rev(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpu",
        # A loaded machine slows a cold start and a restore differently: a reader of the line
        # needs to know whether anything else ran (1, 5 and 15 minute averages at the end).
        "load_average": [round(x, 2) for x in os.getloadavg()],
        **({"smoke": True} if SMOKE else {}),
        **doc,
    }
    line = json.dumps(doc, sort_keys=False)
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.jsonl", "a") as f:
        f.write(line + "\n")
    print(line, flush=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def cluster_inventory(
    inventory: Path | None, host_names: list[str], *, docker: bool
) -> Iterator[Path]:
    """The inventory to benchmark against. An explicit `inventory` is used as it is. Otherwise
    the dev cluster: when it is not running, enough hosts for `host_names` are started (with
    Docker and the test capsule when `docker`) and stopped again at the end; a running one is
    used and left running."""
    if inventory is not None:
        yield inventory
        return
    try:
        hosts = max(host_index(n) for n in host_names) + 1
    except UsageError as exc:
        raise SystemExit(f"{exc}: without --inventory the hosts are the dev cluster's") from None
    try:
        with dev_cluster(hosts, docker=docker) as path:
            yield path
    except ClusterUnfit as exc:
        raise SystemExit(f"bench: {exc}") from None


def push_blob(registry: str, repository: str, path: Path, digest: str, size: int) -> bool:
    """`path` pushed as blob `digest` of `repository` on a plain-HTTP registry (the dev
    cluster's), in one monolithic upload; False when the registry holds it already (a blob
    there is kept, so a benchmark pushes its bytes once)."""
    base = f"http://{registry}/v2/{repository}/blobs/"
    head = urllib.request.Request(base + digest, method="HEAD")
    try:
        with urllib.request.urlopen(head, timeout=10):
            return False
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise
    post = urllib.request.Request(base + "uploads/", method="POST", data=b"")
    with urllib.request.urlopen(post, timeout=30) as r:
        location = r.headers["Location"]
    url = urllib.parse.urljoin(base, location)
    url += ("&" if "?" in url else "?") + f"digest={digest}"
    with open(path, "rb") as f:
        put = urllib.request.Request(url, method="PUT", data=f, headers={
            "Content-Length": str(size), "Content-Type": "application/octet-stream"})
        with urllib.request.urlopen(put, timeout=1800):
            pass
    return True
