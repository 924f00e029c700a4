"""`python -m glm_lora.serve.watchdog SERVING_DIR HOST PORT PID START`: started beside each candidate server by serve/deploy.py
for the promoting process (PID, with its start time, so a reused pid is not mistaken for it). Its stdin is a
pipe whose other end only that process holds. A promotion that ends in its process (success or a handled
failure: it cleaned up after itself) writes DONE down the pipe before closing it: the watchdog just exits.
A pipe that closes without DONE, or a process that is gone (checked every second), means the process died
(kill -9 included). The kernel closes a dying process's files before /proc shows it dead, so the watchdog
then waits for the process to be gone, takes the deployment's lock and settles what the promotion left:
nginx back on the active server, the candidate stopped, the record cleaned.
"""
from __future__ import annotations

import logging
import os
import select
import sys
import time
from pathlib import Path

from glm_lora.serve import deploy


def main(argv: list[str]) -> int:
    dep = deploy.Deployment(Path(argv[0]), argv[1], int(argv[2]))
    owner = {"pid": int(argv[3]), "start": argv[4]}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s watchdog %(message)s")
    log = logging.getLogger("glm_lora")
    log.info("watching promoting process %s for %s", owner["pid"], dep.root)
    received = b""
    while True:                     # read before looking at the process: a finished one may have left DONE unread
        ready, _, _ = select.select([sys.stdin], [], [], 1.0)
        chunk = os.read(sys.stdin.fileno(), 4096) if ready else None
        received += chunk or b""
        if deploy.WATCHDOG_DONE in received:
            log.info("the promotion ended in its process %s; nothing to settle", owner["pid"])
            return 0
        if chunk == b"" or not deploy.owner_alive(owner):     # closed without DONE, or gone: it died
            break
    while deploy.owner_alive(owner):                          # dying: its files close before /proc says so
        time.sleep(0.1)
    log.info("the promoting process %s died; settling %s", owner["pid"], dep.root)
    with deploy.locked(dep, wait_s=float("inf")):
        deploy.settle(dep, deploy.read_record(dep))
    log.info("settled %s", dep.root)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
