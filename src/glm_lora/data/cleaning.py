"""Row-level cleaning, with every dropped row counted by reason: nothing is lost silently.

One `CleanReport` follows a split through the pipeline. Readers count the rows they read
(`rows`), every stage that drops a row calls `drop(reason, message)`, and the stage that finally
keeps a row (the tokeniser) counts it in `kept`; at the end rows == kept + sum(dropped):
    report = CleanReport()
    convs = clean_conversations(read_sft(path, on_bad_row="skip", report=report), dedup=True, report=report)
    for conv in convs:                      # the tokenisation step adds the token-level reasons
        if too_short: report.drop("min_tokens", msg); continue
        if too_long: cut it; report.truncated += 1
        report.kept += 1

Reasons: "bad_row" (a malformed row skipped by a reader, data.formats), "empty" (empty or
whitespace-only text / assistant answer), "duplicate" (exact repeat of an earlier row, with
dedup=True), "identical_pair" (DPO chosen == rejected); "min_tokens", "overlong", "no_target",
"turn_boundary" and "template_error" come from the tokenisation step (data.encode). `truncated`
counts rows whose end (an answer) was cut, `prompt_truncated` rows whose prompt alone was cut from
the left (data.overlong: truncate_prompt).

`check_drop_fraction` fails a split that lost more than data.max_drop_fraction of its rows, with
the counts by reason and the settings that would keep them.

Each reason keeps the first `max_examples` messages (data.report_examples; 0 = none), each cut to
EXAMPLE_CHARS, so a 20 MB row never reaches a manifest or a Prefect artifact.

Dedup keeps one 16-byte blake2b digest per kept row (about 100 bytes each in a Python set, so
~1 GB for 10M rows), not the rows themselves.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from glm_lora.configs.errors import quote
from glm_lora.data.errors import DataError

MAX_EXAMPLES = 3     # example messages kept per reason, by default (data.report_examples)
EXAMPLE_CHARS = 200  # each example is cut to this length

Message = dict  # {"role": str, "content": str}


@dataclass
class CleanReport:
    """What happened to one split's rows: read, kept, dropped per reason, truncated.

    `rows`: counted by the readers in data.formats (every row read, good or bad).
    `kept`: counted by the last stage, the one that keeps a row for good.
    `max_examples`: messages kept per reason in `examples` (0: none), each cut to EXAMPLE_CHARS.
    `truncated`: kept rows whose end was cut; `prompt_truncated`: kept rows whose prompt alone was cut
    from the left, the answer whole (in as_dict / str only when non-zero).
    """

    rows: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)
    max_examples: int = MAX_EXAMPLES
    prompt_truncated: int = 0

    def __post_init__(self) -> None:
        if self.max_examples < 0:
            raise ValueError(f"max_examples must be >= 0, got {self.max_examples}")

    def drop(self, reason: str, message: Any = "") -> None:
        """Count a dropped row; `message` may be a callable making it, called only if it is kept."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if message:
            self._example(reason, message)

    def _example(self, reason: str, message: Any) -> None:
        if len(self.examples.get(reason, ())) >= self.max_examples:
            return
        message = message() if callable(message) else message
        if message:
            self.examples.setdefault(reason, []).append(
                message if len(message) <= EXAMPLE_CHARS else message[:EXAMPLE_CHARS - 1] + "…")

    def merge(self, other: "CleanReport") -> None:
        """Add what `other` counted on a part of the same split (encoded elsewhere: data/parallel_encode.py)."""
        self.rows += other.rows
        self.kept += other.kept
        self.truncated += other.truncated
        self.prompt_truncated += other.prompt_truncated
        for reason, n in other.dropped.items():
            self.dropped[reason] = self.dropped.get(reason, 0) + n
        for reason, messages in other.examples.items():
            for message in messages:
                self._example(reason, message)

    def as_dict(self) -> dict:
        """JSON-able, for metrics, manifests and Prefect artifacts."""
        return {"rows": self.rows, "kept": self.kept, "dropped": dict(sorted(self.dropped.items())),
                "truncated": self.truncated,
                **({"prompt_truncated": self.prompt_truncated} if self.prompt_truncated else {}),
                "examples": {k: list(v) for k, v in sorted(self.examples.items())}}

    def __str__(self) -> str:
        drops = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())) or "none"
        cut = f"; prompt cut {self.prompt_truncated}" if self.prompt_truncated else ""
        return f"kept {self.kept} of {self.rows} rows; dropped: {drops}; truncated {self.truncated}{cut}"

    def check_drop_fraction(self, split: str, limit: float, *, seq_len: str | None = None, hint: str = "") -> None:
        """Raise DataError if more than `limit` of the rows read were dropped (see check_drop_fraction)."""
        check_drop_fraction(self.as_dict(), split, limit, seq_len=seq_len, hint=hint)


