"""Bounded input: data.max_line_bytes per line / element / field, long text cut before tokenising,
short quoted values and short, optional dropped-row examples, and memory that stays bounded."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from glm_lora.configs.schema import DataConfig
from glm_lora.data import encode, formats
from glm_lora.data.cleaning import EXAMPLE_CHARS, MAX_EXAMPLES, CleanReport, clean_conversations, clean_pairs, clean_texts
from glm_lora.data.formats import MAX_LINE_BYTES, DataError, iter_rows, read_dpo, read_pretrain, read_sft
from glm_lora.data.synthetic import generate
from glm_lora.data.encode import IGNORE, cut_messages, dpo_examples, lm_examples, sft_examples, usable_chars
from glm_lora.data.tokenizer import load_tokenizer, tokenize_chat, train_tokenizer

REPO = Path(__file__).resolve().parents[2]
LIMIT = 1024
TOO_LONG = "longer than data.max_line_bytes (1 KiB)"


def msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_defaults_agree_with_the_config():
    assert DataConfig().max_line_bytes == MAX_LINE_BYTES == 8 << 20
    assert DataConfig().report_examples == MAX_EXAMPLES == 3 and EXAMPLE_CHARS == 200


# ---------------------------------------------------------------- lines (JSONL, .txt)

@pytest.mark.parametrize("suffix", ["jsonl", "txt"])
def test_line_over_the_limit_names_file_and_line_and_is_skippable(tmp_path, monkeypatch, suffix):
    monkeypatch.setattr(formats, "_CHUNK", 100)   # the rest of the long line is read past in many chunks

    def line(text: str) -> str:
        return json.dumps({"text": text}) if suffix == "jsonl" else text

    fits = "x" * (LIMIT - len(line("")))           # a line of exactly LIMIT bytes
    assert len(line(fits).encode()) == LIMIT
    path = tmp_path / f"docs.{suffix}"
    path.write_text("\n".join([line("first"), line(fits), line("y" * 5000), line("after"), line(fits)]))
    with pytest.raises(DataError) as e:
        list(read_pretrain(path, max_line_bytes=LIMIT))
    assert str(e.value) == f"{path}:3: line {TOO_LONG}"
    report = CleanReport()
    assert list(read_pretrain(path, max_line_bytes=LIMIT, on_bad_row="skip", report=report)) == [
        "first", fits, "after", fits]   # the last line has no newline: exactly LIMIT still fits
    assert (report.rows, report.dropped) == (5, {"bad_row": 1})
    assert report.examples["bad_row"] == [f"{path}:3: line {TOO_LONG}"]
    assert [n for n, _ in iter_rows(path, max_line_bytes=LIMIT, on_bad_row="skip", report=CleanReport())] == [
        1, 2, 4, 5]
    # one byte more at the end of the file, without a newline, is over too
    path.write_text(line("first") + "\n" + line(fits + "z"))
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:2: line {re.escape(TOO_LONG)}$"):
        list(read_pretrain(path, max_line_bytes=LIMIT))


def test_line_limit_counts_bytes_not_characters(tmp_path):
    path = tmp_path / "zh.txt"
    path.write_text("中" * 341 + "\n" + "中" * 342 + "\n")   # 1023 and 1026 bytes
    report = CleanReport()
    assert list(read_pretrain(path, max_line_bytes=LIMIT, on_bad_row="skip", report=report)) == ["中" * 341]
    assert report.dropped == {"bad_row": 1}


def test_limit_is_checked(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "a"}\n')
    for bad in (0, -1, 1.5, True, "8MiB"):
        with pytest.raises(ValueError, match="max_line_bytes must be a positive number"):
            read_pretrain(path, max_line_bytes=bad)


# ---------------------------------------------------------------- JSON arrays

@pytest.mark.parametrize("chunk", [7, 1 << 20])
@pytest.mark.parametrize("big", ["b" * 5000, "中" * 400], ids=["ascii", "cjk-1200-bytes"])
def test_json_array_element_over_the_limit_raises_even_when_skipping(tmp_path, monkeypatch, chunk, big):
    monkeypatch.setattr(formats, "_CHUNK", chunk)
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": big}, {"text": "c"}], indent=1, ensure_ascii=False))
    for kw in ({}, {"on_bad_row": "skip", "report": CleanReport()}):
        with pytest.raises(DataError, match=rf"^{path}:5: row 2: .*{re.escape(TOO_LONG)}$"):
            list(read_pretrain(path, max_line_bytes=LIMIT, **kw))
    assert list(read_pretrain(path, max_line_bytes=1 << 20)) == ["a", big, "c"]


# ---------------------------------------------------------------- Parquet / Arrow / save_to_disk

BIG = "z" * 5000


def _sft_rows() -> list[dict]:
    rows = [{"conversations": msgs(("user", f"q{i}"), ("assistant", f"a{i}"))} for i in range(6)]
    rows[3] = {"conversations": msgs(("user", "q"), ("assistant", BIG))}
    return rows


def _write_arrow(path: Path, table: pa.Table) -> Path:
    with pa.ipc.new_file(str(path), table.schema) as w:
        for batch in table.to_batches(max_chunksize=2):
            w.write_batch(batch)
    return path


@pytest.mark.parametrize("container", ["parquet", "arrow", "save_to_disk"])
def test_table_field_over_the_limit_names_row_and_field(tmp_path, monkeypatch, container):
    monkeypatch.setattr(formats, "_BATCH", 2)   # the long row in the second batch, at an offset
    table = pa.Table.from_pylist(_sft_rows())
    if container == "parquet":
        path = tmp_path / "sft.parquet"
        pq.write_table(table, path, row_group_size=4)
    elif container == "arrow":
        path = _write_arrow(tmp_path / "sft.arrow", table)
    else:
        path = tmp_path / "ds"
        datasets.Dataset(table).save_to_disk(path)
    want = (rf"^{path}: row 4: field 'conversations\[1\]\.content': a value of 5000 bytes, "
            r"longer than data.max_line_bytes \(1 KiB\)$")
    with pytest.raises(DataError, match=want):
        list(read_sft(path, max_line_bytes=LIMIT))
    report = CleanReport()
    good = list(read_sft(path, max_line_bytes=LIMIT, on_bad_row="skip", report=report))
    assert good == [r["conversations"] for k, r in enumerate(_sft_rows()) if k != 3]
    assert (report.rows, report.dropped) == (6, {"bad_row": 1})
    assert len(list(read_sft(path, max_line_bytes=1 << 20))) == 6


@pytest.mark.parametrize("reader,rows,field", [
    (read_pretrain, [{"text": "ok", "id": 1}, {"text": BIG, "id": 2}], "text"),
    (read_sft, [{"instruction": "i", "input": None, "output": "o"}, {"instruction": "i", "input": "", "output": BIG}],
     "output"),
    (read_dpo, [{"prompt": "q", "chosen": msgs(("assistant", "a")), "rejected": msgs(("assistant", "b"))},
                {"prompt": "q", "chosen": msgs(("assistant", "a")), "rejected": msgs(("assistant", BIG))}],
     "rejected[0].content"),
    (read_pretrain, [{"text": "ok", "meta": {"tags": ["a"]}}, {"text": "ok", "meta": {"tags": ["b", BIG]}}],
     "meta.tags[1]"),   # any column counts: the row is never turned into Python objects
])
def test_parquet_field_paths(tmp_path, reader, rows, field):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=rf"^{path}: row 2: field '{re.escape(field)}': a value of 5000 bytes"):
        list(reader(path, max_line_bytes=LIMIT))


# ---------------------------------------------------------------- quoted values

HUGE = "r" * 1_000_000


@pytest.mark.parametrize("row,words", [
    ({"conversations": [{"role": HUGE, "content": "q"}, {"role": "assistant", "content": "a"}]},
     "field 'conversations[0].role': expected one of 'system', 'user', 'assistant', got 'rrr"),
    ({"conversations": [{"from": HUGE, "value": "q"}, {"from": "gpt", "value": "a"}]},
     "field 'conversations[0].from': expected one of 'human'"),
    ({HUGE: 1}, "got keys 'rrr"),
    ({f"k{i}": i for i in range(10_000)}, "got keys 'k0', 'k1'"),
])
def test_user_values_in_messages_are_cut(tmp_path, row, words):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        list(read_sft(path))
    msg = str(e.value)
    assert words in msg and len(msg) < 500, msg[:1000]
    report = CleanReport()
    assert list(read_sft(path, on_bad_row="skip", report=report)) == []
    [example] = report.examples["bad_row"]
    assert len(example) <= EXAMPLE_CHARS and example.startswith(f"{path}:1: ")


# ---------------------------------------------------------------- dropped-row examples

def test_dropped_row_examples_are_short_and_optional():
    huge_doc, blank = "d" * 5_000_000, " " * 1_000_000
    conv = msgs(("user", "u" * 1_000_000), ("assistant", "a" * 1_000_000))
    report = CleanReport()
    assert list(clean_texts([huge_doc, huge_doc, blank], dedup=True, report=report)) == [huge_doc]
    assert list(clean_conversations([conv, conv], dedup=True, report=report)) == [conv]
    pair = (conv[:1], conv[1], {"role": "assistant", "content": "b" * 1_000_000})
    assert list(clean_pairs([pair, pair, (pair[0], pair[1], pair[1])], dedup=True, report=report)) == [pair]
    assert report.dropped == {"duplicate": 3, "empty": 1, "identical_pair": 1}
    examples = [e for shown in report.examples.values() for e in shown]
    assert len(examples) == 5 and all(len(e) <= EXAMPLE_CHARS for e in examples), examples
    assert len(json.dumps(report.as_dict())) < 2000

    off = CleanReport(max_examples=0)
    off.drop("bad_row", lambda: pytest.fail("the message is not even made when examples are off"))
    assert list(clean_texts([huge_doc, huge_doc], dedup=True, report=off)) == [huge_doc]
    assert off.dropped == {"bad_row": 1, "duplicate": 1} and off.examples == {}
    capped = CleanReport(max_examples=1)
    for i in range(3):
        capped.drop("empty", f"m{i}")
    assert capped.examples == {"empty": ["m0"]}
    with pytest.raises(ValueError, match="max_examples"):
        CleanReport(max_examples=-1)


# ---------------------------------------------------------------- tokenising long text

@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    files = generate(tmp_path_factory.mktemp("syn"), n_pretrain=300, n_sft=10, n_dpo=10, n_eval=10)
    return train_tokenizer([files["pretrain"]], tmp_path_factory.mktemp("tok"), vocab_size=600)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


class Spy:
    """The tokenizer, recording how many characters each call gets."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, text, **kw):
        self.calls.append(len(text) if isinstance(text, str) else sum(map(len, text)))
        return self.tok(text, **kw)


