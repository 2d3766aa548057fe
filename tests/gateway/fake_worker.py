"""A test-double worker *process* for supervisor tests (no transport, no engine).

It speaks only the stdout half of the worker contract: progress lines, a stray
non-JSON line, then ``{"event": "ready", "url": ...}``, then sleeps until
SIGTERM. ``--crash-before-ready`` exits 3 first; ``--exit-after S`` exits 4 S
seconds after ready; ``--ignore-term`` makes SIGTERM do nothing (tests SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main(argv: list[str]) -> int:
    if "--ignore-term" in argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    for i in range(1, 5):
        print(json.dumps({"event": "progress", "stage": "load", "done": i, "total": 4, "message": "weights"}),
              flush=True)
    print("this line is not JSON", flush=True)
    if "--crash-before-ready" in argv:
        return 3
    print(json.dumps({"event": "ready", "url": f"tcp://127.0.0.1:{os.getpid()}", "models": ["tiny"]}),
          flush=True)
    if "--exit-after" in argv:
        time.sleep(float(argv[argv.index("--exit-after") + 1]))
        return 4
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
