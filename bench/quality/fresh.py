"""Held-out prompts of the synthetic families drawn anew (seed 123, ~170 per family with n=2000), those in a run's SFT
training file removed: enough rows that a few points of exact match are outside noise (sft_eval has 20 per family).
Used by the DPO and GRPO quality tests, the RL benches and the quality sweeps."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from glm_lora.data.prepare import split_path
from glm_lora.data.synthetic import generate
from glm_lora.evaluation.metrics import read_task_rows

WEAK_FAMILIES = ["add_en", "add_zh", "sub_en", "sub_zh"]     # the default's lowest families (README "Answer quality")
ALL_FAMILIES = [f"{k}_{lang}" for k in ("add", "sub", "copy", "reverse", "units") for lang in ("en", "zh")]


def fresh_rows(run_dir: Path, families: list[str], work_dir: Path | None = None, n: int = 2000) -> list[dict]:
    work_dir = Path(work_dir or tempfile.mkdtemp()) / "fresh"
    files = generate(work_dir, seed=123, n_pretrain=3, n_sft=1, n_dpo=1, n_eval=n)
    seen = {json.dumps(r["conversations"][:-1]) for r in read_task_rows(split_path(Path(run_dir) / "data", "sft"))}
    return [r for r in read_task_rows(files["sft_eval"])
            if r["task"] in families and json.dumps(r["conversations"][:-1]) not in seen]


def run_policy(run_dir: Path, *adapters) -> tuple:
    """(tokenizer, model in eval mode) of a finished tiny run: its pretrained base with the named adapter stages'
    directories (or adapter paths) applied in order."""
    from glm_lora.data.tokenizer import load_tokenizer
    from glm_lora.model.adapters import load_policy
    run_dir = Path(run_dir)
    model = load_policy(run_dir / "pretrain", *(run_dir / a for a in adapters)).eval()
    return load_tokenizer(run_dir / "tokenizer"), model


def fresh_eval(run_dir: Path, work_dir: Path | None = None) -> dict:
    """Greedy exact match, overall (the mean of the families) and per family, of the SFT and the DPO model in
    `run_dir` (whichever it holds) on fresh held-out prompts of every family: 8× the stages' own 200."""
    from glm_lora.evaluation.metrics import task_metrics
    run_dir = Path(run_dir)
    rows = fresh_rows(run_dir, ALL_FAMILIES, work_dir)
    out = {"rows": len(rows)}
    for stage, adapters in (("sft", ("sft",)), ("dpo", ("sft", "dpo"))):
        if (run_dir / stage / "manifest.json").exists():
            tok, model = run_policy(run_dir, *adapters)
            m = task_metrics(model, tok, rows)
            out[stage] = {"exact_match": m["exact_match"], "per_family": m["per_family"]}
    return out


def prompt_pool(run_dir: Path, families: list[str], out: Path, *, seed: int = 777, n: int = 60000) -> Path:
    """A file of RL prompts (rl.prompts) drawn anew for `families` (seed 777), none of them a held-out prompt: not in
    fresh_rows' set (seed 123) nor the run's sft_eval. Written as SFT-format rows with "task"."""
    work = Path(tempfile.mkdtemp())
    files = generate(work / "pool", seed=seed, n_pretrain=3, n_sft=n, n_dpo=1, n_eval=1)
    held = {json.dumps(r["conversations"][:-1]) for r in fresh_rows(run_dir, ALL_FAMILIES, work)}
    held |= {json.dumps(r["conversations"][:-1]) for r in read_task_rows(split_path(Path(run_dir) / "data", "sft_eval"))}
    rows = [r for r in read_task_rows(files["sft"]) if r["task"] in families and json.dumps(r["conversations"][:-1]) not in held]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return out