LONG_DOCS = ["short one.", "The sky is blue.\nAmy has 3 red balls.\n天空是蓝色的。\n" * 40, "",
             "abcdefghij" * 300, "x", "Line one\n" * 200 + "no newline at the end"]


def test_long_documents_are_tokenised_in_segments_with_the_same_chunks(tok, monkeypatch):
    want_report = CleanReport()
    want = list(lm_examples(LONG_DOCS, tok, seq_len=16, min_tokens=2, report=want_report))
    monkeypatch.setattr(encode, "SEGMENT_CHARS", 100)
    monkeypatch.setattr(encode, "BATCH_CHARS", 150)
    spy, report = Spy(tok), CleanReport()
    got = list(lm_examples(LONG_DOCS, spy, seq_len=16, min_tokens=2, report=report))
    assert got == want and report == want_report
    assert max(spy.calls) <= 150 and len(spy.calls) > 30
    # min_tokens still judges the whole document
    for min_tokens in (10_000, 5):
        r, full = CleanReport(), CleanReport()
        monkeypatch.setattr(encode, "SEGMENT_CHARS", 100)
        got = list(lm_examples(LONG_DOCS[1:2], tok, seq_len=16, min_tokens=min_tokens, report=r))
        monkeypatch.setattr(encode, "SEGMENT_CHARS", 1 << 20)
        assert got == list(lm_examples(LONG_DOCS[1:2], tok, seq_len=16, min_tokens=min_tokens, report=full))
        assert r == full and (r.kept, r.dropped) == ((0, {"min_tokens": 1}) if min_tokens > 5 else (1, {}))


