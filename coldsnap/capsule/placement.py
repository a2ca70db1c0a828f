"""The restore placement (the new hosts, master, transport variables) written where a
restored engine reads it on wake, before CRIU brings it back or once it runs."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from coldsnap.capsule.errors import RestoreFailed
from coldsnap.capsule.handle import UnitHandle
from coldsnap.capsule.runtime_files import put_runtime_file, seed_runtime_file
from coldsnap.capsule.session import CapsuleSession
from coldsnap.capsule.spec import PLACEMENT_FILE

# A placement longer than this goes by put_archive (an argument may hold 128 KiB).
PLACEMENT_ARG_MAX = 96 * 1024


async def seed_placement(s: CapsuleSession, handle: UnitHandle,
                         placement: Mapping[str, Any]) -> None:
    """Write the restore placement into the unit's runtime directory before the engine is
    back: one Docker call and no exec, as only the container's init runs there yet, which
    never reads it. The engine reads it on wake; `deliver_placement` is for an engine that
    already runs."""
    await seed_runtime_file(s, handle, PLACEMENT_FILE, placement_bytes(placement),
                            step="placement", error=RestoreFailed)


async def deliver_placement(s: CapsuleSession, handle: UnitHandle,
                            placement: Mapping[str, Any]) -> None:
    """Write the restore placement into the unit's runtime directory, where the engine reads
    it on wake (CRIU brought back the captured argv and environment, which name the old hosts).
    """
    await put_runtime_file(s, handle, PLACEMENT_FILE, placement_bytes(placement),
                           step="placement", error=RestoreFailed)


def placement_bytes(placement: Mapping[str, Any]) -> bytes:
    return json.dumps(placement, sort_keys=True, indent=1).encode() + b"\n"

