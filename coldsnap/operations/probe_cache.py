"""Passed CRIU probes, remembered on the control node so that a restore onto a host that
passed the same probe in the same boot does not start a probe container again.

What a probe's verdict depends on, and so what it is remembered under (`ProbeKey`): the host
(its inventory name and address), the boot of its kernel (`/proc/sys/kernel/random/boot_id`,
new at every boot, so a reboot, and with it any kernel change, forgets it), the kernel release,
the dockerd that ran it (its version, and its socket's inode and ctime, which a restarted
dockerd replaces: a daemon restarted with another seccomp or AppArmor setup is asked again),
the image the probe ran from (its content-addressed image id pins the CRIU binary), and the
probe's own recipe (script, capabilities, security options: `PROBE_RECIPE`). The facts probe
every restore runs first reads all of them in its one round trip, so a remembered probe costs
no call to the host at all. A host whose facts lack the boot id or the dockerd instance is
probed every time. Only a passed probe is written; a failed one is never remembered, and the
CRIU version floor is checked again on every use (it depends on code, not on the host).

Why on the control node (`<store>/probes/`) and not in the host's data_dir: the verdict is
the controller's admission decision, the controller reads it without a round trip, and a
data_dir copied to another machine or written by anything else on the host cannot vouch for
a probe. A controller with a fresh store merely probes once more. Entries are small JSON
files written atomically (fsync, rename, fsync of the directory); a torn or foreign entry
reads as absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from coldsnap.admission import HostFacts
from coldsnap.capsule.criu_probe import PROBE_RECIPE, CriuProbe, check_criu_version, probe_criu
from coldsnap.capsule.session import CapsuleSession
from coldsnap.durable import atomic_write_bytes
from coldsnap.hosts.inventory import HostEntry

PROBES_DIR = "probes"
_FORMAT = "coldsnap.criu-probe/v1"


@dataclass(frozen=True)
class ProbeKey:
    host: str
    address: str
    boot_id: str
    kernel: str
    docker: str
    docker_instance: str
    image_id: str
    recipe: str = PROBE_RECIPE

    def name(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(text).hexdigest()


def probe_key(entry: HostEntry, facts: HostFacts, image_id: str) -> ProbeKey | None:
    """What a probe of `image_id` on this host is valid for; None when the facts cannot say
    which boot or which dockerd they came from (then nothing is remembered)."""
    if not (facts.boot_id and facts.kernel and facts.docker and facts.docker_instance):
        return None
    return ProbeKey(host=entry.name, address=entry.address, boot_id=facts.boot_id,
                    kernel=facts.kernel, docker=facts.docker,
                    docker_instance=facts.docker_instance, image_id=image_id)


class ProbeCache:
    def __init__(self, store_root: Path) -> None:
        self.dir = store_root / PROBES_DIR

    def path(self, key: ProbeKey) -> Path:
        return self.dir / f"{key.name()}.json"

    def lookup(self, key: ProbeKey) -> CriuProbe | None:
        """The passed probe remembered for exactly `key`, else None."""
        try:
            doc = json.loads(self.path(key).read_bytes())
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT \
                or doc.get("key") != asdict(key):
            return None
        version = doc.get("criu_version")
        output = doc.get("output")
        if not isinstance(output, str) or not isinstance(version, str | None):
            return None
        return CriuProbe(key.host, key.image_id, output, version)

    def remember(self, key: ProbeKey, probe: CriuProbe) -> None:
        doc = {"format": _FORMAT, "key": asdict(key), "criu_version": probe.version,
               "output": probe.output[-4000:], "probed_at": int(time.time())}
        # Only a shortcut: a store that cannot take it costs the next restore one probe.
        with contextlib.suppress(OSError):
            atomic_write_bytes(self.path(key), json.dumps(doc, sort_keys=True).encode())


async def admit_criu(s: CapsuleSession, cache: ProbeCache, key: ProbeKey | None,
                     known: CriuProbe | None, image: str, *, unit: str, kernel: str | None,
                     labels: Mapping[str, str]) -> CriuProbe:
    """The CRIU probe of `image` on this host: `known` (what `cache.lookup(key)` found) when
    one passed there already, else run now and remembered under `key` when it passes. A
    remembered probe still gets the CRIU version floor checked."""
    if known is not None:
        check_criu_version(s, known, unit=unit, kernel=kernel)
        return known
    probe = await probe_criu(s, image, unit=unit, kernel=kernel, labels=labels)
    if key is not None:
        await asyncio.to_thread(cache.remember, key, probe)
    return probe
