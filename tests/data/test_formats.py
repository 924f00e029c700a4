import json
from pathlib import Path

import pytest

from data.formats import DataError, iter_jsonl, read_dpo, read_pretrain, read_sft


def write(tmp_path: Path, lines: list, name: str = "rows.jsonl") -> Path:
    """Write rows (dicts are JSON-encoded, str/bytes written raw) after one good row and a blank line."""
    good = {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}],
            "text": "a document"}
    body = [json.dumps(good).encode(), b""]
    for x in lines:
        body.append(x if isinstance(x, bytes) else (x if isinstance(x, str) else json.dumps(x, ensure_ascii=False)).encode())
    path = tmp_path / name
    path.write_bytes(b"\n".join(body) + b"\n")
    return path


def msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


U, A = ("user", "q"), ("assistant", "a")

# (reader, bad row on line 3, field named in the error or None, words the message must contain)
CATALOGUE = [
    (read_sft, '{"conversations": [{"role": "user", "con', None, "invalid JSON"),
    (read_sft, b'{"text": "caf\xe9"}', None, "invalid UTF-8"),
    (read_sft, "[1, 2]", None, "expected a JSON object"),
    (read_sft, {"conv": []}, "conversations", "missing"),
    (read_sft, {"conversations": []}, "conversations", "empty conversation"),
    (read_sft, {"messages": "hi"}, "messages", "expected a list"),
    (read_sft, {"conversations": msgs(U, ("bot", "a"))}, "conversations[1].role",
     "expected one of 'system', 'user', 'assistant', got 'bot'"),
    (read_sft, {"conversations": [{"role": "user"}, {"role": "assistant", "content": "a"}]},
     "conversations[0].content", "missing"),
    (read_sft, {"conversations": msgs(U, ("assistant", "  "))}, "conversations[1].content", "empty"),
    (read_sft, {"conversations": [{"role": "user", "content": 5}, dict(zip(("role", "content"), A))]},
     "conversations[0].content", "expected a string, got int"),
    (read_sft, {"conversations": msgs(U, A, U)}, "conversations[2].role", "last message must be 'assistant'"),
    (read_dpo, {"chosen": msgs(U, A), "rejected": msgs(("user", "other"), ("assistant", "b"))},
     "rejected[0]", "differs from 'chosen[0]'"),
    (read_dpo, {"chosen": msgs(("system", "s"), U, A), "rejected": msgs(U, A)}, "rejected", "has 2 messages"),
    (read_dpo, {"chosen": msgs(U, A), "rejected": msgs(A, U)}, "rejected[1].role", "last message"),
    (read_dpo, {"chosen": msgs(A), "rejected": msgs(("assistant", "b"))}, "chosen", "prompt message"),
    (read_dpo, {"chosen": msgs(U, A)}, "rejected", "missing"),
    (read_dpo, {"prompt": "q", "chosen": "a", "rejected": ""}, "rejected", "empty"),
    (read_pretrain, {"text": 3}, "text", "expected a string"),
    (read_pretrain, {"txt": "x"}, "text", "missing"),
]


@pytest.mark.parametrize("reader,bad,field,words", CATALOGUE,
                         ids=[f"{r.__name__}-{w[:24]}" for r, _, _, w in CATALOGUE])
def test_bad_rows_name_file_line_and_field(tmp_path, reader, bad, field, words):
    path = write(tmp_path, [bad])
    with pytest.raises(DataError) as e:
        list(reader(path))
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: "), msg  # line 1 good, line 2 blank
    if field:
        assert f"field '{field}'" in msg, msg
    assert words in msg, msg


def test_error_is_raised_lazily_at_the_bad_row(tmp_path):
    rows = read_sft(write(tmp_path, ["{oops"]))
    assert next(rows)[0] == {"role": "user", "content": "hi"}
    with pytest.raises(DataError, match=":3: invalid JSON"):
        next(rows)


def test_good_variants(tmp_path):
    sft = write(tmp_path, [{"messages": [{"role": "system", "content": "be brief", "extra": 1},
                                         {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}])
    assert list(read_sft(sft))[1] == msgs(("system", "be brief"), U, A)

    dpo = write(tmp_path, [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    assert list(read_dpo(dpo)) == [(msgs(U), {"role": "assistant", "content": "a"},
                                    {"role": "assistant", "content": "b"})] * 2

    assert [n for n, _ in iter_jsonl(write(tmp_path, [{"x": 1}]))] == [1, 3]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes('\ufeff{"text": "中文"}\n'.encode())
    assert list(read_pretrain(bom)) == ["中文"]


def test_txt_one_document_per_non_empty_line(tmp_path):
    txt = tmp_path / "corpus.txt"
    txt.write_bytes("first doc\r\n\n  \nsecond 文档\n".encode())
    assert list(read_pretrain(txt)) == ["first doc", "second 文档"]
    txt.write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(DataError, match=r"corpus\.txt:2: invalid UTF-8"):
        list(read_pretrain(txt))
