"""The one base class for failures caused by what the user gave us (config, data, model files)
or by a verdict on it (the promotion gate).

Such an error repeats on every retry, so Prefect does not retry it, and the CLI and the flow
show it as one line naming the file / row / key, without a traceback. Anything else is a bug
or a transient failure: it keeps its traceback and may be retried.
"""
from __future__ import annotations

MAX_QUOTED = 200   # characters of a user's value quoted in an error message


class UserError(Exception):
    """A mistake in the user's input, or a verdict on it: fix the input, don't retry."""


def quote(value: object, limit: int = MAX_QUOTED) -> str:
    """repr() of a user's value, cut to `limit` characters (a 20 MB field must not reach the log)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"
