"""ColdSnap's public formats: request 4, artifact 9, receipt 2, timing 1, canonical JSON.

Pure: no I/O beyond reading the one file `load_request` (or `documents.read_document`) is
given, no asyncio. Modules: `canonical` (canonical JSON, `sha256:` digests), `errors`
(`ValidationIssue`, `RequestInvalid`), `fields` (the field types every format shares),
`engines` (`EngineName`, the engines ColdSnap knows), `documents` (the strict YAML/JSON
decoder), `request` (a package), `artifact`, `receipt`, `timing`, `replay`.
"""

from coldsnap.formats.canonical import canonical_json, digest
from coldsnap.formats.errors import RequestInvalid, ValidationIssue
from coldsnap.formats.request import Request, load_request, parse_request, request_sha256

__all__ = [
    "Request",
    "RequestInvalid",
    "ValidationIssue",
    "canonical_json",
    "digest",
    "load_request",
    "parse_request",
    "request_sha256",
]
