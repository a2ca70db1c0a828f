"""The helper's entry point: one mode per call, chosen by the first argument (the modes are
listed in `coldsnap.hosts.helper`), and the `holdings` mode, which answers for files and
image sets at once.

A part of the helper program (see `coldsnap.hosts.helper`): Python 3.8, standard library only.
The last part: its `__main__` guard runs the program.
"""

from __future__ import annotations

import hashlib
import json
import sys

from coldsnap.hosts.helper.common import CH, EXIT_OK, EXIT_USAGE, die
from coldsnap.hosts.helper.files import (
    commit,
    file_state,
    get,
    payload,
    put,
    reap,
    recv,
    send,
)
from coldsnap.hosts.helper.image_sets import check_set, finish, layers, pack, place
from coldsnap.hosts.helper.locks import hold
from coldsnap.hosts.helper.pulls import pulls_run
from coldsnap.hosts.helper.registry import reg_run
from coldsnap.hosts.helper.seed import seed

# The image set modes and how many arguments each takes.
IMAGE_MODES = {"pack": 4, "place": 3, "finish": 2, "layers": 3}


def holdings() -> None:
    """stdin {"paths": [PATH, ...], "sets": [[ROOT, PLAN], ...]}: one JSON answer, "files"
    with `stats`' line for each path and "sets" with `check_set`'s [code, why] for each set:
    what a restore asks of every host before it writes anything, in one python start."""
    req = json.load(sys.stdin)
    mv = memoryview(bytearray(CH))
    files = [file_state(p, mv, "absent").decode() for p in req["paths"]]
    sets = [list(check_set(root, plan)) for root, plan in req["sets"]]
    sys.stdout.write(json.dumps({"files": files, "sets": sets}))


def main(argv: list[str]) -> int:
    mode, args = (argv[0], argv[1:]) if argv else ("", [])
    if mode in IMAGE_MODES:
        if len(args) != IMAGE_MODES[mode]:
            die(EXIT_USAGE, "usage: pack|place|finish|layers ARGS")
        if mode == "pack":
            pack(args[0], args[1], int(args[2]), int(args[3]))
        elif mode == "place":
            place(args[0], args[1], args[2])
        elif mode == "finish":
            finish(args[0], args[1])
        else:
            layers(args[0], args[1], int(args[2]))
        return EXIT_OK
    out = sys.stdout.buffer
    mv = memoryview(bytearray(CH))
    if mode == "put":
        put(args, out, mv)
    elif mode == "stat":
        out.write(file_state(args[0], mv, absent=f"part 0 {hashlib.sha256().hexdigest()}"))
    elif mode == "stats":
        for path in args:
            out.write(file_state(path, mv, absent="absent"))
    elif mode == "recv":
        recv(args, out, mv)
    elif mode == "reap":
        reap(args[0], float(args[1]))
    elif mode == "commit":
        commit(args)
    elif mode == "get":
        get(args, out, mv)
    elif mode == "send":
        send(args, out)
    elif mode == "payload":
        payload(args, out, mv)
    elif mode == "holdings":
        holdings()
    elif mode in ("blob-pull", "blob-push"):
        reg_run(args, pull=mode == "blob-pull")
    elif mode == "blob-pulls" and not args:
        pulls_run()
    elif mode == "seed" and len(args) == 2:
        seed(args[0], args[1])
    elif mode == "hold" and len(args) == 2:
        hold(args[0], args[1])
    else:
        die(EXIT_USAGE, "unknown mode " + mode)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
