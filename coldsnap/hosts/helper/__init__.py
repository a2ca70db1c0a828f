"""The host-side helper: one small program the control node sends to a host with every call
(`python3 -c PROGRAM MODE ARGS`, see `helper_argv`); nothing is installed there.

Python 3.8 (the oldest python3 on a supported host OS) and the standard library only: only
the program's text crosses to the host. It is written as the parts below, which the near side
imports like any module (for the exit codes, the stamps, `Writeback`), and sent as one text:
the parts in order, without their imports of each other (`PROGRAM`).

  stamps.py      verified stamps of files and of published image sets (xattrs; their format)
  common.py      the exit codes of every mode, `die`, `sync_dir`, `publish`
  beneath.py     `open_beneath`: a file beneath a root, no symlink followed (openat2)
  files.py       put, stat, stats, recv, commit, get, reap: the far side of file transfers
  image_sets.py  pack, place, finish, check_set: CRIU image sets; layers: a capsule's layers
  locks.py       hold: exclusive locks on the host (flock under <data_dir>/locks)
  registry.py    blob-pull, blob-push: a host's own objects from and to an OCI registry
  pulls.py       blob-pulls: the pulls of one staging in one python start
  seed.py        seed: a staged runtime cache copied into a unit's cache directory
  main.py        the dispatch, and `holdings` (files' stats and image sets' checks at once)

Modes:
  put PART FINAL            partial state, then "OFFSET LENGTH", bytes, "HEX": write, verify,
                            publish
  stat PATH                 "part SIZE HEX" of a file (0 and the empty digest when absent),
                            from its verified stamp when that still matches
  stats PATH...             the same for each path, one line each, "absent" for no regular file
  recv PART OFF LEN         bytes from OFF (OpenSSH bulk path): write, publish as PART.<digest>
  commit SRC DST            rename a verified candidate into place
  get PATH OFFSET [ROOT]    "size SIZE", bytes from OFFSET, then "HEX" of the whole file;
                            with ROOT, PATH is opened beneath it, no symlink followed
  send ROOT PATH OFFSET     "size SIZE", then the bytes from OFFSET (no hashing: the caller
                            knows the digest); PATH opened beneath ROOT, no symlink followed
  payload PATH MAX ROOT...  JSON {"real", "root", "size", "sha256"} of the file PATH resolves
                            to, which must lie under one of the ROOTs (resolved), be at most
                            MAX bytes, and is hashed through a descriptor opened beneath its
                            root, no symlink followed (never from a stamp the engine can set)
  reap TOKEN SECONDS        wait until no process of a put through OpenSSH marked with TOKEN
                            runs here, killing what still runs after half the time
  pack, place, finish, layers   see image_sets.py
  holdings                  stdin {"paths": [...], "sets": [[ROOT, PLAN], ...]}: see main.py
  blob-pull FINAL DIGEST SIZE   stdin {"access", "repository", "timeout"}: the blob from the
                            registry into FINAL (resuming FINAL.coldsnap-part), verified, stamped,
                            published; JSON {"received", "resumed_from", "size"}
  blob-pulls                stdin: that request as one line, then one line per pull
                            {"id", "final", "digest", "size"}, each run as `blob-pull` runs
                            it, beside the others, or {"id", "place": {"root", "copies"},
                            "digest", "size"}: a CRIU object straight into an assembly;
                            one JSON line per pull as it ends (see pulls.py); the end of
                            stdin ends it, pulls in progress or not
  blob-push PATH DIGEST SIZE    the same stdin: the file as a blob, unless the repository
                            holds it; JSON {"present", "sent", "size"} (see registry.py)
  seed SRC DST              copy the directory SRC into DST (no symlink followed); JSON
                            {"files", "bytes", "digest"} of what was copied (see seed.py)
  hold ROOT HOLDER          locks under ROOT, taken and released by commands on stdin and
                            held until stdin ends: see locks.py

Exit codes (common.py): 0 ok, 2 usage, 3 short stream, 4 mismatch, 5 stale offset, 6 refused
(a symlink, a `..`, not a regular file, outside every root, over a size cap), 75 busy;
the registry modes: 7 unauthorized, 8 blob unknown, 9 unreachable or interrupted (a pull's
partial file kept), 10 another answer of the registry (and 4 for a blob that does not match).
"""

from __future__ import annotations

import ast
from importlib import resources

# In the order the program needs them: each part uses only names of the parts before it.
PARTS = ("stamps", "common", "beneath", "files", "image_sets", "locks", "registry",
         "pulls", "seed", "main")


def _part(name: str) -> str:
    """A part's source without its docstring and its imports of `__future__` and of this
    package, which one text does not need (and python3 would refuse a later `__future__`)."""
    source = resources.files(__package__).joinpath(f"{name}.py").read_text()
    drop: set[int] = set()
    for node in ast.parse(source).body:
        local = isinstance(node, ast.ImportFrom) and node.module is not None and (
            node.module == "__future__" or node.module.startswith("coldsnap."))
        doc = (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
               and isinstance(node.value.value, str))
        if local or doc:
            drop.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    lines = source.splitlines(keepends=True)
    return "".join(line for n, line in enumerate(lines, 1) if n not in drop)


PROGRAM = "from __future__ import annotations\n" + "\n".join(_part(name) for name in PARTS)


def helper_argv(mode: str, *args: str) -> list[str]:
    return ["python3", "-c", PROGRAM, mode, *args]


__all__ = ["PARTS", "PROGRAM", "helper_argv"]
