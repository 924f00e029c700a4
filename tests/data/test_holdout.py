"""Held-out rows from the user's own files: chosen deterministically, written into the data artifact,
excluded from training, and named as the source of every metric computed on them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from glm_lora.configs.schema import Config, HoldoutConfig
from glm_lora.data.formats import read_dpo, read_pretrain, read_sft
from glm_lora.data.heldout_split import holdout_ids, without
from glm_lora.data.prepare import held_out_ids, prepare_data, split_provenance

CHATS = [{"messages": [{"role": "user", "content": f"Say the word number {i}."},
                       {"role": "assistant", "content": f"word{i}"}]} for i in range(300)]
PAIRS = [{"prompt": f"Pick {i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(120)]
TEXTS = [{"text": f"document {i} with some words"} for i in range(400)]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_holdout_size_bounds_and_determinism():
    cfg = HoldoutConfig(fraction=0.02, min_rows=8, seed=0)
    assert len(holdout_ids(10_000, cfg, 200, "sft_eval")) == 200            # 2% of 10k = 200
    assert len(holdout_ids(100_000, cfg, 200, "sft_eval")) == 200           # capped at eval.max_rows
    assert len(holdout_ids(100, cfg, 200, "sft_eval")) == 8                 # at least min_rows
    assert len(holdout_ids(20, cfg, 200, "sft_eval")) == 4                  # never more than a fifth
    assert holdout_ids(4, cfg, 200, "sft_eval") == []
    a = holdout_ids(5000, cfg, 200, "sft_eval")
    assert a == holdout_ids(5000, cfg, 200, "sft_eval") and a == sorted(set(a))
    assert a != holdout_ids(5000, cfg, 200, "dpo_eval")                     # each split its own draw
    assert a != holdout_ids(5000, HoldoutConfig(seed=1), 200, "sft_eval")
    assert list(without(iter("abcdef"), [0, 3])) == list("bcef")


@pytest.fixture
def prepared(tmp_path) -> tuple[Path, Config]:
    cfg = Config.model_validate({"data": {
        "sft": str(_jsonl(tmp_path / "chat.jsonl", CHATS)), "dpo": str(_jsonl(tmp_path / "prefs.jsonl", PAIRS)),
        "pretrain": str(_jsonl(tmp_path / "corpus.jsonl", TEXTS)),
        "synthetic": {"n_pretrain": 300, "n_sft": 50, "n_dpo": 20, "n_eval": 10}}, "eval": {"max_rows": 50}})
    out = tmp_path / "data"
    out.mkdir()
    metrics = prepare_data(cfg.data, out, eval_rows=cfg.eval.max_rows)
    assert metrics["held_out_sft"] == 8 and metrics["held_out_dpo"] == 8 and metrics["held_out_pretrain"] == 8
    return out, cfg


@pytest.mark.parametrize("split,rows,reader", [("sft", CHATS, read_sft), ("dpo", PAIRS, read_dpo),
                                               ("pretrain", TEXTS, read_pretrain)])
def test_user_split_without_eval_file_gets_rows_of_the_same_file(prepared, split, rows, reader):
    out, _ = prepared
    sources = json.loads((out / "sources.json").read_text())["splits"]
    ids = held_out_ids(out, split)
    assert len(ids) == 8 and sources[split]["held_out"]["ids"] == ids
    evals = list(reader(out / f"{split}_eval.jsonl"))
    originals = list(reader(sources[split]["path"]))
    assert evals == [originals[i] for i in ids]           # the same rows, read back by the same reader
    assert sources[f"{split}_eval"]["held_out_from"]["path"] == sources[split]["path"]
    assert sources[f"{split}_eval"]["user"] is False      # lives inside the artifact
    prov = split_provenance(out, f"{split}_eval")
    assert prov["user_data"] is True and prov["source"].startswith("held out of ") and prov["rows"] == 8


def test_training_never_sees_the_held_out_rows(prepared, tmp_path):
    from glm_lora.data.pipeline import StageData
    from glm_lora.data.tokenizer import train_tokenizer
    out, cfg = prepared
    tok_dir = train_tokenizer([tmp_path / "corpus.jsonl"], tmp_path / "tok", vocab_size=400)
    cfg = cfg.model_copy(update={"runs_dir": tmp_path / "runs"})
    data = StageData(cfg, tok_dir, out)
    tok, store = data.tok, data.store("sft", cfg.sft)
    assert len(store) == len(CHATS) - 8
    held = {CHATS[i]["messages"][1]["content"] for i in held_out_ids(out, "sft")}
    answers = {tok.decode([t for t, lab in zip(*map(list, store.example(i))) if lab != -100],
                          skip_special_tokens=True).strip() for i in range(len(store))}
    assert held and not held & answers and len(answers) == len(CHATS) - 8


def test_synthetic_eval_sets_stay_with_synthetic_training_data(prepared):
    out, _ = prepared
    sources = json.loads((out / "sources.json").read_text())["splits"]
    assert all(sources[s]["user"] for s in ("sft", "dpo", "pretrain"))
    assert all("held_out_from" in sources[f"{s}_eval"] for s in ("sft", "dpo", "pretrain"))


def test_too_few_rows_to_hold_out_is_a_clear_error(tmp_path):
    from glm_lora.data.formats import DataError
    cfg = Config.model_validate({"data": {"sft": str(_jsonl(tmp_path / "chat.jsonl", CHATS[:4])),
                                          "synthetic": {"n_pretrain": 300, "n_sft": 50, "n_dpo": 20, "n_eval": 10}}})
    (tmp_path / "data").mkdir()
    with pytest.raises(DataError, match=r"data.sft: .*chat.jsonl has 4 usable rows, too few to hold out"):
        prepare_data(cfg.data, tmp_path / "data")


def test_an_explicit_eval_file_is_used_as_given(tmp_path):
    cfg = Config.model_validate({"data": {
        "sft": str(_jsonl(tmp_path / "chat.jsonl", CHATS)), "sft_eval": str(_jsonl(tmp_path / "ev.jsonl", CHATS[:5])),
        "synthetic": {"n_pretrain": 300, "n_sft": 50, "n_dpo": 20, "n_eval": 10}}})
    (tmp_path / "data").mkdir()
    prepare_data(cfg.data, tmp_path / "data")
    assert held_out_ids(tmp_path / "data", "sft") == []
    assert split_provenance(tmp_path / "data", "sft_eval")["source"] == str(tmp_path / "ev.jsonl")
