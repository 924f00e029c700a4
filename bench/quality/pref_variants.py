"""One preference loss, 100 steps on a run's SFT model, then held-out implicit-reward accuracy and the log odds ratio
on its 200 dpo_eval pairs: RUN=runs/tiny python -m bench.quality.pref_variants LOSS '{settings JSON}'"""
import sys, json, tempfile, pathlib, time, torch
from glm_lora.configs.load import load_config
from glm_lora.engine import dpo
from glm_lora.evaluation.metrics import preference_metrics
from glm_lora.data import formats
from glm_lora.data.prepare import split_path
from glm_lora.data.tokenizer import load_tokenizer
from glm_lora.model.adapters import load_policy
import os; run_dir = pathlib.Path(os.environ.get("RUN", "runs/tiny"))
loss, settings = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
tmp = pathlib.Path(tempfile.mkdtemp())
SHORT = {"pretrain.max_steps": 60, "sft.max_steps": 120, "dpo.max_steps": 20, "data.synthetic.n_pretrain": 1500, "data.synthetic.n_sft": 1000, "data.synthetic.n_dpo": 200} if os.environ.get("SHORT") else {}   # SHORT=1: a run made with tests/test_dag.py's SHORT config
cfg = load_config("tiny", {**SHORT, "runs_dir": str(tmp / "runs"), "serve.enabled": False, "dpo.loss": loss, "dpo.max_steps": 100, "dpo.eval_every": 0, "eval.enabled": False, **settings})
t = time.time()
dpo.run(cfg, {"base": run_dir / "pretrain", "sft": run_dir / "sft", "tokenizer": run_dir / "tokenizer", "data": run_dir / "data"}, tmp)
tt = time.time() - t
tok, pairs = load_tokenizer(run_dir / "tokenizer"), list(formats.read_dpo(split_path(run_dir / "data", "dpo_eval")))
sft_model = load_policy(run_dir / "pretrain", run_dir / "sft").eval()
before = preference_metrics(sft_model, tok, pairs, seq_len=cfg.dpo.seq_len, beta=cfg.dpo.beta)
after = preference_metrics(load_policy(run_dir / "pretrain", run_dir / "sft", tmp).eval(), tok, pairs, seq_len=cfg.dpo.seq_len, beta=cfg.dpo.beta, ref_model=sft_model)
print(loss, settings, "train_s", round(tt), "implicit", after["implicit_reward_accuracy"], "logprob before/after", before["logprob_accuracy"], after["logprob_accuracy"], flush=True)
print("log_odds_ratio before/after", before["log_odds_ratio"], after["log_odds_ratio"], flush=True)
