#!/usr/bin/env python3
"""Quiet PID 1 for capsule containers.

CRIU restores the engine tree with its original PIDs, so PID 1 must never spawn anything that
could take one of them. This shim spawns nothing: it reaps orphans (a restored engine is
reparented to PID 1) and exits on SIGTERM/SIGINT so `docker stop` is prompt.
"""

import os
import signal
import sys


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    # SIGCHLD is ignored by default, which would leave pause() asleep while orphans die.
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            signal.pause()
        except InterruptedError:
            pass


if __name__ == "__main__":
    sys.exit(main())
