"""The contract between the CLI and the service, which never import each other: where the
service listens, the states a job goes through, and the options a job submission carries.

    POST /v1/jobs {"operation": "restore", "request": {...} | null, "wait": true,
                   "options": {"artifact": "REF", "prepare_only": false, ...}}
"""

from __future__ import annotations

from typing import Final

from coldsnap.runner.ledger import ACTIVE_STATES, OPERATION_STATES, OperationState

DEFAULT_SOCKET: Final = "/run/coldsnap/coldsnapd.sock"

# A job's state is its operation's, in the ledger's one state set (coldsnap.runner.ledger).
JobState = OperationState
JOB_STATES: tuple[JobState, ...] = OPERATION_STATES
ACTIVE: tuple[JobState, ...] = ACTIVE_STATES

# The RunOptions fields a submission may set (coldsnap.runner.prepared); the service checks
# each value's type and range, the CLI sends those its command has.
# `receipt_json` and `timing_events` are the paths the client writes its receipt and timing
# events to: the service only holds them to its policy (outputs.allow).
SUBMISSION_OPTIONS: Final = ("artifact", "prepare_only", "fallback", "stage_from", "json",
                             "verbose", "deadline", "validation_timeout", "receipt_json",
                             "timing_events")