def test_normal_rows_are_not_cut(tok):
    conv = msgs(("system", "be brief"), ("user", "What is 12 + 7?"), ("assistant", "19"))
    assert cut_messages(tok, conv, 64) is conv
    assert usable_chars(tok, 64) >= 2 * 64 * 12   # pieces here are up to ~12 characters (<|im_start|>)


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
@pytest.mark.parametrize("where", ["user", "assistant", "system"])
def test_sft_and_dpo_cut_changes_nothing(tok, overlong, where):
    """A message cut to usable_chars gives the tokens (and verdicts) the whole message gives."""
    seq_len = 32
    filler = "The sky is blue. 天空是蓝色的。 Amy has 3 balls.\n"
    huge = filler * (3 * usable_chars(tok, seq_len) // len(filler))
    conv = msgs(("system", huge if where == "system" else "s"), ("user", huge if where == "user" else "q"),
                ("assistant", huge if where == "assistant" else "a"))
    assert cut_messages(tok, conv, seq_len) is not conv
    ids, labels = tokenize_chat(tok, conv)               # the whole thing, as before the cut
    report = CleanReport()
    got = list(sft_examples([conv], tok, seq_len=seq_len, overlong=overlong, min_tokens=1, report=report))
    if overlong == "drop":
        assert got == [] and report.dropped == {"overlong": 1}
    elif all(lab == IGNORE for lab in labels[1:seq_len]):
        assert got == [] and report.dropped == {"no_target": 1} and report.truncated == 1
    else:
        assert got == [(ids[:seq_len], labels[:seq_len])] and report.truncated == 1

    prompt, chosen = conv[:2], conv[2]
    rejected = {"role": "assistant", "content": "no"}
    report = CleanReport()
    got = list(dpo_examples([(prompt, chosen, rejected)], tok, seq_len=2 * seq_len, overlong=overlong,
                            report=report))
    c, r = tokenize_chat(tok, prompt + [chosen]), tokenize_chat(tok, prompt + [rejected])
    if overlong == "drop":
        assert got == [] and report.dropped == {"overlong": 1}
    elif got:
        assert got == [(c[0][:seq_len], c[1][:seq_len]), (r[0][:seq_len], r[1][:seq_len])]
    else:
        assert report.dropped == {"no_target": 1}


# ---------------------------------------------------------------- memory

MEASURE = """
import json, resource, sys
sys.path.insert(0, {repo!r})
from glm_lora.data.cleaning import CleanReport, clean_conversations, clean_texts
from glm_lora.data.formats import DataError, read_pretrain, read_sft
kind, path, limit, tok_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if tok_dir != "-":
    from glm_lora.data.encode import lm_examples, sft_examples
    from glm_lora.data.tokenizer import load_tokenizer
    tok = load_tokenizer(tok_dir)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
report, out = CleanReport(), {{}}
try:
    if kind == "read":
        out["rows"] = list(read_pretrain(path, on_bad_row="skip", report=report, max_line_bytes=limit))
        list(read_pretrain(path, max_line_bytes=limit))
    elif kind == "pretrain":
        docs = clean_texts(read_pretrain(path, max_line_bytes=limit, report=report), dedup=False, report=report)
        out["examples"] = sum(1 for _ in lm_examples(docs, tok, seq_len=128, min_tokens=2, report=report))
    else:
        convs = clean_conversations(read_sft(path, max_line_bytes=limit, report=report), dedup=False, report=report)
        out["examples"] = sum(1 for _ in sft_examples(convs, tok, seq_len=128, overlong="truncate", min_tokens=2,
                                                      report=report))
except DataError as e:
    out["error"] = str(e)
out["delta_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
out["report"] = report.as_dict()
print(json.dumps(out))
"""
UNIT = "The sky is blue. Amy has a red ball; she gives it to Tom. 天空是蓝色的。 "


def _one_long_line(path: Path, mb: float, kind: str) -> Path:
    """A JSONL file: a short row, one row of `mb` MB on one line, a short row (written in chunks)."""
    reps = int(mb * 2**20 / len(UNIT.encode()))
    head, tail = ('{"text": "', '"}\n') if kind != "sft" else (
        '{"conversations": [{"role": "user", "content": "', '"}, {"role": "assistant", "content": "ok"}]}\n')
    short = ('{"text": "before"}\n' if kind != "sft" else
             '{"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n')
    with open(path, "w", encoding="utf-8") as f:
        f.write(short + head)
        for _ in range(reps // 1000):
            f.write(UNIT * 1000)
        f.write(UNIT * (reps % 1000) + tail + short.replace("before", "after"))
    return path


def _measure(kind: str, path: Path, limit: int, tok_dir: str = "-") -> dict:
    proc = subprocess.run([sys.executable, "-c", MEASURE.format(repo=str(REPO)), kind, str(path), str(limit), tok_dir],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_50_mb_line_is_refused_in_bounded_memory(tmp_path):
    path = _one_long_line(tmp_path / "big.jsonl", 50, "pretrain")
    try:
        m = _measure("read", path, MAX_LINE_BYTES)
    finally:
        path.unlink()
    assert m["rows"] == ["before", "after"] and m["report"]["dropped"] == {"bad_row": 1}
    assert m["error"] == f"{path}:2: line longer than data.max_line_bytes (8 MiB)"
    assert m["delta_mb"] < 64, m        # was ~150 MB to read it, and ~8.5 GB to tokenise it


def test_tokenising_a_long_row_stays_bounded(tok_dir, tmp_path):
    sft = _one_long_line(tmp_path / "sft.jsonl", 50, "sft")
    try:      # a 50 MB message (the limit raised for it): cut to what seq_len can use before tokenising
        m = _measure("sft", sft, 64 << 20, str(tok_dir))
    finally:
        sft.unlink()
    assert m["examples"] == 2 and m["report"]["truncated"] == 1 and m["delta_mb"] < 1024, m   # was ~8.7 GB
    doc = _one_long_line(tmp_path / "doc.jsonl", 5, "pretrain")
    try:      # a 5 MB document (under the default limit): tokenised a segment at a time, every chunk kept
        m = _measure("pretrain", doc, MAX_LINE_BYTES, str(tok_dir))
    finally:
        doc.unlink()
    assert m["examples"] > 30_000 and m["report"]["kept"] == 3 and m["delta_mb"] < 600, m   # was ~930 MB
