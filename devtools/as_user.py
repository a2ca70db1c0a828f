"""Running coldsnapd as another (unprivileged) user in tests: the interpreter and the
environment that user can use.

The project's virtual environment may point at an interpreter under a home directory other
users cannot enter (pyenv under /root). Then a system interpreter of the same version runs
the same code, with the repository and the environment's site-packages on its path (both
must be readable by everyone, as a checkout under /work or /srv is).
"""

from __future__ import annotations

import os
import shutil
import site
import stat
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _reachable_by_all(path: Path) -> bool:
    """Whether every directory on the way to `path` lets others through, and `path` lets
    others execute it."""
    real = path.resolve()
    for part in [*reversed(real.parents), real]:
        mode = part.stat().st_mode
        if part != real and not mode & stat.S_IXOTH:
            return False
    return bool(real.stat().st_mode & stat.S_IXOTH)


def python_for_others() -> tuple[list[str], dict[str, str]]:
    """The argv prefix that runs `python -m coldsnap` for another user, and its environment."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if _reachable_by_all(Path(sys.executable)):
        return [sys.executable, "-m", "coldsnap"], env
    wanted = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(wanted, path="/usr/local/bin:/usr/bin:/bin")
    if system is None:
        raise RuntimeError(f"no {wanted} that other users can run (the environment's is "
                           f"{sys.executable})")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *site.getsitepackages()])
    return [system, "-m", "coldsnap"], env