# What would keep the rows dropped for each reason ({seq_len}: e.g. "sft.seq_len (128)").
_FIXES = {
    "bad_row": "fix the malformed rows (data.on_bad_row: error stops at the first one, naming file, line and field)",
    "empty": "the rows have empty text or an empty assistant answer",
    "duplicate": "the split repeats rows: set data.dedup: false to keep repeats",
    "identical_pair": "chosen and rejected are the same answer in these pairs",
    "overlong": "raise {seq_len}, or set data.overlong: truncate_prompt (cuts the prompt's start, keeps the answer)",
    "no_target": "raise {seq_len}, or set data.overlong: truncate_prompt (no answer token was left within the "
                 "length limit)",
    "min_tokens": "lower data.min_tokens",
    "turn_boundary": "these multi-turn rows tokenise differently turn by turn with this tokenizer: split them into "
                     "one assistant answer per row",
    "template_error": "the chat template rejects these conversations (e.g. roles must alternate): fix their roles",
}


def check_drop_fraction(report: "CleanReport | dict", split: str, limit: float, *, seq_len: str | None = None,
                        hint: str = "") -> None:
    """Fail (DataError) when more than `limit` (data.max_drop_fraction) of a split's rows were dropped, for
    any reason; the message gives the counts by reason, an example of each and what would keep them.

    `report`: a CleanReport or its as_dict() (a cached token store's meta["clean"]); `seq_len`: the
    length setting the split was fitted to, e.g. "dpo.seq_len (256)"; `hint`: appended to the fixes.
    """
    d = report.as_dict() if isinstance(report, CleanReport) else dict(report or {})
    dropped = {k: int(v) for k, v in (d.get("dropped") or {}).items() if v}
    lost, kept = sum(dropped.values()), int(d.get("kept", 0))
    # The rows judged: kept + dropped once the tokeniser has counted what it keeps (rows held out of
    # the split for evaluation are read but neither); the rows read when nothing was kept yet (the
    # data stage's readers, which only drop bad rows).
    rows = kept + lost if kept else int(d.get("rows", 0))
    if rows <= 0 or lost <= limit * rows:
        return
    by_reason = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0])))
    examples = d.get("examples") or {}
    shown = "; ".join(f"{k}: {examples[k][0]}" for k in sorted(dropped, key=lambda k: -dropped[k])
                      if examples.get(k))
    where = seq_len or "the stage's seq_len"
    fixes = [_FIXES.get(k, f"see the {k!r} examples").format(seq_len=where)
             for k in sorted(dropped, key=lambda k: -dropped[k])]
    if hint:
        fixes.append(hint)
    fixes.append(f"or allow it with data.max_drop_fraction (now {limit:g}; 1 turns this check off)")
    raise DataError(f"data.{split}: {lost} of {rows} rows were dropped ({lost / rows:.1%}), more than "
                    f"data.max_drop_fraction ({limit:g}): {by_reason}" + (f" (e.g. {shown})" if shown else "")
                    + ". To keep them: " + "; ".join(dict.fromkeys(fixes)))


