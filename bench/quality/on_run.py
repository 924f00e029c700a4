"""Experiments on a finished tiny run (RUN_DIR holds data/, tokenizer/, pretrain/, sft/ and, for grpo, dpo/), on this
machine's CPU at one thread:

    python -m bench.quality.on_run dpo RUN_DIR SEED OUT [KEY=VALUE ...]   # a DPO variant on a copy of the run in OUT
    python -m bench.quality.on_run dpo_on_policy RUN_DIR SEED OUT [KEY=VALUE ...]   # the same on on-policy pairs
    python -m bench.quality.on_run grpo RUN_DIR STEPS LR                  # tests/test_quality.py's GRPO measurement

Each prints one JSON line: the DPO variant's stage metrics, its SFT and DPO models' exact match on fresh held-out
prompts (bench.quality.fresh.fresh_eval) and the DPO model's wrong answers to 200 two-digit + one-digit sums
(teen_sums_wrong: the demo prompt's neighbourhood); for GRPO, the four arithmetic families' exact match on fresh prompts
before and after `STEPS` steps at `LR` (grpo_gain, which the quality test asserts on).
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bench.quality.fresh import WEAK_FAMILIES, fresh_eval, fresh_rows, run_policy


def grpo_gain(run_dir: Path, work: Path, *, steps: int, lr: float) -> tuple[dict, dict]:
    """The RL stage (GRPO, exact-match reward) on the run's DPO model, `steps` steps on the four arithmetic families:
    their exact match on fresh held-out prompts per family, before and after."""
    from glm_lora.configs.load import load_config
    from glm_lora.engine import rl
    from glm_lora.evaluation.metrics import task_metrics

    cfg = load_config("tiny", {"runs_dir": str(work / "runs"), "serve.enabled": False, "eval.enabled": False,
                               "rl.max_steps": steps, "rl.families": WEAK_FAMILIES, "rl.max_new_tokens": 8,
                               "rl.lr": lr})
    inputs = {s: run_dir / s for s in ("sft", "dpo", "tokenizer", "data")} | {"base": run_dir / "pretrain"}
    out = work / "rl"
    out.mkdir()
    rl.run(cfg, inputs, out)
    rows = fresh_rows(run_dir, WEAK_FAMILIES, work)
    tok, model = run_policy(run_dir, "sft", "dpo")
    before = task_metrics(model, tok, rows)["per_family"]
    after = task_metrics(run_policy(run_dir, "sft", "dpo", out)[1], tok, rows)["per_family"]
    return before, after


def teen_sums_wrong(run_dir: Path, adapters: tuple[str, ...] = ("sft", "dpo")) -> list[str]:
    """The model's wrong greedy answers to "What is a + b?" for a in 10-29, b in 0-9 (200 prompts, the demo's
    "12 + 7" among them): where the default's DPO models slip (a tens digit off by one, "20" answered "10")."""
    from glm_lora.evaluation.decode import greedy_answers
    tok, model = run_policy(run_dir, *adapters)
    sums = [(a, b) for a in range(10, 30) for b in range(10)]
    answers = greedy_answers(model, tok, [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in sums])
    return [f"{a}+{b}={x.strip()}" for (a, b), x in zip(sums, answers) if x.strip() != str(a + b)]


def on_policy_rejected(run: Path) -> dict:
    """Rewrite the DPO training pairs of a run copy: where the SFT model's greedy answer to a pair's prompt is not the
    chosen answer, that answer (its own mistake) becomes the rejected one; sources.json and the manifest record it. An
    experiment on the generator's pairs (random near-misses the SFT model mostly rules out already), not a stage."""
    from glm_lora.artifacts.manifest import MANIFEST, atomic_write_text, content_digest, file_entry, read_manifest
    from glm_lora.data.prepare import SOURCES
    from glm_lora.evaluation.decode import greedy_answers
    data = run / "data"
    sources = json.loads((data / SOURCES).read_text())
    path = data / sources["splits"]["dpo"]["path"]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    tok, model = run_policy(run, "sft")
    answers = greedy_answers(model, tok, [r["chosen"][:-1] for r in rows])
    changed = Counter()
    for r, answer in zip(rows, (a.strip() for a in answers)):
        if answer != r["chosen"][-1]["content"].strip():
            r["rejected"] = r["chosen"][:-1] + [{"role": "assistant", "content": answer}]
            changed[r["task"]] += 1
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    manifest = read_manifest(data)          # the copy's file list and digest follow, so the stage stays complete
    manifest["files"][path.name] = file_entry(path)
    sources["splits"]["dpo"]["sha256"] = manifest["files"][path.name]["sha256"]
    atomic_write_text(data / SOURCES, json.dumps(sources))
    manifest["files"][SOURCES] = file_entry(data / SOURCES)
    manifest["digest"] = content_digest(manifest["files"])
    atomic_write_text(data / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
    return {"pairs": len(rows), "on_policy": changed.total(), "on_policy_by_task": dict(changed)}


def dpo_variant(run_dir: Path, seed: int, out: Path, overrides: dict, on_policy: bool = False) -> dict:
    """The DPO stage with `overrides` on a copy of the run's inputs (out/tiny/), seeds as the run's; `on_policy`:
    on pairs rewritten by on_policy_rejected first."""
    from glm_lora.configs.load import load_config
    from glm_lora.flows.cli import run_one_stage

    shutil.rmtree(out, ignore_errors=True)
    for stage in ("pretrain", "sft", "tokenizer", "data"):
        shutil.copytree(run_dir / stage, out / "tiny" / stage)
    rewritten = on_policy_rejected(out / "tiny") if on_policy else None
    cfg = load_config("tiny", {"runs_dir": str(out), "serve.enabled": False, "pretrain.seed": seed,
                               "sft.seed": seed, "dpo.seed": seed, **overrides})
    m = run_one_stage("dpo", cfg).manifest()["metrics"]
    sft = json.loads((run_dir / "sft" / "manifest.json").read_text())["metrics"]["eval"]
    return {"seed": seed, "set": overrides, "on_policy": rewritten, "sft_exact_match": sft["exact_match"],
            **{k: m["eval"][k] for k in ("exact_match", "implicit_reward_accuracy", "mean_margin")},
            "best_step": m.get("best_step"), "fresh": fresh_eval(out / "tiny"),
            "teen_sums_wrong": teen_sums_wrong(out / "tiny")}


def main(argv: list[str]) -> None:
    import torch
    from glm_lora.configs.load import parse_value
    torch.set_num_threads(1)
    what, run_dir = argv[0], Path(argv[1])
    if what in ("dpo", "dpo_on_policy"):
        sets = {k: parse_value(v) for k, v in (a.split("=", 1) for a in argv[4:])}
        print(json.dumps(dpo_variant(run_dir, int(argv[2]), Path(argv[3]), sets, on_policy=what == "dpo_on_policy"),
                         ensure_ascii=False))
    elif what == "grpo":
        before, after = grpo_gain(run_dir, Path(tempfile.mkdtemp()), steps=int(argv[2]), lr=float(argv[3]))
        gain = sum(after.values()) / len(after) - sum(before.values()) / len(before)
        print(json.dumps({"run": str(run_dir), "steps": int(argv[2]), "lr": float(argv[3]), "before": before,
                          "after": after, "gain": gain, "worst": min(after[f] - before[f] for f in before)}))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
