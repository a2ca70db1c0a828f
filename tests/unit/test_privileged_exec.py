"""What every `docker exec` coldsnapd runs with the capsule's capabilities reads (issue 35,
finding 2): an empty environment plus coldsnapd's own values, a program by absolute path,
Python isolated, CRIU without a default configuration."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
from typing import Any

import pytest

from coldsnap.capsule import netlock, session
from coldsnap.capsule.session import LOADER_BLANK, CapsuleSession, trusted_argv
from coldsnap.capsule.spec import TRUSTED_EXEC_ENV
from coldsnap.hosts.base import TailBuffer

# What a request's `environment` (the container's) could hold to steer a privileged exec.
HOSTILE = {"CRIU_LIBS_DIR": "/tmp/plugins", "CRIU_CONFIG_FILE": "/tmp/evil.conf",
           "PYTHONPATH": "/tmp", "PYTHONUSERBASE": "/tmp/u", "HOME": "/root",
           "BASH_ENV": "/tmp/x", "PATH": "/tmp/bin:/usr/bin:/bin"}


def test_the_wrapped_program_sees_only_coldsnapds_environment() -> None:
    """Run here as Docker runs it: the container's environment plus Docker's exec
    environment, then the wrapper."""
    argv = trusted_argv(["/usr/bin/env"], {"COLDSNAP_CRIU_ACTION": "echo hi\nexit 0"})
    out = subprocess.run(argv, env={**HOSTILE, **LOADER_BLANK}, capture_output=True,
                         text=True, check=True).stdout
    seen = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert seen == {**TRUSTED_EXEC_ENV, "COLDSNAP_CRIU_ACTION": "echo hi"}
    assert "exit 0" in out
    assert TRUSTED_EXEC_ENV["HOME"] == "/nonexistent"


def test_the_loader_variables_are_blanked_for_env_itself() -> None:
    assert {"LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "GLIBC_TUNABLES"} <= set(LOADER_BLANK)
    assert set(LOADER_BLANK.values()) == {""}


@pytest.mark.parametrize("argv", [["sh", "-c", "true"], ["criu", "dump"], [], ["/x=y"]])
def test_a_program_not_named_by_absolute_path_is_refused(argv: list[str]) -> None:
    with pytest.raises(ValueError):
        trusted_argv(argv)


def test_the_session_runs_every_exec_wrapped_in_slash(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def fake_exec_tail(api: Any, cid: str, argv: list[str], **kw: Any) -> Any:
        calls.append({"argv": argv, **kw})
        return 0, TailBuffer(10), TailBuffer(10)

    monkeypatch.setattr(session, "exec_tail", fake_exec_tail)

    class _Container:
        id = "c1"

    s = CapsuleSession.__new__(CapsuleSession)

    async def call(fn: Any, *a: Any, **kw: Any) -> Any:
        return fn()

    s.call = call  # type: ignore[method-assign]
    s.target = None  # type: ignore[assignment]
    s.client = type("C", (), {"api": None})()
    monkeypatch.setattr(CapsuleSession, "host", property(lambda self: "h"))
    asyncio.run(s.exec(_Container(), ["/bin/sh", "-c", "true"], env={"K": "v"}))
    (call_,) = calls
    assert call_["argv"] == ["/usr/bin/env", "-i", "--", *(
        f"{k}={v}" for k, v in TRUSTED_EXEC_ENV.items()), "K=v", "/bin/sh", "-c", "true"]
    assert call_["environment"] == LOADER_BLANK and call_["workdir"] == "/"
    with pytest.raises(ValueError):
        asyncio.run(s.exec(_Container(), ["sh", "-c", "true"]))


def test_criu_runs_by_path_without_default_config_and_python_isolated() -> None:
    # (the package exports functions of the same names as these modules)
    criu_dump = importlib.import_module("coldsnap.capsule.criu_dump")
    criu_restore = importlib.import_module("coldsnap.capsule.criu_restore")
    criu_probe = importlib.import_module("coldsnap.capsule.criu_probe")
    scripts = [criu_dump.DUMP_SCRIPT, criu_restore._LAZY_RESTORE, criu_restore._FULL_RESTORE,
               criu_probe._PROBE]
    for script in scripts:
        words = script.replace(";", " ").split()
        at = [i for i, w in enumerate(words) if w.endswith("criu") and w != "criu-work"]
        assert at, script
        for i in at:
            assert words[i] == "/usr/sbin/criu" and words[i + 1] == "--no-default-config"
    assert "/usr/bin/python3 -I -c" in criu_restore._REWRITE
    assert netlock.lock_argv("coldsnap_x", [])[:2] == ["/usr/bin/python3", "-I"]
    assert "--leave-running" in criu_dump.DUMP_SCRIPT
