"""No silent data loss: data.overlong truncate_prompt keeps long rows' answers, and a split that
loses more than data.max_drop_fraction of its rows fails with the counts by reason and the fix."""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from glm_lora.configs.schema import DataConfig
from glm_lora.data import encode
from glm_lora.data.cleaning import CleanReport, check_drop_fraction
from glm_lora.data.formats import DataError
from glm_lora.data.synthetic import generate
from glm_lora.data.encode import IGNORE, dpo_examples, left_cut_prompt, sft_examples, usable_chars
from glm_lora.data.tokenizer import chat_tokens, load_tokenizer, prompt_ids, tokenize_chat, train_tokenizer
from test_tokenize_templates import CONV, build_tokenizer, spans

# Common English words: a 30-word prompt is ~150 tokens with the tiny preset's tokenizer (letters never merge).
WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from or had by "
         "word but what some we can out other were all there when up use your how said an each she which do their "
         "time if will way about many then them write would like so these her long make thing see him two has look "
         "more day could go come did number sound no most people my over know water than call first who may down "
         "side been now find any new work part take get place made live where after back little only round man year "
         "came show every good me give our under name very through just form sentence great think say help low "
         "line").split()


def msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize()


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    """The tiny preset's tokenizer: trained on the bundled synthetic corpus, vocab_size 2000 (~570 pieces)."""
    tmp = tmp_path_factory.mktemp("tiny")
    files = generate(tmp, n_pretrain=4000, n_sft=10, n_dpo=10, n_eval=10)
    return load_tokenizer(train_tokenizer([files["pretrain"]], tmp / "tok", vocab_size=2000))


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return load_tokenizer(build_tokenizer(tmp_path_factory.mktemp("glm") / "glm4", "glm4"))


def answer_span(tok, ids, labels) -> str:
    return tok.decode(spans(ids, labels)[-1])


def test_defaults():
    d = DataConfig()
    assert d.overlong == "truncate_prompt" and d.max_drop_fraction == 0.2
    assert encode.OVERLONG == ("truncate_prompt", "truncate", "drop")
    with pytest.raises(ValueError):
        DataConfig(overlong="cut")
    with pytest.raises(ValueError):
        DataConfig(max_drop_fraction=1.5)
    with pytest.raises(ValueError, match="overlong must be one of"):
        list(sft_examples([CONV], None, seq_len=8, overlong="cut", min_tokens=1, report=CleanReport()))


# ---------------------------------------------------------------- truncate_prompt, SFT

def test_rows_that_fit_are_untouched(tiny_tok):
    convs = [CONV, CONV[1:3] + msgs(("user", "bye")), msgs(("system", "s"), ("user", "hi"))]
    for overlong in ("truncate_prompt", "truncate"):
        report = CleanReport()
        got = list(sft_examples(convs, tiny_tok, seq_len=512, overlong=overlong, min_tokens=1, report=report))
        assert got == [tokenize_chat(tiny_tok, c) for c in convs[:2]]
        assert report.dropped == {"no_target": 1} and report.truncated == report.prompt_truncated == 0


@pytest.mark.parametrize("family", ["tiny", "glm4"])
def test_oldest_turns_go_first_and_the_last_answer_stays_whole(tiny_tok, glm, family):
    tok = tiny_tok if family == "tiny" else glm
    full = tokenize_chat(tok, CONV)[0]
    last_turn = [CONV[0]] + CONV[5:]                     # the system prompt + the last turn
    two_turns = [CONV[0]] + CONV[3:]
    for seq_len, kept in ((len(full), CONV), (len(tokenize_chat(tok, two_turns)[0]), two_turns),
                          (len(tokenize_chat(tok, two_turns)[0]) - 1, last_turn),
                          (len(tokenize_chat(tok, last_turn)[0]), last_turn)):
        report = CleanReport()
        [ex] = sft_examples([CONV], tok, seq_len=seq_len, overlong="truncate_prompt", min_tokens=1, report=report)
        assert ex == tokenize_chat(tok, kept) and len(ex[0]) <= seq_len
        assert report.prompt_truncated == (kept is not CONV) and report.truncated == 0
    # The old default cut the end: the last answer (and its end of turn) is gone.
    [(ids, labels)] = sft_examples([CONV], tok, seq_len=len(full) - 8, overlong="truncate", min_tokens=1,
                                   report=CleanReport())
    assert ids == full[:len(full) - 8]


