import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from glm_lora.data import formats
from glm_lora.data.cleaning import CleanReport
from glm_lora.data.formats import DataError, iter_rows, read_dpo, read_pretrain, read_sft

GOOD = {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}],
        "text": "a document"}


def encode(x) -> bytes:
    """dicts/lists are JSON-encoded, str/bytes written raw."""
    return x if isinstance(x, bytes) else (x if isinstance(x, str) else json.dumps(x, ensure_ascii=False)).encode()


def write(tmp_path: Path, lines: list, name: str = "rows.jsonl") -> Path:
    """JSONL: one good row, a blank line, then `lines` (so the first bad row is on line 3)."""
    path = tmp_path / name
    path.write_bytes(b"\n".join([encode(GOOD), b""] + [encode(x) for x in lines]) + b"\n")
    return path


def write_array(tmp_path: Path, bad, name: str = "rows.json") -> Path:
    """A JSON array: '[' on line 1, the good row on line 2, the bad row (row 2) on line 3."""
    path = tmp_path / name
    path.write_bytes(b"[\n" + encode(GOOD) + b",\n" + encode(bad) + b"\n]\n")
    return path


def write_parquet(tmp_path: Path, rows: list[dict], name: str = "rows.parquet") -> Path:
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / name)
    return tmp_path / name


def msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


U, A = ("user", "q"), ("assistant", "a")
ANSWER_A, ANSWER_B = {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}

# (reader, bad row (row 2, on line 3), field named in the error or None, words the message must contain)
CATALOGUE = [
    (read_sft, '{"conversations": [{"role": "user", "con', None, "invalid JSON"),
    (read_sft, b'{"text": "caf\xe9"}', None, "invalid UTF-8"),
    (read_sft, "[1, 2]", None, "expected a JSON object, got list"),
    (read_sft, {"conv": []}, None, "expected a 'conversations' or 'messages' list, or Alpaca"),
    (read_sft, {"conversations": []}, "conversations", "empty conversation"),
    (read_sft, {"messages": "hi"}, "messages", "expected a list"),
    (read_sft, {"conversations": msgs(U, ("bot", "a"))}, "conversations[1].role",
     "expected one of 'system', 'user', 'assistant', got 'bot'"),
    (read_sft, {"conversations": [{"role": "user"}, {"role": "assistant", "content": "a"}]},
     "conversations[0].content", "missing"),
    (read_sft, {"conversations": [{"role": "user", "content": 5}, dict(zip(("role", "content"), A))]},
     "conversations[0].content", "expected a string, got int"),
    (read_sft, {"conversations": [{"role": "user", "content": None}, dict(zip(("role", "content"), A))]},
     "conversations[0].content", "expected a string, got null"),
    (read_sft, {"conversations": msgs(U, A, U)}, "conversations[2]", "last message must be 'assistant'"),
    (read_sft, {"conversations": ["hi"]}, "conversations[0]", "expected an object with 'role'"),
    # ShareGPT
    (read_sft, {"conversations": [{"from": "bot", "value": "q"}, {"from": "gpt", "value": "a"}]},
     "conversations[0].from", "expected one of 'human', 'gpt', 'system'"),
    (read_sft, {"conversations": [{"from": "human"}, {"from": "gpt", "value": "a"}]},
     "conversations[0].value", "missing"),
    (read_sft, {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]},
     "conversations[1]", "last message must be 'assistant', got 'user'"),
    # Alpaca
    (read_sft, {"instruction": "do it", "input": ""}, "output", "missing"),
    (read_sft, {"instruction": "do it", "output": None}, "output", "expected a string, got null"),
    (read_sft, {"instruction": "do it", "input": 3, "output": "ok"}, "input", "expected a string, got int"),
    (read_sft, {"instruction": ["do it"], "output": "ok"}, "instruction", "expected a string, got list"),
    # DPO
    (read_dpo, '{"chosen": [', None, "invalid JSON"),
    (read_dpo, b'{"prompt": "\xff", "chosen": "a", "rejected": "b"}', None, "invalid UTF-8"),
    (read_dpo, {"chosen": msgs(U, A), "rejected": msgs(("user", "other"), ("assistant", "b"))},
     "rejected[0]", "differs from 'chosen[0]'"),
    (read_dpo, {"chosen": msgs(("system", "s"), U, A), "rejected": msgs(U, A)}, "rejected", "has 2 messages"),
    (read_dpo, {"chosen": msgs(U, A), "rejected": msgs(A, U)}, "rejected[1]", "last message"),
    (read_dpo, {"chosen": msgs(A), "rejected": msgs(("assistant", "b"))}, "chosen", "prompt message"),
    (read_dpo, {"chosen": msgs(U, A, A), "rejected": msgs(U, A, ("assistant", "b"))}, "chosen[1]",
     "prompt must end with 'user'"),
    (read_dpo, {"chosen": msgs(U, A)}, "rejected", "missing"),
    (read_dpo, {"chosen": msgs(U, ("critic", "a")), "rejected": msgs(U, A)}, "chosen[1].role", "got 'critic'"),
    (read_dpo, {"chosen": [], "rejected": []}, "chosen", "empty conversation"),
    (read_dpo, {"prompt": "q", "chosen": "a", "rejected": 3}, "rejected", "expected a string or a one-message list"),
    (read_dpo, {"prompt": "q", "rejected": "b"}, "chosen", "missing"),
    (read_dpo, {"prompt": 7, "chosen": "a", "rejected": "b"}, "prompt", "expected a string or a list of messages"),
    (read_dpo, {"prompt": msgs(U, A), "chosen": "a", "rejected": "b"}, "prompt[1]", "last message must be 'user'"),
    (read_dpo, {"prompt": msgs(U), "chosen": msgs(U), "rejected": "b"}, "chosen[0]", "must be 'assistant'"),
    # pretrain
    (read_pretrain, '{"text": "unterminated', None, "invalid JSON"),
    (read_pretrain, b'{"text": "\xc3"}', None, "invalid UTF-8"),
    (read_pretrain, '"just a string"', None, "expected a JSON object, got str"),
    (read_pretrain, {"text": 3}, "text", "expected a string"),
    (read_pretrain, {"txt": "x"}, "text", "missing"),
]
IDS = [f"{r.__name__}-{w[:24]}" for r, _, _, w in CATALOGUE]


