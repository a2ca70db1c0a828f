"""The exit statuses of every coldsnapd command: the status is what a caller such as Sparkrun
acts on, so each meaning has one number (README, "The CLI"); and the stderr line that says why
a command ends with one, for the CLI's commands and the service's own (`serve`) alike."""

from __future__ import annotations

import sys
from typing import Final

EXIT_OK: Final = 0
# The operation ran and failed (after its rollback), or a host could not be reached.
EXIT_FAILED: Final = 1
# The request, inventory, arguments or artifact reference are wrong, or the operation id is
# used already: nothing ran.
EXIT_BAD_INPUT: Final = 2
# `store verify` found objects whose bytes do not match their digest and left them in place.
EXIT_STORE_CORRUPT: Final = 3


def exit_status_for_signal(signum: int) -> int:
    """128 + the signal's number, as a shell reports a death by that signal: 130 for SIGINT,
    143 for SIGTERM."""
    return 128 + signum


def report_failure(message: str, status: int = EXIT_BAD_INPUT) -> int:
    """Print `coldsnapd: message` on stderr; return `status` for the command to exit with."""
    sys.stderr.write(f"coldsnapd: {message}\n")
    return status
