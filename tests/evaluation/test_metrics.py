"""evaluation/metrics.py: eval metrics on fixtures with known answers.

Forced models are `Oracle`s: real nn.Modules with the Decoder's interface (hidden_states,
lm_head, forward, generate, config) whose logits put SCALE on the token a lookup table gives
for the prefix so far, so every metric runs its real code path (chat template, batched
greedy decode, packing, loss heads) and only the "weights" are made up.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from glm_lora.configs.schema import Config
from glm_lora.data.cleaning import CleanReport
from glm_lora.data.formats import DataError, read_dpo
from glm_lora.data.prepare import prepare_data
from glm_lora.data.synthetic import TASK_FAMILIES, generate
from glm_lora.data.encode import lm_examples
from glm_lora.data.tokenizer import load_tokenizer, train_tokenizer
from glm_lora.engine.losses import PreferenceLoss
from glm_lora.evaluation import heldout
from glm_lora.evaluation.decode import greedy_answers
from glm_lora.evaluation.metrics import (
    compare_prompts, lm_metrics, preference_metrics, read_task_rows, rejected_match_rate, task_metrics,
)
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from tests.oracle import Oracle
from glm_lora.configs.schema import LoRAConfig

torch.set_num_threads(1)



# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return generate(tmp_path_factory.mktemp("syn"), n_pretrain=300, n_sft=10, n_dpo=10, n_eval=30)


@pytest.fixture(scope="module")
def tok(files, tmp_path_factory):
    return load_tokenizer(train_tokenizer([files["pretrain"]], tmp_path_factory.mktemp("tok"), vocab_size=600))


@pytest.fixture(scope="module")
def rows(files):
    return read_task_rows(files["sft_eval"])


@pytest.fixture(scope="module")
def pairs(files):
    return list(read_dpo(files["dpo_eval"]))[:12]


def tiny_decoder(tok, seed=0, max_seq_len=128) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(DecoderConfig(vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=64, max_seq_len=max_seq_len))


def prompt_ids(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def answer_ids(tok, text):
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


# ---------------------------------------------------------------- lm_metrics

TEXTS = ["The sky is blue.", "天空是蓝色的。", "Amy has a red ball. She gives the ball to Tom.", "ab", "中"]


def test_lm_metrics_perfect_model_has_perplexity_one(tok):
    oracle = Oracle(len(tok))
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]   # as lm_examples ends a doc
        oracle.teach(ids[:1], ids[1:])
    m = lm_metrics(oracle, tok, TEXTS, seq_len=64, batch_rows=2)
    assert m["loss"] < 1e-9
    assert m["perplexity"] == pytest.approx(1.0, abs=1e-9)
    assert m["bits_per_byte"] == pytest.approx(0.0, abs=1e-9)


def test_lm_metrics_uniform_model_and_bits_per_byte_by_hand(tok):
    V = len(tok)
    assert tok("中", add_special_tokens=False)["input_ids"] != []
    m = lm_metrics(Oracle(V), tok, ["ab", "中"], seq_len=64)
    # "ab" -> a b eos: targets b, eos; "中" -> 中 eos: target eos (n_zh = 1 if 中 is one piece).
    n_zh = len(tok("中", add_special_tokens=False)["input_ids"])
    assert m["tokens"] == 2 + n_zh and m["bytes"] == 2 + 3
    assert m["loss"] == pytest.approx(math.log(V))
    assert m["perplexity"] == pytest.approx(V)
    assert m["bits_per_byte"] == pytest.approx((2 + n_zh) * math.log(V) / math.log(2) / 5)


def test_lm_metrics_matches_each_document_scored_alone(tok):
    """Packed rows (several documents per row, chunking at seq_len) give the per-document NLL sums."""
    model = tiny_decoder(tok)
    seq_len = 16
    m = lm_metrics(model, tok, TEXTS, seq_len=seq_len, batch_rows=3)
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids, _ in lm_examples(TEXTS, tok, seq_len=seq_len, min_tokens=1, report=CleanReport()):
            x = torch.tensor([ids])
            logits = model(x)[0, :-1]
            nll += float(nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
            count += len(ids) - 1
    assert m["tokens"] == count
    assert m["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert m["bits_per_byte"] == pytest.approx(nll / math.log(2) / sum(len(t.encode()) for t in TEXTS), rel=1e-5)
    assert model.training   # mode restored


# ---------------------------------------------------------------- greedy decoding

def test_greedy_answers_equal_decoder_generate(tok, rows):
    """The batched decode gives Decoder.generate's tokens, incl. prompts past max_seq_len (cropped)."""
    model = tiny_decoder(tok, max_seq_len=40).eval()
    prompts = [r["conversations"][:-1] for r in rows[:9]]
    prompts.append([{"role": "user", "content": "Reverse the word " + "abcdefgh" * 5}])   # too long: fallback
    got = greedy_answers(model, tok, prompts, max_new_tokens=7, batch_size=4)
    want = [tok.decode(model.generate(prompt_ids(tok, p), 7, eos_id=tok.eos_token_id), skip_special_tokens=True)
            for p in prompts]
    assert got == want