@pytest.mark.parametrize("container", ["jsonl", "json-array"])
@pytest.mark.parametrize("reader,bad,field,words", CATALOGUE, ids=IDS)
def test_bad_rows_name_file_line_and_field(tmp_path, container, reader, bad, field, words):
    path = write(tmp_path, [bad]) if container == "jsonl" else write_array(tmp_path, bad)
    with pytest.raises(DataError) as e:
        list(reader(path))
    msg = str(e.value)
    if container == "jsonl":
        assert msg.startswith(f"{path}:3: "), msg  # line 1 good, line 2 blank
    elif words == "invalid JSON":  # a cut-off element: found where the array stops making sense
        assert msg.startswith(f"{path}:") and ": row 2: invalid JSON" in msg, msg
    else:  # '[', the good row, the bad row
        assert msg.startswith(f"{path}:3: " if "invalid UTF-8" in words else f"{path}:3: row 2: "), msg
    if field:
        assert f"field '{field}'" in msg, msg
    assert words in msg, msg


@pytest.mark.parametrize("reader,bad,field,words", CATALOGUE, ids=IDS)
def test_skip_counts_bad_rows_and_keeps_the_good(tmp_path, reader, bad, field, words):
    report = CleanReport()
    path = write(tmp_path, [bad, encode(GOOD)])
    assert len(list(reader(path, on_bad_row="skip", report=report))) == 2
    assert (report.rows, report.dropped) == (3, {"bad_row": 1})
    [example] = report.examples["bad_row"]
    assert example.startswith(f"{path}:3: ") and words[:40] in example


def test_skip_counts_every_bad_row_and_caps_examples(tmp_path):
    bad = ["{oops", b"\xff", {"conversations": []}, {"x": 1}, {"instruction": "i"}, "[]", {"messages": "m"}]
    report = CleanReport(max_examples=5)
    path = write(tmp_path, bad + [{"instruction": "i", "output": "o"}])
    assert len(list(read_sft(path, on_bad_row="skip", report=report))) == 2
    assert report.dropped == {"bad_row": 7} and report.rows == 9
    assert [e.split(": ")[0] for e in report.examples["bad_row"]] == [f"{path}:{n}" for n in range(3, 8)]
    default, off = CleanReport(), CleanReport(max_examples=0)   # data.report_examples: 3 by default; 0 = off
    for r in (default, off):
        assert len(list(read_sft(path, on_bad_row="skip", report=r))) == 2 and r.dropped == {"bad_row": 7}
    assert len(default.examples["bad_row"]) == 3 and off.examples == {} and off.as_dict()["examples"] == {}


