"""CRIU's own error lines, read from its log inside the unit's container."""

from __future__ import annotations

from typing import Any

from coldsnap.capsule.session import CapsuleSession

# CRIU prints these on every run in a container without CAP_SYS_RESOURCE;
# they never decide success, so they are left out of error messages.
HARMLESS_CRIU_ERRORS = ("Unable to create tun", "Can't setup RLIMIT_NOFILE",
                        "Can't keep kdat cache")


# The log's end, in bytes: a line count alone would let one endless line be read whole.
_LOG_TAIL_BYTES = 64 * 1024


async def criu_errors(s: CapsuleSession, container: Any, log_path: str) -> str:
    out = await s.exec(container, ["/usr/bin/tail", "-c", str(_LOG_TAIL_BYTES), log_path],
                       output_limit=_LOG_TAIL_BYTES)
    lines = [ln for ln in out.stdout_tail.splitlines()[-200:]
             if "Error" in ln and not any(h in ln for h in HARMLESS_CRIU_ERRORS)]
    return "\n".join(lines[-12:]) or out.tail(800) or "(no CRIU log)"