@pytest.mark.parametrize("family", ["tiny", "glm4"])
def test_a_long_question_loses_its_start(tiny_tok, glm, family):
    tok = tiny_tok if family == "tiny" else glm
    rng = random.Random(1)
    question, answer = words(rng, 200), "The answer is 42."
    conv = msgs(("system", "Be brief."), ("user", question), ("assistant", answer))
    seq_len = 96
    report = CleanReport()
    [(ids, labels)] = sft_examples([conv], tok, seq_len=seq_len, overlong="truncate_prompt", min_tokens=1,
                                   report=report)
    assert seq_len - 4 <= len(ids) <= seq_len                     # the room is used
    assert (report.prompt_truncated, report.truncated) == (1, 0)
    end = "<|im_end|>" if family == "tiny" else "<|endoftext|>"
    assert answer_span(tok, ids, labels) == ("" if family == "tiny" else "\n") + answer + end
    # The prompt is the served prompt of the same conversation with the question's start cut off.
    start = next(i for i, lab in enumerate(labels) if lab != IGNORE)
    text = tok.decode(ids[:start])
    assert "Be brief." in text
    kept = text.split("Be brief.")[1]
    tail = next(question[i:] for i in range(len(question)) if question[i:] in kept)
    assert 20 < len(tail) < len(question)
    assert ids[:start] == prompt_ids(tok, msgs(("system", "Be brief."), ("user", tail)))


def test_an_answer_too_long_alone_is_cut_at_its_end(tiny_tok):
    rng = random.Random(2)
    question, answer = words(rng, 40), words(rng, 60)
    report = CleanReport()
    [(ids, labels)] = sft_examples([msgs(("user", question), ("assistant", answer))], tiny_tok, seq_len=128,
                                   overlong="truncate_prompt", min_tokens=1, report=report)
    assert len(ids) == 128 and (report.truncated, report.prompt_truncated) == (1, 0)
    start = next(i for i, lab in enumerate(labels) if lab != IGNORE)
    assert start <= 64                                    # the prompt keeps at most half the row
    assert answer.startswith(tiny_tok.decode(ids[start:])) and len(ids) - start >= 64


