"""Helpers shared by the scripts/bench_*.py benchmarks."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coldsnap.logs import configure as _configure_logging  # noqa: E402

# stdout carries exactly one JSON line; logs go to stderr.
_configure_logging(stream=sys.stderr)


def git_rev() -> str | None:
    r = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return r.stdout.strip() or None


def emit(name: str, doc: dict[str, Any]) -> None:
    """One JSON line on stdout, appended to bench-results/<name>.jsonl as well."""
    doc = {
        "bench": name,
        "at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git": git_rev(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpu",
        **doc,
    }
    line = json.dumps(doc, sort_keys=False)
    out = REPO / "bench-results"
    out.mkdir(exist_ok=True)
    with open(out / f"{name}.jsonl", "a") as f:
        f.write(line + "\n")
    print(line, flush=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
