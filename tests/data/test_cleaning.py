import json

import pytest

from glm_lora.data.cleaning import EXAMPLE_CHARS, MAX_EXAMPLES, CleanReport, clean_conversations, clean_pairs, clean_texts
from glm_lora.data.formats import read_pretrain


def msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_clean_texts_counts_per_reason():
    texts = ["a", "", "  \n", "b", "a", "a ", "b"]
    report = CleanReport(rows=len(texts))
    assert list(clean_texts(texts, dedup=True, report=report)) == ["a", "b", "a "]  # exact duplicates only
    assert report.dropped == {"empty": 2, "duplicate": 2}
    assert report.examples == {"empty": ["''", "'  \\n'"], "duplicate": ["a", "b"]}

    report = CleanReport(rows=len(texts))
    assert list(clean_texts(texts, dedup=False, report=report)) == ["a", "b", "a", "a ", "b"]
    assert report.dropped == {"empty": 2}


def test_clean_conversations():
    good = msgs(("user", "q"), ("assistant", "a"))
    convs = [good, msgs(("user", "q"), ("assistant", " ")), msgs(("user", "q"), ("assistant", "")),
             msgs(("user", "q"), ("assistant", "  "), ("user", "again"), ("assistant", "fine")),
             [dict(m) for m in good], msgs(("system", "s"), ("user", "q"), ("assistant", "a")),
             msgs(("user", "a"), ("assistant", "q"))]
    report = CleanReport(rows=len(convs))
    assert list(clean_conversations(convs, dedup=True, report=report)) == [good, convs[5], convs[6]]
    assert report.dropped == {"empty": 3, "duplicate": 1}
    report = CleanReport()
    assert len(list(clean_conversations(convs, dedup=False, report=report))) == 4
    assert report.dropped == {"empty": 3}


def test_clean_pairs():
    p = msgs(("user", "q"))
    a, b = {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}
    pairs = [(p, a, b), (p, a, {"role": "assistant", "content": "a\n"}), (p, {"role": "assistant", "content": ""}, b),
             (p, a, b), (p, b, a), (msgs(("user", "other")), a, b)]
    report = CleanReport(rows=len(pairs))
    assert list(clean_pairs(pairs, dedup=True, report=report)) == [pairs[0], pairs[4], pairs[5]]
    assert report.dropped == {"identical_pair": 1, "empty": 1, "duplicate": 1}
    report = CleanReport()
    assert len(list(clean_pairs(pairs, dedup=False, report=report))) == 4


def test_examples_are_capped_and_cut():
    report = CleanReport()
    for i in range(MAX_EXAMPLES + 3):
        report.drop("overlong", f"row {i}: " + "x" * 1000)
    report.drop("min_tokens")  # counted without an example
    assert report.dropped == {"overlong": MAX_EXAMPLES + 3, "min_tokens": 1}
    assert len(report.examples["overlong"]) == MAX_EXAMPLES and "min_tokens" not in report.examples
    assert all(len(e) == EXAMPLE_CHARS and e.endswith("…") for e in report.examples["overlong"])


def test_every_row_is_accounted_for_through_reader_cleaner_and_tokeniser(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a"}\n{"text": ""}\n{"oops\n{"text": "b b b"}\n{"text": "c"}\n{"text": "c"}\n')
    report = CleanReport()
    for text in clean_texts(read_pretrain(path, on_bad_row="skip", report=report), dedup=True, report=report):
        if text == "a":  # what the tokenisation step does
            report.drop("min_tokens", "1 token")
            continue
        if len(text) > 3:
            report.truncated += 1
        report.kept += 1
    assert report.rows == report.kept + sum(report.dropped.values()) == 6
    assert str(report) == ("kept 2 of 6 rows; dropped: bad_row 1, duplicate 1, empty 1, min_tokens 1; "
                           "truncated 1")


def test_as_dict_and_example_cap():
    a = CleanReport(rows=15, kept=6, truncated=3, max_examples=5)
    for i in range(8):
        a.drop("empty", f"e{i}")
    a.drop("bad_row", "f.jsonl:3: invalid JSON")
    assert a.dropped == {"empty": 8, "bad_row": 1}
    assert a.examples["empty"] == ["e0", "e1", "e2", "e3", "e4"]         # counted all, kept max_examples
    d = a.as_dict()
    assert json.loads(json.dumps(d)) == d
    assert d == {"rows": 15, "kept": 6, "dropped": {"bad_row": 1, "empty": 8}, "truncated": 3,
                 "examples": {"bad_row": ["f.jsonl:3: invalid JSON"], "empty": ["e0", "e1", "e2", "e3", "e4"]}}
    d["examples"]["empty"].append("x")  # a copy, not the report's own lists
    assert len(a.examples["empty"]) == 5


@pytest.mark.parametrize("dedup", [True, False])
def test_cleaners_are_lazy(dedup):
    def gen():
        yield "a"
        raise RuntimeError("read too far")
    assert next(clean_texts(gen(), dedup=dedup, report=CleanReport())) == "a"
