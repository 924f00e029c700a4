"""What the torchrun path costs: the same training stage in one plain process and under
`torchrun --nproc-per-node 1` (FSDP2 for pretraining, DDP for LoRA SFT), same config, same data, same
GPU, one after the other in one call. Target (issue: scale out with torchrun): tokens/s within 5%,
bf16 loss curves that agree.

    python -m bench.torchrun_overhead_gpu [--config base] [--steps 30] [--set KEY=VALUE ...]

Stage inputs are made first with `python -m glm_lora.flows.cli stage data|tokenizer` in a scratch runs_dir.
tokens/s = median of the per-window `tokens_per_s` after the first two windows (warm-up: model
build, FlexAttention compile). Both variants run as subprocesses (`python -m glm_lora.engine STAGE` vs
`torchrun ... -m glm_lora.engine STAGE`), so start-up is alike and only the wrapper differs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from glm_lora.artifacts.manifest import write_manifest
from bench.common import write_result

REPO = Path(__file__).resolve().parents[1]


def sh(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=None)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def steady_tokens_per_s(out: Path) -> float:
    windows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(w["tokens_per_s"] for w in windows[2:] or windows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="base")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="torchrun-overhead-"))
    sets = ["runs_dir=" + str(work / "runs"), "serve.enabled=false", "eval.enabled=false", "checkpoint.save_every=0",
            "data.synthetic.n_pretrain=20000", "data.synthetic.n_sft=20000", "data.synthetic.n_dpo=2000",
            "data.synthetic.n_eval=200", f"pretrain.max_steps={args.steps}", f"sft.max_steps={args.steps}",
            "pretrain.log_every=5", "sft.log_every=5", "pretrain.eval_every=0", "sft.eval_every=0", *args.set]
    flags = [a for s in sets for a in ("--set", s)]
    for stage in ("data", "tokenizer"):
        sh([sys.executable, "-m", "glm_lora.flows.cli", "stage", stage, "--config", args.config, *flags], REPO)
    from glm_lora.configs.load import load_config, parse_value
    cfg = load_config(args.config, {k: parse_value(v) for k, _, v in (s.partition("=") for s in sets)})
    config_file = work / "config.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    run = cfg.run_dir
    results, base = {}, None
    for stage, strategy in (("pretrain", "fsdp2"), ("sft", "ddp")):
        inputs = {"tokenizer": run / "tokenizer", "data": run / "data"} | ({"base": base} if stage == "sft" else {})
        tail = [a for k, v in inputs.items() for a in ("--input", f"{k}={v}")]
        for variant in ("in_process", "torchrun_1"):
            out = work / f"{stage}-{variant}"
            out.mkdir()
            launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
                      if variant == "torchrun_1" else [sys.executable])
            metrics = json.loads(sh([*launch, "-m", "glm_lora.engine", stage, "--config", str(config_file), "--out", str(out),
                                     *tail], REPO).strip().splitlines()[-1])
            write_manifest(out, stage)          # a published-looking artifact: the next stage's input
            losses = json.loads((out / "losses.json").read_text())
            results[f"{stage}_{variant}"] = {"tokens_per_s": steady_tokens_per_s(out), "losses": losses,
                                             "strategy": metrics.get("strategy", "none (plain process)")}
        a, b = results[f"{stage}_in_process"], results[f"{stage}_torchrun_1"]
        results[f"{stage}_ratio"] = b["tokens_per_s"] / a["tokens_per_s"]
        results[f"{stage}_max_loss_diff"] = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
        results[f"{stage}_expected_strategy"] = strategy
        if stage == "pretrain":
            base = work / "pretrain-in_process"
        print(stage, f"in-process {a['tokens_per_s']:.0f} tok/s, torchrun(1) {b['tokens_per_s']:.0f} tok/s "
              f"({results[f'{stage}_ratio']:.3f}×, {b['strategy']}), max |Δloss| {results[f'{stage}_max_loss_diff']:.2e}")
    print(write_result("torchrun_overhead_gpu", {"config": args.config, "steps": args.steps, "sets": sets, **results}))


if __name__ == "__main__":
    main()
