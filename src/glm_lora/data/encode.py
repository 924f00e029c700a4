"""Tokenise a split once into a memory-mapped TokenStore, applying the token-level cleaning rules.

Pretraining documents longer than seq_len are split into seq_len chunks (each its own
document); SFT conversations and DPO pairs longer than their limit are handled per `overlong`
(data.overlong): "truncate_prompt" (default) cuts the prompt from the left (oldest turns, then the
start of the first remaining message) and keeps the last answer whole, falling back to cutting the
answer's end when the answer alone does not fit; "truncate" cuts the end; "drop" drops the row.
Every dropped row is counted by reason in the CleanReport stored with the tokens, and
`check_drop_fraction` (data.cleaning) fails a split that lost more than data.max_drop_fraction.

Memory stays bounded whatever a row's length (a 50 MB string costs ~9 GB inside a fast
tokenizer): documents are tokenised in batches of at most BATCH_CHARS characters, a document
over SEGMENT_CHARS is tokenised a segment at a time with its chunks streamed out, and a chat
message is cut, before tokenising, to what the length limit can use (`cut_messages`). Rows under
these sizes get exactly the tokens they got before.
"""
from __future__ import annotations

import hashlib
import itertools
import weakref
from pathlib import Path
from typing import Iterable, Iterator

from glm_lora.artifacts.manifest import code_version, sha256_file
from glm_lora.data.cleaning import CleanReport
from glm_lora.data.token_store import IGNORE, TokenStore, cached_token_store
from glm_lora.data.tokenizer import ChatRowError, chat_tokens, prompt_ids, tokenize_chat

OVERLONG = ("truncate_prompt", "truncate", "drop")   # data.overlong
Example = tuple[list[int], list[int]]
BATCH_CHARS = 1 << 20     # characters tokenised in one call (several documents)
SEGMENT_CHARS = 1 << 20   # a longer pretraining document is tokenised a segment at a time


def tokenizer_digest(tokenizer_dir: Path) -> str:
    files = sorted(p for p in Path(tokenizer_dir).iterdir() if p.is_file() and p.name != "manifest.json")
    return hashlib.sha256(b"".join(sha256_file(p).encode() for p in files)).hexdigest()


_PIECE_CHARS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def max_piece_chars(tok) -> int:
    """The most characters one token can stand for: the longest vocabulary entry (added tokens
    included; a byte-level or byte-fallback piece spells at least as many characters as it covers)."""
    try:
        return _PIECE_CHARS[tok]
    except (KeyError, TypeError):
        pass
    n = max(1, max((len(p) for p in tok.get_vocab()), default=1))
    try:
        _PIECE_CHARS[tok] = n
    except TypeError:
        pass
    return n


def usable_chars(tok, tokens: int) -> int:
    """Characters of one text that can matter when at most `tokens` tokens are kept: a text this long
    already has more than `tokens` tokens (each token spells at most max_piece_chars), and twice
    the bound keeps the tokenizer's merges at the cut far from the tokens that are kept."""
    return 2 * max(tokens, 1) * max_piece_chars(tok) + 64


def cut_messages(tok, messages: list[dict], tokens: int, keep: str = "head") -> list[dict]:
    """`messages` with each content longer than usable_chars(tok, tokens) cut to that many characters
    (its start, or with keep="tail" its end); the same list when nothing is that long.

    For a conversation truncated to its first `tokens` tokens (keep="head"; or cropped to its last
    ones, keep="tail") the cut changes nothing: a message that long alone makes it longer than the
    limit before and after the cut, and the kept tokens come from text the cut leaves alone.
    (truncate_prompt cuts the prompt's messages with keep="tail" and the answer with keep="head".)
    """
    limit = usable_chars(tok, tokens)
    if all(len(m["content"]) <= limit for m in messages):
        return messages
    return [m if len(m["content"]) <= limit else
            {**m, "content": m["content"][:limit] if keep == "head" else m["content"][-limit:]} for m in messages]