def test_greedy_answers_stop_at_eos(tok):
    p = [{"role": "user", "content": "Copy the word \"cat\"."}]
    oracle = Oracle(len(tok)).teach(prompt_ids(tok, p), answer_ids(tok, "cat") + answer_ids(tok, "dog"))
    assert greedy_answers(oracle, tok, [p, p], max_new_tokens=24) == ["cat", "cat"]


# ---------------------------------------------------------------- task_metrics

def forced(tok, rows, right) -> Oracle:
    """An oracle answering row k with its reference if right(k, row) else with a wrong answer."""
    oracle = Oracle(len(tok))
    for k, row in enumerate(rows):
        ref = row["conversations"][-1]["content"]
        oracle.teach(prompt_ids(tok, row["conversations"][:-1]), answer_ids(tok, ref if right(k, row) else ref + "0"))
    return oracle


def test_task_metrics_forced_right_and_wrong(tok, rows):
    assert {r["task"] for r in rows} == set(TASK_FAMILIES)
    right = task_metrics(forced(tok, rows, lambda k, r: True), tok, rows)
    assert right["exact_match"] == 1.0 and right["min_family"] == 1.0 and right["n"] == len(rows)
    assert right["per_family"] == {f: 1.0 for f in TASK_FAMILIES}
    wrong = task_metrics(forced(tok, rows, lambda k, r: False), tok, rows)
    assert wrong["exact_match"] == 0.0 and wrong["per_family"] == {f: 0.0 for f in TASK_FAMILIES}
    assert all(not s["correct"] and s["answer"] == s["reference"] + "0" for s in wrong["samples"])


def test_task_metrics_mixed_per_family_means(tok, rows):
    # add_en: all right; copy_zh: the first of its 3 rows right; others wrong.
    seen: dict[str, int] = {}

    def right(k, row):
        seen[row["task"]] = seen.get(row["task"], 0) + 1
        return row["task"] == "add_en" or (row["task"] == "copy_zh" and seen["copy_zh"] == 1)

    m = task_metrics(forced(tok, rows, right), tok, rows, examples=2)
    assert m["n_per_family"] == {f: 3 for f in TASK_FAMILIES}
    want = {f: 0.0 for f in TASK_FAMILIES} | {"add_en": 1.0, "copy_zh": 1 / 3}
    assert m["per_family"] == pytest.approx(want)
    assert m["exact_match"] == pytest.approx((1 + 1 / 3) / 10)
    assert m["min_family"] == 0.0
    assert len(m["samples"]) == 2 * len(TASK_FAMILIES)
    s = next(s for s in m["samples"] if s["task"] == "add_en")
    assert s["correct"] and s["answer"] == s["reference"]
    assert s["prompt"] == next(r for r in rows if r["task"] == "add_en")["conversations"][0]["content"]


def test_task_metrics_rows_without_task_count_as_all(tok, rows):
    plain = [{"conversations": r["conversations"]} for r in rows[:4]]
    m = task_metrics(forced(tok, plain, lambda k, r: k < 3), tok, plain)
    assert m["per_family"] == {"all": 0.75} and m["exact_match"] == 0.75


# ---------------------------------------------------------------- preferences

def test_preference_metrics_untrained_adapter_scores_zero(tok, pairs):
    model = tiny_decoder(tok)
    inject_lora(model, LoRAConfig(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], r=4, alpha=8))
    m = preference_metrics(model, tok, pairs, seq_len=128, beta=0.1)
    assert m["n"] == len(pairs) and m["dropped"] == 0
    assert m["implicit_reward_accuracy"] == 0.0 and m["mean_margin"] == 0.0    # B = 0: policy == reference
    assert 0.0 <= m["logprob_accuracy"] <= 1.0


