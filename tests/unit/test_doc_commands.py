"""The commands README.md and docs/*.md tell a newcomer to run: every `scripts/...` they name
exists, and each answers --help (exit 0, no traceback) from a fresh shell, i.e. without the
venv on PATH (issue 37: scripts/dev-requests needed it); so does each `scripts/bench NAME`
they name. Run before `scripts/dev-cluster up`, dev-requests says what to run first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPT = re.compile(r"(?<![\w./-])scripts/([A-Za-z0-9_.-]*[A-Za-z0-9_])")
BENCH = re.compile(r"(?<![\w./-])scripts/bench ([a-z][a-z0-9_]*)")
# A fresh login shell's PATH: the system's tools, not the project's venv.
FRESH_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}


def named(pattern: re.Pattern[str]) -> dict[str, list[str]]:
    """Each name the pattern finds in the docs -> the docs that name it."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for name in sorted(set(pattern.findall(doc.read_text()))):
            found.setdefault(name, []).append(doc.name)
    return found


SCRIPTS = named(SCRIPT)
BENCHES = named(BENCH)


def test_the_docs_name_scripts_and_benchmarks() -> None:
    assert {"dev-cluster", "dev-requests", "test", "bench"} <= set(SCRIPTS)
    assert BENCHES


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_script_the_docs_name_exists(name: str) -> None:
    assert (REPO / "scripts" / name).is_file(), f"scripts/{name}, named in {SCRIPTS[name]}"


def _help(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(REPO / "scripts" / argv[0]), *argv[1:], "--help"], cwd="/",
                          env=FRESH_ENV, capture_output=True, text=True, timeout=120,
                          check=False)


@pytest.mark.parametrize("name", sorted(n for n in SCRIPTS if not n.endswith(".py")))
def test_every_script_the_docs_name_answers_help_from_a_fresh_shell(name: str) -> None:
    assert os.access(REPO / "scripts" / name, os.X_OK), f"scripts/{name} is not executable"
    r = _help(name)
    assert r.returncode == 0, f"scripts/{name} --help exited {r.returncode}:\n{r.stderr}"
    assert "Traceback" not in r.stderr and (r.stdout + r.stderr).strip()


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_benchmark_the_docs_name_answers_help(name: str) -> None:
    assert (REPO / "scripts" / f"bench_{name}.py").is_file(), \
        f"scripts/bench {name}, named in {BENCHES[name]}"
    r = _help("bench", name)
    assert r.returncode == 0, f"scripts/bench {name} --help exited {r.returncode}:\n{r.stderr}"
    assert "usage" in r.stdout


def test_dev_requests_before_the_cluster_is_up_says_what_to_run(tmp_path: Path) -> None:
    r = subprocess.run([str(REPO / "scripts" / "dev-requests")], cwd="/", capture_output=True,
                       text=True, timeout=120, check=False,
                       env={**FRESH_ENV, "COLDSNAP_DEV_CLUSTER_DIR": str(tmp_path)})
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "scripts/dev-cluster up" in r.stderr


def test_dev_requests_runs_with_the_venv_from_a_fresh_shell(tmp_path: Path) -> None:
    """Its imports (yaml, numpy) are the venv's: started by whatever python3 a fresh shell
    finds, it must hand over to the venv's Python before reaching them. That python3 here
    sees no site-packages at all (a machine whose system Python lacks yaml and numpy)."""
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").write_text('#!/bin/sh\nexec /usr/bin/python3 -S "$@"\n')
    (bare / "python3").chmod(0o755)
    (tmp_path / "inventory.yaml").write_text(
        "hosts:\n- {name: host-0, address: 198.18.0.2}\n- {name: host-1, address: 198.18.0.3}\n")
    ref = "127.0.0.1:5000/coldsnap/test-capsule@sha256:" + "ab" * 32
    r = subprocess.run([str(REPO / "scripts" / "dev-requests"), "--capsule", ref,
                        "--shard-bytes", "4096"], cwd="/", capture_output=True, text=True,
                       timeout=300, check=False,
                       env={**FRESH_ENV, "PATH": f"{bare}:{FRESH_ENV['PATH']}",
                            "COLDSNAP_DEV_CLUSTER_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "requests" / "tp2-two-hosts.yaml").is_file()


def test_the_docs_curl_to_the_dev_vllm_sends_its_api_key() -> None:
    """The dev vLLM answers 401 without the key scripts/dev-requests gives it."""
    key = re.search(r'VLLM_CPU_API_KEY = "([^"]+)"',
                    (REPO / "scripts" / "dev-requests").read_text())
    assert key is not None
    for doc in DOCS:
        text = doc.read_text()
        for block in re.findall(r"```.*?```", text, re.S):
            if "tiny-llama" in block and "curl" in block and "/v1/" in block:
                assert f"Authorization: Bearer {key.group(1)}" in block, doc.name


def _coldsnapd_lines() -> dict[tuple[str, ...], set[str]]:
    """The docs' shell blocks' `coldsnapd SUB... --flag ...` lines: subcommand -> flags."""
    found: dict[tuple[str, ...], set[str]] = {}
    for doc in DOCS:
        for block in re.findall(r"```[^\n]*\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                m = re.match(r"^(?:\.venv/bin/)?coldsnapd\s+(.*)$", line.split(" #")[0].strip())
                if not m:
                    continue
                tokens = m.group(1).split()
                words: list[str] = []
                for t in tokens:
                    if not re.fullmatch(r"[a-z][a-z-]*", t):
                        break  # a flag, a path, `a|b` alternatives, a redirection
                    words.append(t)
                if words:
                    found.setdefault(tuple(words), set()).update(
                        t.split("=")[0] for t in tokens if t.startswith("--"))
    return found


COLDSNAPD = _coldsnapd_lines()


@pytest.mark.parametrize("words", sorted(COLDSNAPD), ids=" ".join)
def test_every_coldsnapd_line_in_the_docs_uses_flags_it_has(words: tuple[str, ...]) -> None:
    r = subprocess.run([sys.executable, "-m", "coldsnap", *words, "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, f"coldsnapd {' '.join(words)} --help:\n{r.stderr}"
    missing = sorted(f for f in COLDSNAPD[words] if f not in r.stdout)
    assert missing == [], f"coldsnapd {' '.join(words)} has no {missing}"
