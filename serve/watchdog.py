"""`python -m serve.watchdog SERVING_DIR HOST PORT PID START`: started beside each candidate server by serve/deploy.py
for the promoting process (PID, with its start time, so a reused pid is not mistaken for it). Its stdin is a
pipe whose other end only that process holds; it waits on it. The pipe closes when the promotion ends or
its process dies (kill -9 included); the process is also checked every second, in case something it
forked still holds the pipe's other end. If the process still lives, the promotion ended in it and cleaned up
after itself: nothing to do. If it died, the watchdog takes the deployment's lock and settles what the
promotion left: nginx back on the active server, the candidate stopped, the record cleaned.
"""
from __future__ import annotations

import logging
import os
import select
import sys
from pathlib import Path

from serve import deploy


def main(argv: list[str]) -> int:
    dep = deploy.Deployment(Path(argv[0]), argv[1], int(argv[2]))
    owner = {"pid": int(argv[3]), "start": argv[4]}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s watchdog %(message)s")
    logging.getLogger("glm_lora").info("watching promoting process %s for %s", owner["pid"], dep.root)
    while deploy.owner_alive(owner):
        ready, _, _ = select.select([sys.stdin], [], [], 1.0)
        if ready and not os.read(sys.stdin.fileno(), 4096):     # EOF: the promotion ended
            break
    if deploy.owner_alive(owner):
        return 0
    logging.getLogger("glm_lora").info("the promoting process %s died; settling %s", owner["pid"], dep.root)
    with deploy.locked(dep, wait_s=float("inf")):
        deploy.settle(dep, deploy.read_record(dep))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
