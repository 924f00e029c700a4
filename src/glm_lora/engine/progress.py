"""Training progress for whoever watches: the Prefect task's progress artifact, a terminal bar, or the
launcher of a torchrun stage (which gets it as `PROGRESS {json}` lines on rank 0's stdout).

`fit()` reports every logging window: {"stage", "step", "max_steps", "loss", "tokens_per_s",
"elapsed_s"} (rank 0 only). Listeners are process-wide and scoped with `listening(fn)`.
"""
from __future__ import annotations

import contextlib
import json
from typing import Callable, Iterator

PREFIX = "PROGRESS "
_listeners: list[Callable[[dict], None]] = []


@contextlib.contextmanager
def listening(fn: Callable[[dict], None]) -> Iterator[None]:
    _listeners.append(fn)
    try:
        yield
    finally:
        _listeners.remove(fn)


def report(event: dict) -> None:
    for fn in list(_listeners):
        fn(event)


def as_line(event: dict) -> str:
    return PREFIX + json.dumps(event)


def from_line(line: str) -> dict | None:
    """The event a `PROGRESS {json}` line carries (None for any other line)."""
    if not line.startswith(PREFIX):
        return None
    try:
        return json.loads(line[len(PREFIX):])
    except ValueError:
        return None


def eta_s(event: dict) -> float | None:
    step, total, elapsed = event.get("step"), event.get("max_steps"), event.get("elapsed_s")
    if not step or not total or elapsed is None:
        return None
    return elapsed / step * max(total - step, 0)
