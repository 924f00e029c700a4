"""python -m bench.quality.rl_families RUN_DIR [RL_ADAPTER_DIR]: exact match per family on fresh held-out prompts (seed 123, prompts in the run's SFT training file removed):
the DPO model vs the DPO model + an RL adapter."""
import sys, json, pathlib, collections
from glm_lora.data.synthetic import generate
from glm_lora.data.prepare import split_path
from glm_lora.data.tokenizer import load_tokenizer
from glm_lora.engine import evaluate
from glm_lora.model.adapters import load_policy
run_dir, rl_dir = pathlib.Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None
fams = ["add_en", "add_zh", "sub_en", "sub_zh"]
import tempfile
files = generate(pathlib.Path(tempfile.mkdtemp()), seed=123, n_pretrain=3, n_sft=1, n_dpo=1, n_eval=2000)
train = {json.dumps(r["conversations"][:-1]) for r in evaluate.read_task_rows(split_path(run_dir / "data", "sft"))}
rows = [r for r in evaluate.read_task_rows(files["sft_eval"]) if r["task"] in fams and json.dumps(r["conversations"][:-1]) not in train]
tok = load_tokenizer(run_dir / "tokenizer")
dirs = [run_dir / "pretrain", run_dir / "sft", run_dir / "dpo"] + ([pathlib.Path(rl_dir)] if rl_dir else [])
m = evaluate.task_metrics(load_policy(*dirs).eval(), tok, rows, max_new_tokens=24)
print("rl" if rl_dir else "dpo", {f: round(v, 3) for f, v in m["per_family"].items()}, m["n_per_family"], flush=True)
