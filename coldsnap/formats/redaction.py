"""Secrets taken out of a document before anyone but its author may see it: what the service
stores of a request (its job store), the job views it serves, the receipts it shows.

Redacted, each replaced by `REDACTED`:
- every value of a mapping under the key `environment` (a unit's environment: engines take
  their tokens there);
- every string under a key that contains `token`, `key`, `secret` or `password` (any case),
  anywhere in the document, also inside the lists and mappings such a key holds;
- in a list of strings (a command line), the value after a flag whose name matches, and the
  value of `--flag=value`.

Only strings are replaced, so a redacted document keeps its shape and types: a receipt stays a
valid receipt. A request's sha256 is always that of the full request, computed before this.

A publication to a registry withholds the same secrets from every document it carries
(`coldsnap.formats.publication`), with this module's `redact` and `redact_argv`.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"

_SECRET_KEY = re.compile(r"token|key|secret|password", re.IGNORECASE)
_SECRET_FLAG = re.compile(r"^-{1,2}[A-Za-z0-9_.-]*(token|key|secret|password)[A-Za-z0-9_.-]*"
                          r"(=.*)?$", re.IGNORECASE)


def secret_key(key: str) -> bool:
    """Whether a value under `key` is taken for a secret."""
    return _SECRET_KEY.search(key) is not None


def redact(doc: Any) -> Any:
    """A copy of `doc` (decoded JSON) with its secrets replaced by REDACTED."""
    return _walk(doc, secret=False)


def _walk(value: Any, *, secret: bool) -> Any:
    if isinstance(value, str):
        return REDACTED if secret else value
    if isinstance(value, dict):
        return {k: _walk(v, secret=secret or k == "environment" or secret_key(str(k)))
                for k, v in value.items()}
    if isinstance(value, list):
        if secret:
            return [_walk(v, secret=True) for v in value]
        return redact_argv(value)
    return value


def redact_argv(items: list[Any]) -> list[Any]:
    """A list's items, with the values of secret-looking flags redacted."""
    out: list[Any] = []
    after_flag = False
    for item in items:
        if isinstance(item, str):
            flag = _SECRET_FLAG.match(item)
            if after_flag and not item.startswith("-"):
                out.append(REDACTED)
                after_flag = False
                continue
            if flag and flag.group(2):
                out.append(item.split("=", 1)[0] + "=" + REDACTED)
                after_flag = False
                continue
            after_flag = flag is not None
            out.append(item)
        else:
            after_flag = False
            out.append(_walk(item, secret=False))
    return out


# A value shorter than this is not looked for in free text: replacing every "0" or "true" of
# a log line would hide what it says, and a credential is never that short.
MIN_SCRUBBED = 8


def secret_values(doc: Any) -> tuple[str, ...]:
    """The strings `redact` would replace in `doc` that are long enough to look for in free
    text (log lines, error messages), longest first so that no shorter one cuts a longer."""
    found: set[str] = set()
    _collect(doc, redact(doc), found)
    return tuple(sorted((v for v in found if len(v) >= MIN_SCRUBBED), key=len, reverse=True))


def _collect(full: Any, redacted: Any, found: set[str]) -> None:
    if isinstance(full, str):
        if redacted == REDACTED and full != REDACTED:
            found.add(full)
        elif isinstance(redacted, str) and redacted.endswith("=" + REDACTED):
            found.add(full.split("=", 1)[1])
    elif isinstance(full, dict) and isinstance(redacted, dict):
        for k, v in full.items():
            _collect(v, redacted.get(k), found)
    elif isinstance(full, list) and isinstance(redacted, list):
        for a, b in zip(full, redacted, strict=False):
            _collect(a, b, found)


def scrub(text: str, values: tuple[str, ...]) -> str:
    """`text` with every occurrence of the secret `values` replaced by REDACTED."""
    for value in values:
        if value in text:
            text = text.replace(value, REDACTED)
    return text


def scrub_doc(doc: Any, values: tuple[str, ...]) -> Any:
    """Every string in `doc` scrubbed of `values` (a receipt's error message, say)."""
    if not values:
        return doc
    if isinstance(doc, str):
        return scrub(doc, values)
    if isinstance(doc, dict):
        return {k: scrub_doc(v, values) for k, v in doc.items()}
    if isinstance(doc, list):
        return [scrub_doc(v, values) for v in doc]
    return doc