def _digest(value) -> bytes:
    data = value.encode() if isinstance(value, str) else json.dumps(value, ensure_ascii=False).encode()
    return hashlib.blake2b(data, digest_size=16).digest()


def _shrink(value: Any, chars: int) -> Any:
    """`value` with every string cut to `chars` characters (so a preview never copies a huge row)."""
    if isinstance(value, str):
        return value if len(value) <= chars else value[:chars] + "…"
    if isinstance(value, dict):
        return {k: _shrink(v, chars) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_shrink(v, chars) for v in value[:chars]]
    return value


def _preview(value) -> str:
    """A short text of a dropped row for CleanReport.examples (cut there to EXAMPLE_CHARS)."""
    value = _shrink(value, EXAMPLE_CHARS)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class _Seen:
    """Digests of what was kept; `repeat(x)` is True if x came before (and remembers x otherwise)."""

    def __init__(self, enabled: bool):
        self.enabled, self.digests = enabled, set()

    def repeat(self, key) -> bool:
        if not self.enabled:
            return False
        d = _digest(key)
        if d in self.digests:
            return True
        self.digests.add(d)
        return False


def clean_texts(texts: Iterable[str], *, dedup: bool, report: CleanReport) -> Iterator[str]:
    """Drop empty/whitespace-only documents and (with dedup) exact repeats."""
    seen = _Seen(dedup)
    for text in texts:
        if not text.strip():
            report.drop("empty", lambda: quote(text[:EXAMPLE_CHARS]))
        elif seen.repeat(text):
            report.drop("duplicate", lambda: _preview(text))
        else:
            yield text


def clean_conversations(convs: Iterable[list[Message]], *, dedup: bool,
                        report: CleanReport) -> Iterator[list[Message]]:
    """Drop conversations with an empty assistant turn (or none) and (with dedup) exact repeats."""
    seen = _Seen(dedup)
    for conv in convs:
        answers = [m["content"] for m in conv if m["role"] == "assistant"]
        if not answers or not all(a.strip() for a in answers):
            report.drop("empty", lambda: _preview(conv))
        elif seen.repeat([(m["role"], m["content"]) for m in conv]):
            report.drop("duplicate", lambda: _preview(conv))
        else:
            yield conv


def clean_kto(rows: Iterable, *, dedup: bool, report: CleanReport) -> Iterator:
    """Drop KTO rows (data.formats.KTORow) with an empty answer and (with dedup) exact repeats."""
    seen = _Seen(dedup)
    for row in rows:
        if not row.completion["content"].strip():
            report.drop("empty", lambda: _preview([row.prompt, row.completion]))
        elif seen.repeat([[(m["role"], m["content"]) for m in row.prompt], row.completion["content"], row.desirable]):
            report.drop("duplicate", lambda: _preview([row.prompt, row.completion]))
        else:
            yield row


def clean_pairs(pairs: Iterable[tuple[list[Message], Message, Message]], *, dedup: bool,
                report: CleanReport) -> Iterator[tuple[list[Message], Message, Message]]:
    """Drop DPO pairs with an empty answer, chosen == rejected (ignoring surrounding whitespace),
    and (with dedup) exact repeats of prompt + both answers."""
    seen = _Seen(dedup)
    for prompt, chosen, rejected in pairs:
        c, r = chosen["content"].strip(), rejected["content"].strip()
        if not c or not r:
            report.drop("empty", lambda: _preview([prompt, chosen, rejected]))
        elif c == r:
            report.drop("identical_pair", lambda: _preview([prompt, chosen, rejected]))
        elif seen.repeat([[(m["role"], m["content"]) for m in prompt], chosen["content"], rejected["content"]]):
            report.drop("duplicate", lambda: _preview([prompt, chosen, rejected]))
        else:
            yield prompt, chosen, rejected
