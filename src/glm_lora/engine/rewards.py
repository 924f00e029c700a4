"""Reward functions for the RL stage (`rl.rewards`): plain Python, one answer at a time.

A reward is `fn(completion: str, *, reference: str, prompt: list[dict], task: str, finished: bool) -> float`:
`completion` is the sampled answer's text (special tokens dropped), `reference` the row's own answer (the
conversation's last assistant message), `prompt` the messages before it, `task` the row's family ("all" where
the row has none), `finished` whether the answer ended with the chat template's end of turn (not cut at
rl.max_new_tokens). A config names built-ins by name or a user's function as "package.module:function".
"""
from __future__ import annotations

import importlib
import math
from typing import Callable

from glm_lora.configs.errors import UserError
from glm_lora.data.synthetic import check_answer

Reward = Callable[..., float]


def exact_match(completion: str, *, reference: str, task: str, **_) -> float:
    """1 when the answer equals the reference by the held-out evaluation's own rule (data.synthetic.check_answer)."""
    return float(check_answer(task, completion, reference))


def format(completion: str, *, finished: bool, **_) -> float:   # noqa: A001 - the name users write in the config
    """1 for a non-empty one-line answer that ends its turn (the families' answer shape), else 0."""
    text = completion.strip()
    return float(finished and bool(text) and "\n" not in text)


BUILTIN: dict[str, Reward] = {"exact_match": exact_match, "format": format}


class RewardError(UserError):
    """A reward function failed or returned something that is not a finite number."""


def resolve(names: list[str]) -> dict[str, Reward]:
    """The configured reward functions by name; an unknown built-in, a module that does not import or a missing
    function is an error naming the entry (raised where the stage starts, before any training)."""
    out: dict[str, Reward] = {}
    for name in names:
        if name in BUILTIN:
            out[name] = BUILTIN[name]
            continue
        module, sep, attr = name.partition(":")
        if not sep or not module or not attr:
            raise UserError(f"rl.rewards: {name!r} is neither a built-in reward {sorted(BUILTIN)} nor "
                            "'package.module:function'")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            raise UserError(f"rl.rewards: {name!r}: cannot import module {module!r}: {e}") from e
        except AttributeError:
            raise UserError(f"rl.rewards: {name!r}: module {module!r} has no {attr!r}") from None
        if not callable(fn):
            raise UserError(f"rl.rewards: {name!r} is not a function")
        out[name] = fn
    return out


def score(rewards: dict[str, Reward], completion: str, *, reference: str, prompt: list[dict], task: str,
          finished: bool) -> dict[str, float]:
    """Each reward's value for one answer; a reward that raises or returns no finite number is a RewardError
    naming the function and the prompt."""
    out = {}
    for name, fn in rewards.items():
        where = f"reward {name!r} on prompt {_last_user(prompt)!r} (answer {completion[:80]!r})"
        try:
            value = fn(completion, reference=reference, prompt=prompt, task=task, finished=finished)
        except Exception as e:
            raise RewardError(f"{where} raised {type(e).__name__}: {e}") from e
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RewardError(f"{where} returned {value!r}: a reward must be a finite number (int, float or bool)")
        out[name] = float(value)
    return out


def _last_user(prompt: list[dict]) -> str:
    text = next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")
    return text if len(text) <= 120 else text[:119] + "…"