def test_huge_messages_are_cut_before_tokenising_with_the_same_result(tiny_tok, monkeypatch):
    """cut_messages keeps a prompt message's end and the answer's start under truncate_prompt: the
    example equals the one the uncut conversation gives."""
    seq_len = 48
    filler = "The sky is blue. Amy has 3 balls.\n"
    huge = filler * (3 * usable_chars(tiny_tok, seq_len) // len(filler)) + "Which colour is the sky?"
    for conv in (msgs(("system", "s"), ("user", huge), ("assistant", "Blue.")),
                 msgs(("user", "q"), ("assistant", huge), ("user", huge), ("assistant", "Blue.")),
                 msgs(("system", huge), ("user", "q"), ("assistant", "Blue.")),
                 msgs(("user", "q"), ("assistant", huge))):
        cut_report, whole_report = CleanReport(), CleanReport()
        got = list(sft_examples([conv], tiny_tok, seq_len=seq_len, overlong="truncate_prompt", min_tokens=1,
                                report=cut_report))
        with monkeypatch.context() as m:
            m.setattr(encode, "usable_chars", lambda tok, tokens: 10**9)
            want = list(sft_examples([conv], tiny_tok, seq_len=seq_len, overlong="truncate_prompt", min_tokens=1,
                                     report=whole_report))
        assert got == want and cut_report == whole_report and len(got) == 1


# ---------------------------------------------------------------- truncate_prompt, DPO

def test_dpo_pair_keeps_one_shared_prompt(tiny_tok):
    rng = random.Random(3)
    prompt = msgs(("user", words(rng, 30) + "?"))
    chosen, rejected = {"role": "assistant", "content": "Yes, two."}, {"role": "assistant", "content": words(rng, 8)}
    report = CleanReport()
    c, r = dpo_examples([(prompt, chosen, rejected)], tiny_tok, seq_len=256, overlong="truncate_prompt",
                        report=report)
    assert max(len(c[0]), len(r[0])) == 128 >= min(len(c[0]), len(r[0]))
    sc = next(i for i, lab in enumerate(c[1]) if lab != IGNORE)
    sr = next(i for i, lab in enumerate(r[1]) if lab != IGNORE)
    assert sc == sr and c[0][:sc] == r[0][:sr]           # the same prompt tokens, cut for the longer answer
    assert answer_span(tiny_tok, *c) == "Yes, two.<|im_end|>"
    assert answer_span(tiny_tok, *r) == rejected["content"] + "<|im_end|>"
    assert (report.kept, report.prompt_truncated, report.truncated) == (1, 1, 0)
    for overlong, reason in (("truncate", "no_target"), ("drop", "overlong")):   # what the other modes do
        report = CleanReport()
        assert list(dpo_examples([(prompt, chosen, rejected)], tiny_tok, seq_len=256, overlong=overlong,
                                 report=report)) == []
        assert report.dropped == {reason: 1}


def preference_fixture(n: int = 400, seed: int = 0):
    """Like the issue's real preference set: 30-word prompts, answers of 3 to 40 words."""
    rng = random.Random(seed)
    return [(msgs(("user", words(rng, 30) + "?")), {"role": "assistant", "content": words(rng, rng.randint(3, 40))},
             {"role": "assistant", "content": words(rng, rng.randint(3, 40))}) for _ in range(n)]


def test_preference_pairs_with_30_word_prompts_survive_the_tiny_seq_len(tiny_tok):
    """The issue: 394 of 400 pairs with 30-word prompts were dropped at the tiny preset's dpo.seq_len (256:
    128 tokens per answer's sequence). Measured here on a fixture of the same shape."""
    pairs = preference_fixture()
    lengths = [len(prompt_ids(tiny_tok, p)) for p, _, _ in pairs]
    counts = {}
    for overlong in ("truncate", "drop", "truncate_prompt"):
        report = CleanReport(rows=len(pairs))
        t0 = time.perf_counter()
        examples = list(dpo_examples(pairs, tiny_tok, seq_len=256, overlong=overlong, report=report))
        counts[overlong] = dict(kept=report.kept, dropped=report.dropped, answer_cut=report.truncated,
                                prompt_cut=report.prompt_truncated, seconds=round(time.perf_counter() - t0, 2))
        assert len(examples) == 2 * report.kept and all(len(ids) <= 128 for ids, _ in examples)
    print(f"\nprompt tokens {min(lengths)}..{max(lengths)}; survivors of {len(pairs)} pairs: "
          + json.dumps(counts))
    assert min(lengths) > 128
    assert counts["truncate"]["kept"] == 0 and counts["truncate"]["dropped"] == {"no_target": 400}
    assert counts["drop"]["kept"] == 0
    tp = counts["truncate_prompt"]
    assert tp["kept"] == 400 and tp["dropped"] == {}
    assert tp["prompt_cut"] + tp["answer_cut"] == 400 and tp["prompt_cut"] > 100
    with pytest.raises(DataError, match=r"data.dpo: 400 of 400 rows were dropped .*no_target 400.*raise dpo.seq_len"):
        report = CleanReport(rows=400)
        list(dpo_examples(pairs, tiny_tok, seq_len=256, overlong="truncate", report=report))
        report.check_drop_fraction("dpo", 0.2, seq_len="dpo.seq_len (256)")


def test_left_cut_prompt_reports_what_cannot_fit(tiny_tok):
    prompt = msgs(("system", "Be brief."), ("user", "What is 12 + 7?"))
    assert left_cut_prompt(tiny_tok, prompt, 1000) == (prompt, True)
    cut, fits = left_cut_prompt(tiny_tok, prompt, 3)        # the template alone is longer
    assert not fits and cut == msgs(("system", ""), ("user", "?"))


def test_chat_tokens_gives_the_last_answers_start(glm):
    ids, labels, start = chat_tokens(glm, CONV)
    assert ids[:start] == prompt_ids(glm, CONV[:6]) and labels[start] != IGNORE and labels[start - 1] == IGNORE


# ---------------------------------------------------------------- max_drop_fraction

def test_drop_fraction_check_names_counts_reasons_and_fixes():
    report = CleanReport(rows=10, kept=7)
    report.drop("overlong", "412 > 128 tokens")
    report.drop("overlong", "300 > 128 tokens")
    report.drop("bad_row", "sft.jsonl:3: invalid JSON")
    report.check_drop_fraction("sft", 0.3)                   # exactly at the limit passes
    with pytest.raises(DataError) as e:
        report.check_drop_fraction("sft", 0.2, seq_len="sft.seq_len (128)")
    msg = str(e.value)
    assert msg.startswith("data.sft: 3 of 10 rows were dropped (30.0%), more than data.max_drop_fraction (0.2): "
                          "overlong 2, bad_row 1 (e.g. overlong: 412 > 128 tokens; bad_row: sft.jsonl:3: invalid JSON)")
    for fix in ("raise sft.seq_len (128), or set data.overlong: truncate_prompt", "data.on_bad_row: error",
                "data.max_drop_fraction (now 0.2; 1 turns this check off)"):
        assert fix in msg
    # A cached token store's meta["clean"] (the report's dict) is checked the same way.
    with pytest.raises(DataError, match="3 of 10 rows"):
        check_drop_fraction(report.as_dict(), "sft", 0.2)
    check_drop_fraction(report.as_dict(), "sft", 1.0)
    check_drop_fraction({}, "sft", 0.0)                      # nothing read: nothing to judge
    check_drop_fraction(CleanReport(rows=5, kept=5), "sft", 0.0)
    report.rows = 14     # 4 rows held out for evaluation: read, neither kept nor dropped
    with pytest.raises(DataError, match="3 of 10 rows"):
        report.check_drop_fraction("sft", 0.25)


def test_drop_fraction_on_a_cached_token_store(tiny_tok, tmp_path):
    """What data.pipeline.StageData.store does: check the store's clean report, on a build and on a cache hit."""
    pairs = preference_fixture(50)
    tok_dir = Path(tiny_tok.name_or_path)
    for overlong, fails in (("truncate", True), ("truncate_prompt", False)):
        for attempt in ("build", "cache hit"):
            report = CleanReport(rows=len(pairs))
            store = encode.tokenized("dpo", "0" * 64, tok_dir, dpo_examples(pairs, tiny_tok, seq_len=256,
                                                                               overlong=overlong, report=report),
                                       cache_root=tmp_path, settings={"overlong": overlong}, report=report)
            if fails:
                with pytest.raises(DataError, match="data.dpo: 50 of 50 rows were dropped.*no_target 50"):
                    check_drop_fraction(store.meta.get("clean") or {}, "dpo", 0.2, seq_len="dpo.seq_len (256)")
            else:
                check_drop_fraction(store.meta.get("clean") or {}, "dpo", 0.2, seq_len="dpo.seq_len (256)")
                assert len(store) == 100


@pytest.mark.parametrize("reason,fix", [("min_tokens", "lower data.min_tokens"), ("duplicate", "data.dedup: false"),
                                        ("no_target", "data.overlong: truncate_prompt"),
                                        ("turn_boundary", "one assistant answer per row")])
def test_drop_fraction_fix_per_reason(reason, fix):
    report = CleanReport(rows=2)
    report.drop(reason)
    with pytest.raises(DataError, match=f"{reason} 1.*{fix}"):
        report.check_drop_fraction("sft_eval", 0.4, hint="see the manifest")


def test_prompt_truncated_in_report_only_when_used():
    a, b = CleanReport(rows=2, kept=2), CleanReport(rows=1, kept=1, prompt_truncated=1)
    assert "prompt_truncated" not in a.as_dict() and "prompt cut" not in str(a)
    assert b.as_dict()["prompt_truncated"] == 1 and str(b).endswith("; prompt cut 1")
