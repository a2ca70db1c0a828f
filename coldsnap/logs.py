"""Structured logging: one configuration for the CLI and the service.

Every line is bound to what it concerns (`operation_id`, `host`, `unit`, `worker`, `step`) by
the caller via `log.bind(...)`. On a terminal the lines are readable; otherwise they are JSON
lines on stderr. A processor drops values of keys that look like secrets, so that a careless
`bind(password=...)` cannot leak one.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

SECRET_MARKERS = ("password", "passphrase", "secret", "token", "private_key", "identity_data")


def _redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in list(event):
        lowered = key.lower()
        if any(marker in lowered for marker in SECRET_MARKERS):
            event[key] = "[redacted]"
    return event


def configure(
    *, verbose: bool = False, stream: TextIO | None = None, json: bool | None = None
) -> None:
    out = stream if stream is not None else sys.stderr
    as_json = (not out.isatty()) if json is None else json
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=out.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _redact,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.DEBUG if verbose else logging.INFO
        ),
        # Without an explicit stream, each logger writes to sys.stderr as it is when it is
        # made, not as it was at configure time (a test harness or a daemon may swap it).
        logger_factory=(structlog.PrintLoggerFactory(file=stream) if stream is not None
                        else _CurrentStderr()),
        cache_logger_on_first_use=False,
    )


class _CurrentStderr:
    def __call__(self, *args: Any) -> structlog.PrintLogger:
        return structlog.PrintLogger(sys.stderr)


def get_logger(**bound: Any) -> Any:
    return structlog.get_logger("coldsnap").bind(**bound)
