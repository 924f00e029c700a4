"""Tokenising in worker processes (data/parallel_encode.py) gives what tokenising here gives: the same examples in the
same order, the same cleaning report, and a byte-identical token store through the stage's own data path."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from glm_lora.configs.load import load_config
from glm_lora.data import parallel_encode
from glm_lora.data.cleaning import CleanReport
from glm_lora.data.parallel_encode import encoded
from glm_lora.data.pipeline import StageData
from glm_lora.data.prepare import prepare_data
from glm_lora.data.tokenizer import load_tokenizer
from glm_lora.data.token_store import LABELS, OFFSETS, TOKENS
from tests.chat_templates import build_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"), "chatml", generation_config=False)


def _rows():
    rng = random.Random(0)
    words = "the cat sat on a mat and then it ran off to see two birds".split()
    texts = [" ".join(rng.choices(words, k=rng.randint(0, 60))) for _ in range(300)]      # some empty: dropped
    convs = [[{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(1, 40)))},
              {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 30)))}]
             for _ in range(300)]
    return texts, convs


@pytest.mark.parametrize("kind", ["pretrain", "sft"])
def test_workers_give_the_same_examples_and_report(kind, tok_dir, monkeypatch) -> None:
    monkeypatch.setattr(parallel_encode, "CHUNK_ROWS", 40)
    tok = load_tokenizer(tok_dir)
    texts, convs = _rows()
    rows = texts if kind == "pretrain" else convs
    options = {"seq_len": 48, "min_tokens": 3} if kind == "pretrain" else {"seq_len": 200, "min_tokens": 3, "overlong": "drop"}
    here, there = CleanReport(max_examples=2), CleanReport(max_examples=2)
    a = [(list(i), list(l)) for i, l in encoded(kind, rows, tok, here, workers=0, **options)]
    b = [(list(map(int, i)), list(map(int, l))) for i, l in encoded(kind, rows, tok, there, workers=2,
                                                                   serial_s=0.0, **options)]
    assert a == b and len(a) > 100
    assert here.as_dict() == there.as_dict() and sum(here.dropped.values()) > 0


def test_a_small_split_never_starts_a_process(tok_dir, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a process pool was started")
    monkeypatch.setattr(parallel_encode.cf, "ProcessPoolExecutor", refuse)
    texts, _ = _rows()
    assert len(list(encoded("pretrain", texts, load_tokenizer(tok_dir), CleanReport(), workers=4,
                            seq_len=48, min_tokens=3))) > 100


def test_the_stage_token_store_is_byte_identical(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(parallel_encode, "CHUNK_ROWS", 500)
    cfg = load_config("tiny", {"runs_dir": str(tmp_path / "runs"), "data.synthetic.n_sft": 3000,
                               "data.synthetic.n_pretrain": 300, "data.synthetic.n_eval": 10})
    prepare_data(cfg.data, tmp_path / "data", eval_rows=10)
    tok_dir = build_tokenizer(tmp_path / "tok", "chatml", generation_config=False)
    stores = {}
    for workers in ("0", "2"):
        monkeypatch.setenv(parallel_encode.WORKERS_ENV, workers)
        monkeypatch.setattr(parallel_encode, "SERIAL_S", 0.0)
        run = cfg.model_copy(update={"runs_dir": tmp_path / f"runs{workers}"})
        stores[workers] = StageData(run, tok_dir, tmp_path / "data").store("sft", cfg.sft).path
    for name in (TOKENS, LABELS, OFFSETS):
        assert (stores["0"] / name).read_bytes() == (stores["2"] / name).read_bytes()
    meta = [json.loads((stores[w] / "meta.json").read_text()) for w in ("0", "2")]
    assert meta[0]["clean"] == meta[1]["clean"] and meta[0]["n_examples"] == meta[1]["n_examples"]


def test_a_bad_worker_count_is_named(monkeypatch) -> None:
    monkeypatch.setenv(parallel_encode.WORKERS_ENV, "many")
    with pytest.raises(ValueError, match="GLM_LORA_TOKENIZE_WORKERS must be a whole number"):
        parallel_encode.default_workers()
