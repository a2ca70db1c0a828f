"""The capsule's confined launcher (`capsule-init launch`), run here as the capsule runs it:
what the engine it starts inherits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

LAUNCHER = Path(__file__).resolve().parents[2] / "deploy" / "capsule" / "capsule_init.py"


def test_the_engine_inherits_no_descriptor_above_stderr(tmp_path: Path) -> None:
    """`docker exec` hands the launcher descriptors of dockerd's mounts, which CRIU cannot
    dump in the engine: the launcher closes every one above 2 before the exec."""
    stdin, log, seen = tmp_path / "stdin", tmp_path / "log", tmp_path / "fds"
    stdin.write_text("")
    leaked = os.open(os.devnull, os.O_RDONLY)  # stands in for what docker exec leaves open
    try:
        out = subprocess.run(
            [sys.executable, str(LAUNCHER), "launch", "--pid-floor", "0", "--stdin", str(stdin),
             "--log", str(log), "--", sys.executable, "-c",
             f"import os; fds = sorted(os.listdir('/proc/self/fd'), key=int); "
             f"open({str(seen)!r}, 'w').write(' '.join(fds))"],
            pass_fds=(leaked,), capture_output=True, text=True, timeout=60, check=True)
    finally:
        os.close(leaked)
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while not (seen.exists() and seen.read_text()):  # the engine runs on after the launcher
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    fds = [int(fd) for fd in seen.read_text().split()]
    # 0-2 are the files the launcher opened, 3 is listdir's own directory
    assert fds == [0, 1, 2, 3], (pid, leaked, fds)


def test_the_engine_gets_the_environment_of_the_process_it_is_told(tmp_path: Path) -> None:
    """coldsnapd's execs run with a cleaned environment; `--environ-from PID` gives the
    engine PID's (in a capsule, PID 1's: the unit's request environment) instead."""
    stdin, log, seen = tmp_path / "stdin", tmp_path / "log", tmp_path / "env"
    stdin.write_text("")
    donor = subprocess.Popen(["sleep", "60"], env={"COLDSNAP_T": "the-unit's",
                                                   "PATH": os.environ["PATH"]})
    try:
        subprocess.run(
            [sys.executable, str(LAUNCHER), "launch", "--pid-floor", "0", "--stdin", str(stdin),
             "--log", str(log), "--environ-from", str(donor.pid), "--", sys.executable, "-c",
             f"import json, os; open({str(seen)!r}, 'w').write(json.dumps(dict(os.environ)))"],
            env={**os.environ, "COLDSNAP_T": "the-exec's", "LD_PRELOAD": ""},
            capture_output=True, text=True, timeout=60, check=True)
        deadline = time.monotonic() + 30
        while not (seen.exists() and seen.read_text()):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
    finally:
        donor.kill()
        donor.wait()
    env = json.loads(seen.read_text())
    assert env["COLDSNAP_T"] == "the-unit's"
    assert "LD_PRELOAD" not in env


def test_pid1_reaps_a_child_that_ends_while_it_waits_and_stops_on_sigterm() -> None:
    """capsule-init as PID 1 (a child subreaper here): a child that ends while it sleeps in
    sigwait is reaped (no zombie left), and SIGTERM ends it with status 0."""
    import ctypes
    import signal

    r, w = os.pipe()

    def become_init_with_a_child() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        if os.fork() == 0:  # the child it inherits: ends once the test closes the pipe
            # Only the pipe's read end stays open (Popen waits for its own error pipe).
            os.closerange(3, r)
            os.closerange(r + 1, 1 << 16)
            os.read(r, 1)
            os._exit(0)

    # (preexec_fn runs before the descriptors are closed: only the child keeps the pipe)
    proc = subprocess.Popen([sys.executable, str(LAUNCHER)],
                            preexec_fn=become_init_with_a_child)
    os.close(r)
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        deadline = time.monotonic() + 30
        while not children.read_text().split():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (child,) = children.read_text().split()
        os.close(w)  # the child ends now, while PID 1 waits
        while Path(f"/proc/{child}").exists():  # reaped: no zombie stays behind
            assert time.monotonic() < deadline, Path(f"/proc/{child}/stat").read_text()
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_engine_starts_with_the_environment_and_directory_of_environ_from(
        tmp_path: Path) -> None:
    """coldsnapd runs the launcher in / with an empty environment; `--environ-from PID`
    gives the engine that PID's environment and working directory (the container's)."""
    stdin, log, seen = tmp_path / "stdin", tmp_path / "log", tmp_path / "seen"
    stdin.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              cwd=tmp_path, env={"MARK": "container"})
    try:
        out = subprocess.run(
            ["/usr/bin/env", "-i", "--", sys.executable, str(LAUNCHER), "launch",
             "--pid-floor", "0", "--stdin", str(stdin), "--log", str(log),
             "--environ-from", str(holder.pid), "--", sys.executable, "-c",
             f"import os; open({str(seen)!r}, 'w').write(os.getcwd() + ' ' "
             f"+ os.environ.get('MARK', ''))"],
            cwd="/", capture_output=True, text=True, timeout=60, check=True)
        deadline = time.monotonic() + 30
        while not (seen.exists() and seen.read_text()):
            assert time.monotonic() < deadline, (out, log.read_text())
            time.sleep(0.01)
        assert seen.read_text() == f"{tmp_path} container"
    finally:
        holder.kill()
        holder.wait()
