"""python -m bench.quality.rl_families RUN_DIR [RL_ADAPTER_DIR]: exact match per family on fresh held-out prompts (seed 123, prompts in the run's SFT training file removed):
the DPO model vs the DPO model + an RL adapter."""
import sys, pathlib
from bench.quality.fresh import WEAK_FAMILIES, fresh_rows
from glm_lora.data.tokenizer import load_tokenizer
from glm_lora.evaluation.metrics import task_metrics
from glm_lora.model.adapters import load_policy
run_dir, rl_dir = pathlib.Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None
rows = fresh_rows(run_dir, WEAK_FAMILIES)
tok = load_tokenizer(run_dir / "tokenizer")
dirs = [run_dir / "pretrain", run_dir / "sft", run_dir / "dpo"] + ([pathlib.Path(rl_dir)] if rl_dir else [])
m = task_metrics(load_policy(*dirs).eval(), tok, rows, max_new_tokens=24)
print("rl" if rl_dir else "dpo", {f: round(v, 3) for f, v in m["per_family"].items()}, m["n_per_family"], flush=True)
