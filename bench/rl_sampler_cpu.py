"""rl.sampler ours vs vllm on the 2-core CPU, same run, same settings (the GRPO bench's: the four weakest families,
8 prompts × 8 answers of ≤ 8 tokens a step, lr 2e-4):

    python -m bench.rl_sampler_cpu RUN [STEPS]

RUN holds a default run's stages (data, tokenizer, pretrain, sft, dpo). Each sampler trains the rl stage for STEPS
steps (default 40) through the stage table's function (tasks/rl_sampler.rl_stage), ours first; reported: the stage's
wall time (vLLM's start included), the training loop's time per step after the first 5 (steady state: the first
step waits for vLLM's start), and the reward over the last steps. Results: bench/results/rl_sampler_cpu_<date>_<commit>.json.
"""
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write_result
from bench.quality.fresh import WEAK_FAMILIES
from glm_lora.configs.load import load_config
from glm_lora.tasks.rl_sampler import rl_stage


def one(run: Path, sampler: str, steps: int) -> dict:
    tmp = Path(tempfile.mkdtemp())
    cfg = load_config("tiny", {"runs_dir": str(tmp / "runs"), "serve.enabled": False, "eval.enabled": False,
                               "checkpoint.save_every": 0, "checkpoint.resume": "never", "rl.sampler": sampler,
                               "rl.max_steps": steps, "rl.log_every": 1, "rl.max_new_tokens": 8,
                               "rl.families": WEAK_FAMILIES, "rl.batch_size": 8, "rl.group_size": 8})
    t = time.perf_counter()
    m = rl_stage(cfg, {s: run / s for s in ("data", "tokenizer", "sft", "dpo")} | {"base": run / "pretrain"}, tmp)
    wall = time.perf_counter() - t
    rows = [json.loads(x) for x in (tmp / "metrics.jsonl").read_text().splitlines()]
    t5 = next(r["elapsed_s"] for r in rows if r["step"] == 5)
    steady = (rows[-1]["elapsed_s"] - t5) / (rows[-1]["step"] - 5)
    last = [r["reward_mean"] for r in rows[-10:]]
    return {"sampler": sampler, "steps": m["step"], "stage_wall_s": round(wall, 1), "s_per_step_after_5": round(steady, 4),
            "first_5_steps_s": round(t5, 1), "reward_mean_last10": round(sum(last) / len(last), 4)}


def main() -> None:
    run, steps = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 40
    rows = [one(run, s, steps) for s in ("ours", "vllm")]
    for r in rows:
        print(json.dumps(r), flush=True)
    ratio = rows[1]["s_per_step_after_5"] / rows[0]["s_per_step_after_5"]
    print(f"vllm / ours step time: {ratio:.2f}", flush=True)
    write_result("rl_sampler_cpu", {"rows": rows, "vllm_over_ours_step_time": round(ratio, 3)})


if __name__ == "__main__":
    main()
