"""Train the RL stage alone on a run's stages: python -m bench.quality.rl_run RUN_DIR STEPS '{overrides JSON}'
(prints the stage metrics, the first sampled answers and the last logging windows; the adapter stays in a temp dir)."""
import sys, json, tempfile, pathlib, time, torch
from glm_lora.configs.load import load_config
from glm_lora.engine import rl
run_dir = pathlib.Path(sys.argv[1])
steps = int(sys.argv[2])
extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
tmp = pathlib.Path(tempfile.mkdtemp())
cfg = load_config("tiny", {"rl.max_steps": steps, "rl.log_every": 1, "runs_dir": str(tmp / "runs"), "serve.enabled": False, **extra})
t = time.time()
m = rl.run(cfg, {"base": run_dir / "pretrain", "sft": run_dir / "sft", "dpo": run_dir / "dpo", "tokenizer": run_dir / "tokenizer", "data": run_dir / "data"}, tmp)
print("time", round(time.time() - t), {k: v for k, v in m.items() if k not in ("samples", "losses")})
print(json.dumps(m["samples"][:4], ensure_ascii=False))
print(open(tmp / "metrics.jsonl").read()[-3000:])
