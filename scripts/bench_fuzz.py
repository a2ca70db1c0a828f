"""Benchmark: how long the CLI fuzzers take at the case count CI runs.

    scripts/bench fuzz [--cases N]

Runs each fuzzer of tests/unit/test_fuzz_cli.py on its own (pytest, hypothesis profile `fuzz`
with COLDSNAP_FUZZ_CASES=N, default 10,000) and reports its wall-clock and CPU seconds: CI
promises 10,000 cases each in under 2 minutes. On a shared machine the CPU seconds say more
than the wall clock."""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

from bench_common import REPO, emit, log, sized

FUZZERS = {
    "requests": "test_requests_are_refused_with_exit_2_naming_a_path",
    "artifacts": "test_artifact_files_given_to_restore_are_refused_with_exit_2",
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench fuzz")
    parser.add_argument("--cases", type=int, default=sized(10_000, 5), help="cases per fuzzer")
    args = parser.parse_args()
    doc: dict[str, object] = {"cases_per_fuzzer": args.cases}
    for name, test in FUZZERS.items():
        log(f"fuzz {name}: {args.cases} cases")
        cpu0, t0 = _children_cpu(), time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             f"tests/unit/test_fuzz_cli.py::{test}"],
            cwd=REPO, env=dict(os.environ, COLDSNAP_FUZZ_CASES=str(args.cases)),
            capture_output=True, text=True, check=False)
        wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
        if proc.returncode != 0:
            log(proc.stdout[-4000:])
            raise SystemExit(f"fuzz {name} failed")
        doc[f"{name}_wall_s"] = round(wall, 1)
        doc[f"{name}_cpu_s"] = round(cpu, 1)
    emit("fuzz", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