def test_preference_metrics_trained_adapter_prefers_chosen(tok, pairs):
    """A few DPO steps on the pairs themselves: every pair's implicit reward favours chosen."""
    from glm_lora.data.packing import padded_batches
    from glm_lora.evaluation.metrics import _Examples
    from glm_lora.data.encode import dpo_examples

    model = tiny_decoder(tok)
    inject_lora(model, LoRAConfig(target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], r=4, alpha=8))
    src = _Examples(list(dpo_examples(pairs, tok, seq_len=128, overlong="truncate", report=CleanReport())))
    batch = next(padded_batches(src, iter(range(len(pairs))), batch_size=len(pairs), group_size=2))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss_fn = PreferenceLoss(beta=0.1)
    for _ in range(30):
        loss, _ = loss_fn(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    m = preference_metrics(model, tok, pairs, seq_len=128, beta=0.1, batch_pairs=5)
    assert m["implicit_reward_accuracy"] == 1.0 and m["mean_margin"] > 0
    assert m["chosen_reward"] > m["rejected_reward"]


def test_preference_metrics_forced_models_and_explicit_reference(tok, pairs):
    def oracle(pick):
        o = Oracle(len(tok))
        for prompt, chosen, rejected in pairs:
            o.teach(prompt_ids(tok, prompt), answer_ids(tok, pick(chosen, rejected)["content"]))
        return o

    likes_chosen, likes_rejected = oracle(lambda c, r: c), oracle(lambda c, r: r)
    m = preference_metrics(likes_chosen, tok, pairs, seq_len=128, beta=0.1)
    assert m["logprob_accuracy"] == 1.0
    assert m["implicit_reward_accuracy"] is None and m["mean_margin"] is None   # no adapter, no ref_model
    assert preference_metrics(likes_rejected, tok, pairs, seq_len=128, beta=0.1)["logprob_accuracy"] == 0.0
    m = preference_metrics(likes_chosen, tok, pairs, seq_len=128, beta=0.1, ref_model=Oracle(len(tok)))
    assert m["implicit_reward_accuracy"] == 1.0 and m["mean_margin"] > 0


def test_rejected_match_rate(tok, pairs):
    o = Oracle(len(tok))
    for k, (prompt, chosen, rejected) in enumerate(pairs):
        o.teach(prompt_ids(tok, prompt), answer_ids(tok, (rejected if k % 3 == 0 else chosen)["content"]))
    assert rejected_match_rate(o, tok, pairs) == pytest.approx(sum(k % 3 == 0 for k in range(len(pairs))) / len(pairs))


# ---------------------------------------------------------------- report

def test_compare_prompts_table_escapes_cells():
    table = compare_prompts({"pretrain": ["a|b", ""], "sft": ["line1\nline2", "<s>x"]}, ["What is 1|2?", "q"])
    lines = table.strip().split("\n")
    assert lines[0] == "| prompt | pretrain | sft |"
    assert lines[1] == "|---|---|---|"
    assert lines[2] == "| What is 1\\|2? | a\\|b | line1<br>line2 |"
    assert lines[3] == "| q |  | &lt;s&gt;x |"
    with pytest.raises(ValueError, match="'sft' has 1 answers for 2 prompts"):
        compare_prompts({"sft": ["x"]}, ["a", "b"])


def test_read_task_rows_defaults_family(tmp_path):
    path = tmp_path / "alpaca.jsonl"
    path.write_text('{"instruction": "Say hi", "output": "hi"}\n'
                    '{"conversations": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],'
                    ' "task": "echo"}\n')
    rows = read_task_rows(path)
    assert [r["task"] for r in rows] == ["all", "echo"]
    assert rows[0]["conversations"][-1] == {"role": "assistant", "content": "hi"}


# ---------------------------------------------------------------- bad rows and long rows in held-out files

def test_read_task_rows_honours_on_bad_row(tmp_path):
    path = tmp_path / "eval.jsonl"
    good = {"conversations": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    path.write_text("\n".join([json.dumps({**good, "task": "echo"}), '{"conversations": [', json.dumps(good),
                               json.dumps({"text": "x" * 5000}), json.dumps({**good, "task": ["odd"]}),
                               json.dumps({**good, "task": "echo"})]) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:2: invalid JSON"):
        read_task_rows(path)
    report = CleanReport()
    rows = read_task_rows(path, on_bad_row="skip", report=report, max_line_bytes=4096)
    assert [r["task"] for r in rows] == ["echo", "all", "['odd']", "echo"]
    assert report.dropped == {"bad_row": 2} and report.rows == 6
    assert "line longer than data.max_line_bytes (4 KiB)" in report.examples["bad_row"][1]
    report = CleanReport()
    assert len(read_task_rows(path, limit=2, on_bad_row="skip", report=report)) == 2   # limit counts good rows
    assert report.rows == 3


def test_greedy_answers_cut_a_huge_prompt_to_what_the_model_sees(tok):
    """generate() crops the prompt to its last max_seq_len tokens, so a prompt is cut (keeping its end)
    before tokenising: the answer is the one the whole prompt gets."""
    model = tiny_decoder(tok, max_seq_len=40).eval()
    huge = [{"role": "system", "content": "s" * 50_000},
            {"role": "user", "content": "The sky is blue. 天空是蓝色的。\n" * 3000 + "Reverse the word cat."}]
    got = greedy_answers(model, tok, [huge], max_new_tokens=5)
    want = tok.decode(model.generate(prompt_ids(tok, huge), 5, eos_id=tok.eos_token_id), skip_special_tokens=True)
    assert got == [want]


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory, files):
    """A data artifact whose held-out splits are user files with bad rows in them."""
    root = tmp_path_factory.mktemp("user")
    bad_json, long_line = "{oops", json.dumps({"text": "x" * 5000})
    splits = {}
    for split in ("pretrain_eval", "sft_eval", "dpo_eval"):
        lines = files[split].read_text().splitlines()[:6]
        splits[split] = root / f"{split}.jsonl"
        splits[split].write_text("\n".join(lines[:2] + [bad_json] + lines[2:4] + [long_line] + lines[4:]) + "\n")
    return splits


def _eval_config(splits: dict, on_bad_row: str) -> Config:
    return Config.model_validate({
        "device": "cpu", "serve": {"enabled": False},
        "model": {"hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "num_layers": 1, "intermediate_size": 64,
                  "max_seq_len": 128},
        "pretrain": {"seq_len": 64}, "sft": {"seq_len": 64}, "dpo": {"seq_len": 128},
        "eval": {"max_rows": 50, "max_new_tokens": 4},
        "data": {**{k: str(v) for k, v in splits.items()}, "on_bad_row": on_bad_row, "max_line_bytes": 4096, "max_drop_fraction": 0.5,
                 "synthetic": {"n_pretrain": 20, "n_sft": 10, "n_dpo": 10, "n_eval": 5}}})


def test_eval_counts_bad_rows_instead_of_failing_with_skip(tok, eval_data, tmp_path):
    cfg = _eval_config(eval_data, "skip")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    prepare_data(cfg.data, data_dir)
    model = tiny_decoder(tok)
    inject_lora(model, LoRAConfig(target_modules=["q_proj", "v_proj"], r=2, alpha=4))
    lm = heldout.eval_lm(cfg, model, tok, data_dir)
    assert lm["bad_rows_pretrain_eval"] == 2 and lm["documents"] >= 6 and math.isfinite(lm["loss"])
    tasks = heldout.eval_tasks(cfg, model, tok, data_dir)
    assert tasks["bad_rows_sft_eval"] == 2 and tasks["n"] == 6
    prefs = heldout.eval_preferences(cfg, model, tok, data_dir)
    assert (prefs["bad_rows_dpo_eval"], prefs["bad_rows_sft_eval"], prefs["n"]) == (2, 2, 6)


def test_a_bad_eval_row_is_rejected_by_the_data_stage_with_on_bad_row_error(eval_data, tmp_path):
    """With on_bad_row: error the data stage reads every split, held-out ones included: a bad eval row
    stops the flow before any training."""
    cfg = _eval_config(eval_data, "error")
    with pytest.raises(DataError, match=rf"^{eval_data['pretrain_eval']}:3: invalid JSON"):
        prepare_data(cfg.data, tmp_path)
