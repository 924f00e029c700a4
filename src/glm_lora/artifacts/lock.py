"""One run at a time per run directory, and cleanup of what a dead run left behind.

`run_lock(run_dir)` takes an exclusive `flock` on `run_dir/.lock` for the whole run (the flow,
or one CLI stage). The kernel drops it when the holder exits, however it exits, so a crash never
leaves a stale lock. A second run on the same directory fails at once naming the holder (pid,
host, start time, command) instead of racing it on publish. The lock is re-entrant within a
process (the CLI inside a flow, nested calls).

Holding the lock means no live writer owns the directory's scratch entries
(`.<name>.tmp-*` / `.<name>.old-*`, see artifacts.staging_dir), so on taking it they are cleaned:
an `.old-*` whose artifact is missing (a crash between the two renames of a publish) is put back,
everything else is removed.

On several machines sharing the run directory, node 0 takes this lock and the other nodes (which publish
nothing: tasks/nodes.py) one of their own each, `.lock-node<R>`, and clean nothing.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from glm_lora.configs.errors import UserError

LOCK = ".lock"
_SCRATCH = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-(?P<ns>\d+)$")
log = logging.getLogger("glm_lora.artifacts")

_held: dict[Path, list] = {}        # lock path → [open lock file, depth]
_guard = threading.Lock()


class RunDirBusy(UserError):
    """Another process holds the run directory's lock."""


@contextlib.contextmanager
def run_lock(run_dir: Path, node_rank: int = 0) -> Iterator[None]:
    path = Path(run_dir).absolute() / (f"{LOCK}-node{node_rank}" if node_rank else LOCK)
    with _guard:
        if path in _held:
            _held[path][1] += 1
        else:
            _held[path] = [_acquire(path), 1]
            if not node_rank:
                clean_scratch(path.parent)
    try:
        yield
    finally:
        with _guard:
            entry = _held[path]
            entry[1] -= 1
            if entry[1] == 0:
                del _held[path]
                entry[0].close()        # closing the file releases the flock


def _acquire(path: Path):
    run_dir = path.parent
    f, holder = take_flock(path)
    if f is None:
        raise RunDirBusy(f"{run_dir} is in use by another glm-lora run ({holder}); wait for it to finish "
                         "or choose another run_name")
    return f


def take_flock(path: Path, wait_s: float = 0.0):
    """(open file, "") once this process holds an exclusive flock on `path` (closing the file releases it;
    the file names the holder), or (None, the holder's note) if it is still taken after `wait_s`."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+", encoding="utf-8")    # not inherited by child processes (PEP 446)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                f.seek(0)
                holder = f.read().strip() or "unknown process"
                f.close()
                return None, holder
            time.sleep(0.2)
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
            f"{' '.join(sys.argv)[:200]}")
    f.flush()
    return f, ""


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (someone else's counts: we may not signal it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_scratch(run_dir: Path) -> list[str]:
    """Put back or remove the scratch entries of dead writers in `run_dir`; return what was done."""
    done = []
    entries = sorted((p for p in Path(run_dir).iterdir() if _SCRATCH.match(p.name)),
                     key=lambda p: int(_SCRATCH.match(p.name)["ns"]), reverse=True)   # newest first
    for p in entries:
        m = _SCRATCH.match(p.name)
        final = p.parent / m["name"]
        if m["kind"] == "old" and not final.exists() and p.is_dir():
            os.replace(p, final)
            done.append(f"restored {final.name} from {p.name}")
        elif p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed {p.name}")
    for line in done:
        log.warning("%s: %s (left by an interrupted run)", run_dir, line)
    return done