def _segments(text: str, size: int) -> Iterator[str]:
    """`text` in pieces of at most `size` characters, cut after a newline or else before a space
    where there is one in the second half of a piece (where tokens rarely merge across)."""
    start = 0
    while len(text) - start > size:
        end = start + size
        cut = text.rfind("\n", start + size // 2, end) + 1 or text.rfind(" ", start + size // 2, end)
        if cut <= start:
            cut = end
        yield text[start:cut]
        start = cut
    yield text[start:]


def _long_document(text: str, tok, eos: int, seq_len: int, min_tokens: int,
                   report: CleanReport) -> Iterator[Example]:
    """lm_examples for one document over SEGMENT_CHARS: tokenised a segment at a time, its seq_len
    chunks yielded as they fill (the same chunking as the whole document's)."""
    pending: list[int] = []
    total, counted = 0, False
    parts = (tok(seg, add_special_tokens=False)["input_ids"] for seg in _segments(text, SEGMENT_CHARS))
    for part in itertools.chain(parts, [[eos]]):
        pending += part
        total += len(part)
        if not counted:
            if total < min_tokens:
                continue
            counted = True
            report.kept += 1
        full = len(pending) - len(pending) % seq_len
        for i in range(0, full, seq_len):
            piece = pending[i:i + seq_len]
            yield piece, piece
        del pending[:full]
    if not counted:
        report.drop("min_tokens", f"{total} tokens")
    elif len(pending) >= 2:
        yield pending, pending


def lm_examples(texts: Iterable[str], tok, *, seq_len: int, min_tokens: int, report: CleanReport,
                batch: int = 512) -> Iterator[Example]:
    """Each document + eos, in seq_len chunks (every chunk of at least 2 tokens is kept).

    Documents are tokenised `batch` (and at most BATCH_CHARS characters) at a time; one over
    SEGMENT_CHARS characters is tokenised in segments (cut at a newline where it can be), so a
    huge document costs bounded memory and still gives all its chunks.
    """
    eos = tok.eos_token_id

    def chunks(buf: list[str]) -> Iterator[Example]:
        for ids in tok(buf, add_special_tokens=False)["input_ids"]:
            ids = ids + [eos]
            if len(ids) < min_tokens:
                report.drop("min_tokens", f"{len(ids)} tokens")
                continue
            report.kept += 1
            for i in range(0, len(ids), seq_len):
                piece = ids[i:i + seq_len]
                if len(piece) >= 2:
                    yield piece, piece
    buf: list[str] = []
    chars = 0
    for text in texts:
        if len(text) > SEGMENT_CHARS:
            if buf:
                yield from chunks(buf)
                buf, chars = [], 0
            yield from _long_document(text, tok, eos, seq_len, min_tokens, report)
            continue
        buf.append(text)
        chars += len(text)
        if len(buf) == batch or chars >= BATCH_CHARS:
            yield from chunks(buf)
            buf, chars = [], 0
    if buf:   # (a fast tokenizer fails on an empty batch)
        yield from chunks(buf)


def _fit(example: Example, limit: int, overlong: str, report: CleanReport) -> Example | None:
    ids, labels = example
    if len(ids) > limit:
        if overlong == "drop":
            report.drop("overlong", f"{len(ids)} > {limit} tokens")
            return None
        ids, labels = ids[:limit], labels[:limit]
        report.truncated += 1
    return _has_target(ids, labels, report)


def _has_target(ids: list[int], labels: list[int], report: CleanReport) -> Example | None:
    if all(lab == IGNORE for lab in labels[1:]):
        report.drop("no_target", "no assistant token within the length limit")
        return None
    return ids, labels


def _leading_chars(tok, text: str, n: int) -> int:
    """How many characters of `text` its first `n` tokens (tokenised alone) cover; at least 1."""
    try:
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except (NotImplementedError, TypeError, ValueError, KeyError):   # a slow tokenizer: estimate by length
        offsets = None
    if offsets:
        cut = offsets[n][0] if n < len(offsets) else len(text)
    else:
        cut = len(text) * n // max(1, len(tok(text, add_special_tokens=False)["input_ids"]))
    return max(cut, 1)


def _cut_content_start(tok, msgs: list[dict], i: int, budget: int, length: int,
                       keep_min: int) -> tuple[list[dict], int]:
    """msgs with message i's content cut from its start until the prompt has at most `budget` tokens or
    `keep_min` characters are left; returns them and the prompt's length."""
    while length > budget and len(msgs[i]["content"]) > keep_min:
        text = msgs[i]["content"]
        cut = min(_leading_chars(tok, text, length - budget), len(text) - keep_min)
        msgs = msgs[:i] + [{**msgs[i], "content": text[cut:]}] + msgs[i + 1:]
        length = len(prompt_ids(tok, msgs))
    return msgs, length


def left_cut_prompt(tok, prompt: list[dict], budget: int) -> tuple[list[dict], bool]:
    """`prompt` cut from the left until apply_chat_template(prompt, add_generation_prompt=True) has at
    most `budget` tokens: first whole turns, oldest first (a turn starts at a user message; leading
    system messages stay), then the start of the first remaining message's content (down to one
    character), then the start of the system messages' contents. Returns (messages, True), or the most
    cut prompt and False when even that is longer than `budget`."""
    length = len(prompt_ids(tok, prompt))
    if length <= budget:
        return prompt, True
    head = next((i for i, m in enumerate(prompt) if m["role"] != "system"), len(prompt))
    system, body = prompt[:head], prompt[head:]
    starts = [i for i, m in enumerate(body) if i > 0 and m["role"] == "user"]
    lo, hi = 0, len(starts)        # the first start that fits is in starts[lo:hi] (or none: hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(prompt_ids(tok, system + body[starts[mid]:])) <= budget:
            hi = mid
        else:
            lo = mid + 1
    if lo < len(starts):
        return system + body[starts[lo]:], True
    msgs = system + (body[starts[-1]:] if starts else body)
    length = len(prompt_ids(tok, msgs))
    # The first remaining message keeps at least a character (a template may drop an empty message, and
    # with it the turn); then the system messages' contents, which may go.
    for i, keep_min in [(head, 1)] * (head < len(msgs)) + [(i, 0) for i in range(head)]:
        msgs, length = _cut_content_start(tok, msgs, i, budget, length, keep_min)
        if length <= budget:
            return msgs, True
    return msgs, False


def _prompt_fits(tok, prompt: list[dict], answers: list[dict], limit: int,
                 report: CleanReport) -> list[Example] | None:
    """overlong="truncate_prompt": prompt + each answer within `limit`, all with the same (left-cut) prompt.

    The answers stay whole when a prompt cut from the left leaves room for the longest; else the prompt is
    cut to at most limit // 2 tokens and each sequence cut at `limit` (counted in `truncated`). A cut
    prompt alone is counted in `prompt_truncated`. None (counted) if no answer token is left."""
    prompt = cut_messages(tok, prompt, limit, keep="tail")
    answers = [cut_messages(tok, [a], limit, keep="head")[0] for a in answers]
    full = [chat_tokens(tok, prompt + [a]) for a in answers]
    if all(len(ids) <= limit for ids, _, _ in full):
        out = [(ids, labels) for ids, labels, _ in full]
    else:
        need = max(len(ids) - start for ids, _, start in full)   # the longest answer + its end-of-turn token(s)
        cut, fits = left_cut_prompt(tok, prompt, limit - need) if need < limit else (prompt, False)
        if fits:
            out = [tokenize_chat(tok, cut + [a]) for a in answers]
            fits = all(len(ids) <= limit for ids, _ in out)
        if fits:
            report.prompt_truncated += 1
        else:   # the answer alone does not fit: keep half the room for the prompt, cut the answers' ends
            cut, _ = left_cut_prompt(tok, prompt, limit // 2)
            out = [(ids[:limit], labels[:limit]) for ids, labels in (tokenize_chat(tok, cut + [a]) for a in answers)]
            report.truncated += 1
    for ids, labels in out:
        if _has_target(ids, labels, report) is None:
            return None
    return out


def _last_answer(messages: list[dict]) -> int:
    return max((k for k, m in enumerate(messages) if m["role"] == "assistant" and k > 0), default=-1)


def sft_examples(conversations: Iterable[list[dict]], tok, *, seq_len: int, overlong: str, min_tokens: int,
                 report: CleanReport) -> Iterator[Example]:
    """Conversations as (ids, labels); a message is cut to what seq_len can use before tokenising."""
    _check_overlong(overlong)
    for messages in conversations:
        try:
            if overlong == "truncate_prompt" and (last := _last_answer(messages)) > 0:
                got = _prompt_fits(tok, messages[:last], [messages[last]], seq_len, report)
                ex = got[0] if got else None
            else:
                ex = _fit(tokenize_chat(tok, cut_messages(tok, messages, seq_len)), seq_len, overlong, report)
        except ChatRowError as e:
            report.drop(e.reason, str(e))
            continue
        if ex is None:
            continue
        if len(ex[0]) < min_tokens:
            report.drop("min_tokens", f"{len(ex[0])} tokens")
            continue
        report.kept += 1
        yield ex


def dpo_examples(pairs: Iterable[tuple[list[dict], dict, dict]], tok, *, seq_len: int, overlong: str,
                 report: CleanReport) -> Iterator[Example]:
    """Chosen then rejected, consecutively; each at most seq_len // 2 so a pair shares a row. With
    truncate_prompt both keep the same prompt, cut from the left for the longer answer."""
    _check_overlong(overlong)
    for prompt, chosen, rejected in pairs:
        got = _same_prompt(tok, prompt, [chosen, rejected], seq_len // 2, overlong, report)
        if got is not None:
            report.kept += 1
            yield from got


def kto_examples(rows: Iterable, tok, *, seq_len: int, overlong: str, report: CleanReport,
                 desirable: list[bool]) -> Iterator[Example]:
    """KTO's unpaired rows as pairs like DPO's: the row's own answer, then the next row's answer to this row's prompt
    (the mismatched (x, y') pair KTO's KL estimate is made of; the last row takes the first row's answer). Appends
    each kept row's label to `desirable`, in order."""
    _check_overlong(overlong)
    rows = iter(rows)
    first = prev = next(rows, None)
    if first is None:
        return
    for cur in itertools.chain(rows, [first]):
        got = _same_prompt(tok, prev.prompt, [prev.completion, cur.completion], seq_len // 2, overlong, report)
        if got is not None:
            report.kept += 1
            desirable.append(prev.desirable)
            yield from got
        prev = cur


def _same_prompt(tok, prompt: list[dict], answers: list[dict], limit: int, overlong: str,
                 report: CleanReport) -> list[Example] | None:
    """prompt + each answer, each at most `limit` tokens; None (counted) if the row is dropped."""
    try:
        if overlong == "truncate_prompt":
            return _prompt_fits(tok, prompt, answers, limit, report)
        truncated, out = report.truncated, []
        for a in answers:
            e = _fit(tokenize_chat(tok, cut_messages(tok, prompt + [a], limit)), limit, overlong, report)
            if e is None:
                break
            out.append(e)
        report.truncated = min(report.truncated, truncated + 1)   # one row, counted once
        return out if len(out) == len(answers) else None
    except ChatRowError as e:
        report.drop(e.reason, str(e))
        return None


def _check_overlong(overlong: str) -> None:
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")


def tokenized(kind: str, data_sha256: str, tokenizer_dir: Path, examples: Iterable[Example], *, cache_root: Path,
              settings: dict, report: CleanReport, group_meta: dict | None = None) -> TokenStore:
    """Cached by tokenizer + data content + settings + this code; `examples` is consumed only on a miss."""
    key = {"kind": kind, "tokenizer": tokenizer_digest(tokenizer_dir), "data": data_sha256,
           "settings": settings, "code": code_version(("data",))}
    return cached_token_store(Path(cache_root), key, lambda: examples, group_size=2 if kind in ("dpo", "kto") else 1,
                              meta_fn=lambda: {"clean": report.as_dict(), **(group_meta or {})})
