"""Tokenise a split once into a memory-mapped TokenStore, applying the token-level cleaning rules.

Pretraining documents longer than seq_len are split into seq_len chunks (each its own
document); SFT conversations and DPO pairs are truncated or dropped per `overlong`. Every
dropped row is counted by reason in the CleanReport stored with the tokens.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Iterator

from artifacts import sha256_file
from data.cleaning import CleanReport
from data.token_store import TokenStore, cached_token_store
from data.tokenizer import tokenize_chat

IGNORE = -100
Example = tuple[list[int], list[int]]
CODE = hashlib.sha256(b"".join(Path(__file__).with_name(f).read_bytes()
                               for f in ("tokenize.py", "tokenizer.py", "formats.py", "cleaning.py"))).hexdigest()[:16]


def tokenizer_digest(tokenizer_dir: Path) -> str:
    files = sorted(p for p in Path(tokenizer_dir).iterdir() if p.is_file() and p.name != "manifest.json")
    return hashlib.sha256(b"".join(sha256_file(p).encode() for p in files)).hexdigest()


def lm_examples(texts: Iterable[str], tok, *, seq_len: int, min_tokens: int, report: CleanReport,
                batch: int = 512) -> Iterator[Example]:
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
    for text in texts:
        buf.append(text)
        if len(buf) == batch:
            yield from chunks(buf)
            buf = []
    yield from chunks(buf)


def _fit(example: Example, limit: int, overlong: str, report: CleanReport) -> Example | None:
    ids, labels = example
    if len(ids) > limit:
        if overlong == "drop":
            report.drop("overlong", f"{len(ids)} > {limit} tokens")
            return None
        ids, labels = ids[:limit], labels[:limit]
        report.truncated += 1
    if all(lab == IGNORE for lab in labels[1:]):
        report.drop("no_target", "no assistant token within the length limit")
        return None
    return ids, labels


def sft_examples(conversations: Iterable[list[dict]], tok, *, seq_len: int, overlong: str, min_tokens: int,
                 report: CleanReport) -> Iterator[Example]:
    for messages in conversations:
        ex = _fit(tokenize_chat(tok, messages), seq_len, overlong, report)
        if ex is None:
            continue
        if len(ex[0]) < min_tokens:
            report.drop("min_tokens", f"{len(ex[0])} tokens")
            continue
        report.kept += 1
        yield ex


def dpo_examples(pairs: Iterable[tuple[list[dict], dict, dict]], tok, *, seq_len: int, overlong: str,
                 report: CleanReport) -> Iterator[Example]:
    """Chosen then rejected, consecutively; each at most seq_len // 2 so a pair shares a row."""
    limit = seq_len // 2
    for prompt, chosen, rejected in pairs:
        c = _fit(tokenize_chat(tok, prompt + [chosen]), limit, overlong, report)
        r = _fit(tokenize_chat(tok, prompt + [rejected]), limit, overlong, report) if c else None
        if c is None or r is None:
            continue
        report.kept += 1
        yield c
        yield r


def tokenized(kind: str, data_sha256: str, tokenizer_dir: Path, examples: Iterable[Example], *, cache_root: Path,
              settings: dict, report: CleanReport) -> TokenStore:
    """Cached by tokenizer + data content + settings + this code; `examples` is consumed only on a miss."""
    key = {"kind": kind, "tokenizer": tokenizer_digest(tokenizer_dir), "data": data_sha256,
           "settings": settings, "code": CODE}
    return cached_token_store(Path(cache_root), key, lambda: examples, group_size=2 if kind == "dpo" else 1,
                              meta_fn=lambda: {"clean": report.as_dict()})
