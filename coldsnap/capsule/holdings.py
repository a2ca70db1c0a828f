"""What a host already holds, asked with one python start there: the digest of each staged
object (from its verified stamp, else hashed there) and whether each published CRIU image set
still verifies: the host-side helper's `holdings` mode (`coldsnap.hosts.helper`).

A restore asks this beside the host's facts, on every host, before anything is written: one
process for both questions spares a second python start and a second SSH channel per host, on
the path of every restore.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coldsnap.capsule.images import ImageSetError, image_set_dir, verify_plan
from coldsnap.formats.capsule import CriuImageSet
from coldsnap.hosts.base import Host
from coldsnap.hosts.helper import helper_argv
from coldsnap.hosts.helper.common import EXIT_ABSENT, EXIT_MISMATCH
from coldsnap.hosts.transfer.protocol import parse_stats

# Unstamped copies are hashed there, at disk speed: two minutes plus this rate bound the call.
_BYTES_PER_SECOND = 50 * 1024 * 1024


@dataclass(frozen=True)
class Survey:
    # path -> (size, "sha256:<hex>"), None where no regular file is
    files: dict[str, tuple[int, str] | None]
    # image set digest -> its published directory verified
    ready: dict[str, bool]


async def survey(host: Host, data_dir: str, paths: Mapping[str, int],
                 image_sets: Sequence[CriuImageSet] = ()) -> Survey:
    """Ask the host about `paths` (each with the size it should have, which bounds the time to
    hash an unstamped copy) and about `image_sets` published under `data_dir`, in one call.
    Nothing is written, except that a published directory whose bytes differ from its set is
    removed (it would only ever be refused)."""
    roots = {st.digest: image_set_dir(data_dir, st) for st in image_sets}
    request = {"paths": list(paths),
               "sets": [[roots[st.digest], verify_plan(st)] for st in image_sets]}
    hashed_at_most = sum(paths.values()) + sum(st.total_bytes for st in image_sets)
    res = await host.run(helper_argv("holdings"), input=json.dumps(request).encode(),
                         timeout=120.0 + hashed_at_most / _BYTES_PER_SECOND, check=False)
    if res.exit_status != 0:
        raise ImageSetError(host.name, f"asking what {data_dir} holds: "
                                       f"{res.stderr.decode(errors='replace').strip()[-800:]}")
    try:
        answer: Any = json.loads(res.stdout)
        lines = [str(line).strip().encode() for line in answer["files"]]
        checked = [(int(code), str(why)) for code, why in answer["sets"]]
    except (ValueError, KeyError, TypeError):
        raise ImageSetError(host.name, f"unexpected answer asking what {data_dir} holds: "
                                       f"{res.stdout[:200]!r}") from None
    if len(checked) != len(image_sets):
        raise ImageSetError(host.name, f"asked about {len(image_sets)} image sets, "
                                       f"{len(checked)} answered")
    files = parse_stats(host.name, list(paths), lines)
    ready: dict[str, bool] = {}
    for st, (code, why) in zip(image_sets, checked, strict=True):
        if code == EXIT_MISMATCH:
            await host.run(["rm", "-rf", "--", roots[st.digest]], timeout=120, check=False)
        elif code not in (0, EXIT_ABSENT):
            raise ImageSetError(host.name, f"verifying {roots[st.digest]}: {why[-800:]}")
        ready[st.digest] = code == 0
    return Survey(files, ready)


async def image_set_ready(host: Host, data_dir: str, image_set: CriuImageSet) -> bool:
    """Whether the host holds the set's published directory with exactly its bytes (every
    object's digest recomputed from the files unless its verified stamp still holds). A
    directory that differs is removed."""
    return (await survey(host, data_dir, {}, [image_set])).ready[image_set.digest]


__all__ = ["Survey", "image_set_ready", "survey"]
