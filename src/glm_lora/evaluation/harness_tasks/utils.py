"""Functions the glm_lora_* task YAMLs name (`!function utils.<name>`, lm-evaluation-harness' convention).

The rows are the SFT held-out split's ({"conversations": [..., user, assistant], "task": family}): the file the
harness stage passes as the task metadata `glm_lora_data` (the run's data/sft_eval.jsonl), else the copy shipped
here (the tiny default's held-out problems, seed 0), so `lm_eval --include_path <this folder>` runs as it is.
Scored as our own eval scores them: data.synthetic.check_answer.
"""
from __future__ import annotations

import json
from pathlib import Path

import datasets

from glm_lora.data.synthetic import check_answer

SHIPPED = Path(__file__).with_name("glm_lora_heldout.jsonl")


def _rows(families: tuple[str, ...], glm_lora_data: str | None = None, **_) -> datasets.DatasetDict:
    path = Path(glm_lora_data or SHIPPED)
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row.get("task") in families:
                *_, question, answer = row["conversations"]
                rows.append({"prompt": question["content"], "answer": answer["content"], "family": row["task"]})
    if not rows:
        raise ValueError(f"{path}: no held-out rows of the task families {list(families)} (the synthetic data's)")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def arithmetic(**metadata) -> datasets.DatasetDict:
    return _rows(("add_en", "add_zh", "sub_en", "sub_zh"), **metadata)


def strings(**metadata) -> datasets.DatasetDict:
    return _rows(("copy_en", "copy_zh", "reverse_en", "reverse_zh"), **metadata)


def process_results(doc: dict, results: list[str]) -> dict:
    return {"exact_match": float(check_answer(doc["family"], results[0], doc["answer"]))}