def test_bad_policy_is_rejected_up_front(tmp_path):
    path = write(tmp_path, [])
    with pytest.raises(ValueError, match="on_bad_row must be one of"):
        read_sft(path, on_bad_row="ignore")
    with pytest.raises(ValueError, match="needs report="):
        read_sft(path, on_bad_row="skip")


def test_error_is_raised_lazily_at_the_bad_row(tmp_path):
    rows = read_sft(write(tmp_path, ["{oops"]))
    assert next(rows)[0] == {"role": "user", "content": "hi"}
    with pytest.raises(DataError, match=":3: invalid JSON"):
        next(rows)


def test_empty_content_passes_the_reader_for_cleaning(tmp_path):
    sft = write(tmp_path, [{"conversations": msgs(U, ("assistant", "  "))}])
    assert list(read_sft(sft))[1] == msgs(U, ("assistant", "  "))
    assert list(read_pretrain(write(tmp_path, [{"text": ""}, {"text": " "}], "p.jsonl")))[1:] == ["", " "]
    dpo = write(tmp_path, [{"prompt": "q", "chosen": "", "rejected": "b"}], "d.jsonl")
    assert list(read_dpo(dpo))[1][1] == {"role": "assistant", "content": ""}


def test_good_variants(tmp_path):
    sft = write(tmp_path, [{"messages": [{"role": "system", "content": "be brief", "extra": 1},
                                         {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}])
    assert list(read_sft(sft))[1] == msgs(("system", "be brief"), U, A)

    dpo = write(tmp_path, [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    assert list(read_dpo(dpo)) == [(msgs(U), ANSWER_A, ANSWER_B)] * 2

    assert [n for n, _ in iter_rows(write(tmp_path, [{"x": 1}]))] == [1, 3]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes('\ufeff{"text": "中文"}\n'.encode())
    assert list(read_pretrain(bom)) == ["中文"]


def test_sharegpt_and_alpaca(tmp_path):
    rows = [{"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                               {"from": "gpt", "value": "a"}]},
            {"instruction": "Translate", "input": "chat", "output": "猫", "system": "be exact"},
            {"instruction": "Say hi", "input": "  ", "output": "hi"},
            {"instruction": "Say hi", "output": "hi", "input": None, "system": None}]
    got = list(read_sft(write(tmp_path, rows)))[1:]
    assert got == [msgs(("system", "s"), U, A),
                   msgs(("system", "be exact"), ("user", "Translate\n\nchat"), ("assistant", "猫")),
                   msgs(("user", "Say hi"), ("assistant", "hi")),
                   msgs(("user", "Say hi"), ("assistant", "hi"))]


def test_dpo_trl_shapes(tmp_path):
    rows = [{"prompt": msgs(("system", "s"), U), "chosen": [ANSWER_A], "rejected": [ANSWER_B]},
            {"prompt": msgs(U), "chosen": "a", "rejected": "b"},
            {"prompt": "q", "chosen": msgs(U, A), "rejected": msgs(U, ("assistant", "b"))}]  # H4 ultrafeedback
    got = list(read_dpo(write(tmp_path, rows)))[1:]
    assert got == [(msgs(("system", "s"), U), ANSWER_A, ANSWER_B)] + [(msgs(U), ANSWER_A, ANSWER_B)] * 2


def test_txt_one_document_per_non_empty_line(tmp_path):
    txt = tmp_path / "corpus.txt"
    txt.write_bytes("first doc\r\n\n  \nsecond 文档\n".encode())
    assert list(read_pretrain(txt)) == ["first doc", "second 文档"]
    assert [n for n, _ in iter_rows(txt)] == [1, 4]
    txt.write_bytes(b"ok\n\xff\xfe\nfine\n")
    with pytest.raises(DataError, match=r"corpus\.txt:2: invalid UTF-8"):
        list(read_pretrain(txt))
    report = CleanReport()
    assert list(read_pretrain(txt, on_bad_row="skip", report=report)) == ["ok", "fine"]
    assert report.dropped == {"bad_row": 1}


# ---------------------------------------------------------------- JSON arrays

def test_json_array_streams_across_chunks(tmp_path, monkeypatch):
    rows = [{"instruction": f"第{i}题 é", "input": "", "output": str(10 ** i)} for i in range(40)]
    for name, text in (("pretty.json", json.dumps(rows, indent=2, ensure_ascii=False)),
                       ("compact.json", json.dumps(rows, ensure_ascii=False, separators=(",", ":"))),
                       ("spaced.json", "\ufeff  \n" + json.dumps(rows, ensure_ascii=False) + "\n\n")):
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        for chunk in (5, 7, 1 << 20):  # small chunks split UTF-8 characters, numbers and keys
            monkeypatch.setattr(formats, "_CHUNK", chunk)
            assert [obj for _, obj in iter_rows(path)] == rows, (name, chunk)
            assert len(list(read_sft(path))) == 40
    # rows are numbered by index; the error names the line the row starts on too
    monkeypatch.setattr(formats, "_CHUNK", 9)
    rows[17] = {"instruction": "x"}
    path = tmp_path / "pretty.json"
    path.write_text(json.dumps(rows, indent=2, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{path}:{2 + 5 * 17}: row 18: field 'output': missing"):
        list(read_sft(path))
    assert [n for n, _ in iter_rows(tmp_path / "compact.json")][-1] == 40
    empty = tmp_path / "empty.json"
    empty.write_text(" [ ] ")
    assert list(iter_rows(empty)) == []


@pytest.mark.parametrize("text,words", [("[{}, {} {}]", r":1: invalid JSON \(expected ',' or ']' after row 2"),
                                        ('[{"a": 1},\n{"a": ', r":2: row 2: invalid JSON"),
                                        ("[{}]\n[{}]", r":2: unexpected data after"),
                                        ("[{}, ]", r":1: row 2: invalid JSON")])
def test_json_array_structure_errors_raise_even_when_skipping(tmp_path, text, words):
    path = tmp_path / "a.json"
    path.write_text(text)
    with pytest.raises(DataError, match=words):
        list(iter_rows(path, on_bad_row="skip", report=CleanReport()))


def test_json_array_invalid_utf8_names_its_line(tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    path.write_bytes(b'[\n{"text": "ok"},\n{"text": "caf\xe9"}\n]')
    monkeypatch.setattr(formats, "_CHUNK", 4)
    with pytest.raises(DataError, match=rf"^{path}:3: invalid UTF-8"):
        list(read_pretrain(path))


def test_jsonl_suffix_is_never_sniffed_as_an_array(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('[1]\n{"text": "x"}\n')
    report = CleanReport()
    assert list(read_pretrain(path, on_bad_row="skip", report=report)) == ["x"]
    assert "expected a JSON object, got list" in report.examples["bad_row"][0]


# ---------------------------------------------------------------- parquet / arrow / save_to_disk

SFT_ROWS = [{"conversations": msgs(("user", f"q{i}"), ("assistant", f"a{i}"))} for i in range(5)]


def test_parquet_happy_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "_BATCH", 2)  # several batches
    assert list(read_sft(write_parquet(tmp_path, SFT_ROWS))) == [r["conversations"] for r in SFT_ROWS]
    alpaca = write_parquet(tmp_path, [{"instruction": "i", "input": None, "output": "o"},
                                      {"instruction": "i", "input": "x", "output": "o"}], "alpaca.parquet")
    assert list(read_sft(alpaca)) == [msgs(("user", "i"), ("assistant", "o")),
                                      msgs(("user", "i\n\nx"), ("assistant", "o"))]
    sharegpt = write_parquet(tmp_path, [{"conversations": [{"from": "human", "value": "q"},
                                                           {"from": "gpt", "value": "a"}]}], "sharegpt.parquet")
    assert list(read_sft(sharegpt)) == [msgs(U, A)]
    dpo = write_parquet(tmp_path, [{"prompt": msgs(U), "chosen": [ANSWER_A], "rejected": [ANSWER_B]}], "dpo.parquet")
    assert list(read_dpo(dpo)) == [(msgs(U), ANSWER_A, ANSWER_B)]
    docs = write_parquet(tmp_path, [{"text": f"doc {i}", "id": i} for i in range(5)], "docs.parquet")
    assert list(read_pretrain(docs)) == [f"doc {i}" for i in range(5)]
    assert [n for n, _ in iter_rows(docs)] == [1, 2, 3, 4, 5]


def test_parquet_bad_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "_BATCH", 2)
    no_output = write_parquet(tmp_path, [{"instruction": "i", "input": ""}] * 3, "no_output.parquet")
    with pytest.raises(DataError, match=rf"^{no_output}: row 1: field 'output': missing$"):
        list(read_sft(no_output))
    report = CleanReport()
    assert list(read_sft(no_output, on_bad_row="skip", report=report)) == []
    assert (report.rows, report.dropped) == (3, {"bad_row": 3})

    rows = [dict(r) for r in SFT_ROWS]
    rows[4] = {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}
    null = write_parquet(tmp_path, rows, "null.parquet")
    with pytest.raises(DataError, match=rf"^{null}: row 5: field 'conversations\[1\].content': "
                                        "expected a string, got null"):
        list(read_sft(null))

    mixed = write_parquet(tmp_path, [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
                                     {"conversations": [{"from": "bing", "value": "q"}, {"from": "gpt", "value": "a"}]}],
                          "mixed.parquet")
    with pytest.raises(DataError, match=rf"^{mixed}: row 2: field 'conversations\[0\].from': expected one of"):
        list(read_sft(mixed))

    no_text = write_parquet(tmp_path, [{"content": "x"}], "no_text.parquet")
    with pytest.raises(DataError, match=rf"^{no_text}: row 1: field 'text': missing"):
        list(read_pretrain(no_text))

    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        list(read_sft(junk))


@pytest.mark.parametrize("kind", ["file", "stream"])
def test_arrow_files(tmp_path, kind):
    path = tmp_path / "rows.arrow"
    table = pa.Table.from_pylist(SFT_ROWS[:4] + [{"conversations": msgs(U, ("bot", "a"))}])
    with (pa.ipc.new_file if kind == "file" else pa.ipc.new_stream)(str(path), table.schema) as w:
        for batch in table.to_batches(max_chunksize=2):
            w.write_batch(batch)
    with pytest.raises(DataError, match=rf"^{path}: row 5: field 'conversations\[1\].role'"):
        list(read_sft(path))
    report = CleanReport()
    assert len(list(read_sft(path, on_bad_row="skip", report=report))) == 4
    assert report.dropped == {"bad_row": 1}


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    rows = SFT_ROWS + [{"conversations": msgs(U, ("bot", "a"))}]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(tmp_path / "ds")
    with pytest.raises(DataError, match=rf"^{tmp_path / 'ds'}: row 6: field 'conversations\[1\].role': "
                                        "expected one of"):
        list(read_sft(tmp_path / "ds"))
    report = CleanReport()
    assert list(read_sft(tmp_path / "ds", on_bad_row="skip", report=report)) == [r["conversations"] for r in SFT_ROWS]
    assert (report.rows, report.dropped) == (6, {"bad_row": 1})

    test = datasets.Dataset.from_list([{"text": "held out"}])
    datasets.DatasetDict(train=datasets.Dataset.from_list([{"text": "t1"}, {"text": "t2"}]),
                         test=test).save_to_disk(tmp_path / "dd")
    assert list(read_pretrain(tmp_path / "dd")) == ["t1", "t2"]  # "train" by default
    assert list(read_pretrain(tmp_path / "dd" / "test")) == ["held out"]

    datasets.DatasetDict(validation=test).save_to_disk(tmp_path / "no_train")
    with pytest.raises(DataError, match="without a 'train' split .*no_train/validation"):
        read_pretrain(tmp_path / "no_train")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not one written by datasets' save_to_disk"):
        read_pretrain(tmp_path / "plain")


def test_json_file_loadable_by_datasets(tmp_path):
    """A .json array / .jsonl file as `datasets` writes them (to_json) reads the same."""
    ds = datasets.Dataset.from_list([{"instruction": "i", "input": "", "output": f"o{i}"} for i in range(3)])
    ds.to_json(tmp_path / "lines.jsonl")
    ds.to_json(tmp_path / "array.json", lines=False)
    assert list(read_sft(tmp_path / "lines.jsonl")) == list(read_sft(tmp_path / "array.json"))
    assert len(list(read_sft(tmp_path / "array.json"))) == 3
