"""Readers for user data files (pretrain / SFT / DPO), streaming, with errors that say where.

Every `DataError` names the file, the 1-based line and, where there is one, the field:
    data/sft.jsonl:17: field 'conversations[1].role': expected one of 'system', 'user', 'assistant', got 'bot'

Formats (the ones `data.synthetic` writes, plus common variants):
- pretrain: JSONL `{"text": str}`, or a `.txt` file with one document per non-empty line
  (the JSONL rule, so line numbers in errors match; put multi-line documents in JSONL).
- SFT: JSONL `{"conversations": [msg, ...]}` (or key "messages"), msg = `{"role", "content"}`,
  roles system/user/assistant, the last message from the assistant.
- DPO: JSONL `{"chosen": [msgs], "rejected": [msgs]}` sharing every message but the last
  (the assistant answer), or `{"prompt": str, "chosen": str, "rejected": str}`.
Extra keys are ignored; messages come back as plain `{"role", "content"}` dicts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

Message = dict  # {"role": str, "content": str}
ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """A bad row in a data file; the message names path, line and field."""


@dataclass(frozen=True)
class _Row:
    """Where a value came from, so every check can raise a precise DataError."""

    path: str
    line: int

    def error(self, field: str | None, msg: str) -> DataError:
        where = f"field '{field}': " if field else ""
        return DataError(f"{self.path}:{self.line}: {where}{msg}")

    def get(self, obj: dict, key: str, field: str | None = None) -> Any:
        if key not in obj:
            raise self.error(field or key, "missing")
        return obj[key]

    def text(self, value: Any, field: str) -> str:
        if not isinstance(value, str):
            raise self.error(field, f"expected a string, got {type(value).__name__}")
        if not value.strip():
            raise self.error(field, "empty")
        return value

    def messages(self, value: Any, field: str) -> list[Message]:
        """A non-empty conversation whose last message is the assistant's."""
        if not isinstance(value, list):
            raise self.error(field, f"expected a list of messages, got {type(value).__name__}")
        if not value:
            raise self.error(field, "empty conversation")
        out = []
        for i, m in enumerate(value):
            f = f"{field}[{i}]"
            if not isinstance(m, dict):
                raise self.error(f, f"expected an object with 'role' and 'content', got {type(m).__name__}")
            role = self.get(m, "role", f"{f}.role")
            if role not in ROLES:
                raise self.error(f"{f}.role", f"expected one of {', '.join(map(repr, ROLES))}, got {role!r}")
            out.append({"role": role, "content": self.text(self.get(m, "content", f"{f}.content"), f"{f}.content")})
        if out[-1]["role"] != "assistant":
            raise self.error(f"{field}[{len(out) - 1}].role",
                             f"the last message must be 'assistant', got {out[-1]['role']!r}")
        return out


def _lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line) for each line; decodes per line so errors name it."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _Row(str(path), n).error(None, f"invalid UTF-8 at byte {e.start} of the line") from None
            yield n, line.lstrip("\ufeff") if n == 1 else line


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSONL file."""
    for n, line in _lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _Row(str(path), n).error(None, f"invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise _Row(str(path), n).error(None, f"expected a JSON object, got {type(obj).__name__}")
        yield n, obj


def read_pretrain(path: str | Path) -> Iterator[str]:
    """Documents: `{"text": str}` per JSONL line, or each non-empty line of a .txt file."""
    if Path(path).suffix == ".txt":
        yield from (line.rstrip("\r\n") for _, line in _lines(path) if line.strip())
        return
    for n, obj in iter_jsonl(path):
        row = _Row(str(path), n)
        yield row.text(row.get(obj, "text"), "text")


def read_sft(path: str | Path) -> Iterator[list[Message]]:
    """Conversations from `{"conversations": [...]}` (or `{"messages": [...]}`)."""
    for n, obj in iter_jsonl(path):
        key = "messages" if "messages" in obj and "conversations" not in obj else "conversations"
        row = _Row(str(path), n)
        yield row.messages(row.get(obj, key), key)


def read_dpo(path: str | Path) -> Iterator[tuple[list[Message], Message, Message]]:
    """(prompt messages, chosen answer, rejected answer) per row."""
    for n, obj in iter_jsonl(path):
        row = _Row(str(path), n)
        if "prompt" in obj:  # {"prompt": str, "chosen": str, "rejected": str}
            prompt, chosen, rejected = (row.text(row.get(obj, k), k) for k in ("prompt", "chosen", "rejected"))
            yield ([{"role": "user", "content": prompt}],
                   {"role": "assistant", "content": chosen}, {"role": "assistant", "content": rejected})
            continue
        chosen = row.messages(row.get(obj, "chosen"), "chosen")
        rejected = row.messages(row.get(obj, "rejected"), "rejected")
        if len(chosen) < 2:
            raise row.error("chosen", "needs at least one prompt message before the assistant answer")
        if len(rejected) != len(chosen):
            raise row.error("rejected", f"has {len(rejected)} messages, 'chosen' has {len(chosen)}; "
                                        "both must be the same prompt plus one answer")
        for i, (c, r) in enumerate(zip(chosen[:-1], rejected[:-1])):
            if c != r:
                raise row.error(f"rejected[{i}]", f"differs from 'chosen[{i}]'; "
                                                  "all but the last message must be the same prompt")
        yield chosen[:-1], chosen[-1], rejected[-1]
