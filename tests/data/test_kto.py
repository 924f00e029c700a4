"""KTO's unpaired rows through the data path: the reader (KTO rows, pairs unpaired, errors naming file:line and
field), the (answer, mismatched answer) pairs with a label each in the token store, and the labels in every batch
aligned with its groups."""
import json

import numpy as np
import pytest
import torch

from glm_lora.data import formats
from glm_lora.data.cleaning import CleanReport
from glm_lora.data.formats import DataError, KTORow
from glm_lora.data.packing import PackedBatches, padded_batches
from glm_lora.data.synthetic import generate
from glm_lora.data.encode import kto_examples, tokenized
from glm_lora.data.tokenizer import load_tokenizer, train_tokenizer


def write(tmp_path, rows, name="kto.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_kto_rows_and_pairs_unpaired(tmp_path):
    path = write(tmp_path, [
        {"prompt": "Say hi.", "completion": "hi", "label": True},
        {"messages": [{"role": "user", "content": "Say no."}], "completion": "yes", "label": False},
        {"prompt": "2 + 2?", "chosen": "4", "rejected": "5"}])
    rows = list(formats.read_kto(path))
    assert [(r.prompt[-1]["content"], r.completion["content"], r.desirable) for r in rows] == [
        ("Say hi.", "hi", True), ("Say no.", "yes", False), ("2 + 2?", "4", True), ("2 + 2?", "5", False)]


@pytest.mark.parametrize("row, field, words", [
    ({"prompt": "x", "completion": "y", "label": "yes"}, "label", "expected true (a desirable answer) or false"),
    ({"prompt": "x", "label": True, "completion": 3}, "completion", "expected a string"),
    ({"prompt": 5, "completion": "y", "label": False}, "prompt", "expected a string or a list of messages"),
    ({"completion": "y", "label": True}, "prompt", "missing"),
])
def test_bad_kto_rows_name_file_line_and_field(tmp_path, row, field, words):
    path = write(tmp_path, [{"prompt": "ok", "completion": "fine", "label": True}, row])
    with pytest.raises(DataError) as e:
        list(formats.read_kto(path))
    assert f"{path}:2" in str(e.value) and field in str(e.value) and words in str(e.value)


def test_paired_losses_refuse_a_kto_row_naming_the_fix(tmp_path):
    path = write(tmp_path, [{"prompt": "x", "completion": "y", "label": True}])
    with pytest.raises(DataError, match=rf"{path}:1.*it needs dpo.loss: kto"):
        list(formats.read_dpo(path))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    files = generate(tmp_path_factory.mktemp("syn"), n_pretrain=300, n_sft=10, n_dpo=10, n_eval=10)
    return load_tokenizer(train_tokenizer([files["pretrain"]], tmp_path_factory.mktemp("tok"), vocab_size=600))


def test_each_row_is_paired_with_the_next_rows_answer_and_labelled(tmp_path, tok):
    rows = [KTORow([{"role": "user", "content": f"q{i}"}], {"role": "assistant", "content": f"answer {i}"}, i % 3 != 0)
            for i in range(5)]
    labels: list[bool] = []
    examples = list(kto_examples(rows, tok, seq_len=128, overlong="truncate_prompt", report=CleanReport(),
                                 desirable=labels))
    assert len(examples) == 10 and labels == [False, True, True, False, True]
    text = [tok.decode(ids) for ids, _ in examples]
    for i in range(5):
        assert f"q{i}" in text[2 * i] and f"answer {i}" in text[2 * i]                   # the row itself
        assert f"q{i}" in text[2 * i + 1] and f"answer {(i + 1) % 5}" in text[2 * i + 1]  # its mismatched twin
    store = tokenized("kto", "sha", tok.name_or_path, iter(examples), cache_root=tmp_path / "cache",
                      settings={}, report=CleanReport(), group_meta={"group_labels": labels})
    assert store.group_size == 2 and store.group_labels().tolist() == [0, 1, 1, 0, 1]
    batch = next(PackedBatches(store, iter([3, 1, 4, 0, 2]), rows=2, seq_len=128, group_size=2))
    pad = next(padded_batches(store, iter([4, 2, 0]), batch_size=3, group_size=2))
    for b in (batch, pad):
        assert b["group_labels"].shape[0] == b["group_docs"].shape[0]
    assert pad["group_labels"].tolist() == [1, 1, 0]
    # packed: each group's label is the one of the row whose tokens sit in its first document
    for g, (doc, _) in enumerate(batch["group_docs"].tolist()):
        ids = batch["input_ids"][batch["doc_ids"] == doc]
        i = next(i for i in range(5) if tok.decode(ids.tolist()) == text[2 * i])
        assert batch["group_labels"][g].item() == int(labels[i])


def test_the_kto_loss_reads_the_batch_labels():
    from glm_lora.engine.losses import PreferenceLoss
    from tests.engine.test_engine import pair_batch, tiny
    from glm_lora.configs.schema import LoRAConfig
    from glm_lora.model import inject_lora
    m = tiny()
    inject_lora(m, LoRAConfig(target_modules=["q_proj", "v_proj"], r=4, alpha=8))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    b = pair_batch()
    b["group_labels"] = torch.tensor([1, 0])
    loss, metrics = PreferenceLoss(beta=0.5, kind="kto")(m, b)
    b["group_labels"] = torch.tensor([0, 1])
    flipped, _ = PreferenceLoss(beta=0.5, kind="kto")(m, b)
    assert torch.isfinite(loss) and not torch.isclose(loss, flipped)
    assert {"kl", "desirable_reward", "undesirable_reward", "preference_accuracy"} <= set(metrics)
    assert np.isfinite(float(metrics["kl"]))


def test_a_paired_loss_on_a_kto_file_stops_before_any_training(tmp_path):
    from glm_lora.configs.load import load_config
    from glm_lora.engine.preflight import preflight
    path = write(tmp_path, [{"prompt": "Say hi.", "chosen": "hi", "rejected": "no"},
                            {"prompt": "Say yo.", "completion": "yo", "label": True}])
    cfg = load_config("tiny", {"data.dpo": str(path), "runs_dir": str(tmp_path / "runs")})
    with pytest.raises(DataError, match=rf"{path}:2.*it needs dpo.loss: kto"):
        preflight(cfg)
    preflight(load_config("tiny", {"data.dpo": str(path), "dpo.loss": "kto", "runs_dir": str(tmp_path / "runs")}))
