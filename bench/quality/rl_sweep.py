"""GRPO seeds × settings on one GPU, one process per job (a tiny model's step is launch-bound, so several share an H200):

    python -m bench.quality.rl_sweep RUN OUT '[{"name": "lr3e-4-s0", "set": {"rl.lr": 3e-4, "rl.seed": 0}}, ...]'

RUN holds a default run's stages (data, tokenizer, pretrain, sft, dpo). Each job trains the RL stage (engine.rl.run, on
`rl.families` = the four weakest families unless set) on the DPO model and reports held-out greedy exact match per
family on fresh prompts (bench/quality/fresh.py) for the DPO model (the baseline, same process) and DPO + the RL
adapter: OUT/results.jsonl, one line a job. Each line also holds the exact match over all ten families on the same
fresh prompts for the SFT model, the DPO model and DPO + RL (`all_*`: "overall ≥ SFT's"), the stage's own held-out
view (`stage_eval`: sft_eval, 20 rows a family, as the DAG reports it, beside the SFT stage's recorded one) and the
rollout reward per logging window (`curve`)."""
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULTS = {"device": "cuda", "precision": "fp32", "kernels": "reference", "attention": "sdpa", "threads": 1,
            "serve.enabled": False, "checkpoint.save_every": 0, "checkpoint.resume": "never", "rl.log_every": 50}


def run_job(run_dir: Path, out: Path, job: dict) -> None:
    import torch
    from bench.quality.fresh import ALL_FAMILIES, WEAK_FAMILIES, fresh_rows
    from glm_lora.kernels import ops as kernels
    from glm_lora.configs.load import load_config
    from glm_lora.data.tokenizer import load_tokenizer
    from glm_lora.engine import rl
    from glm_lora.evaluation.metrics import task_metrics
    from glm_lora.model.adapters import load_policy

    tmp = Path(tempfile.mkdtemp())
    cfg = load_config("tiny", {**DEFAULTS, "rl.families": WEAK_FAMILIES, "runs_dir": str(tmp / "runs"), **job["set"]})
    kernels.using(cfg.kernels, cfg.attention).__enter__()
    stages = {s: run_dir / s for s in ("pretrain", "sft", "dpo", "tokenizer", "data")}
    t = time.time()
    m = rl.run(cfg, {"base": stages["pretrain"], **stages}, tmp)
    secs = time.time() - t
    tok = load_tokenizer(run_dir / "tokenizer")
    families = cfg.rl.families or WEAK_FAMILIES
    rows = fresh_rows(run_dir, ALL_FAMILIES, tmp)
    rows = rows[:job.get("max_rows", len(rows))]
    dirs = [stages["pretrain"], stages["sft"], stages["dpo"]]
    score = lambda *d: task_metrics(load_policy(*d).to(cfg.device).eval(), tok, rows, max_new_tokens=24)["per_family"]  # noqa: E731
    sft, before, after = score(*dirs[:2]), score(*dirs), score(*dirs, tmp)
    pick = lambda d: {f: d[f] for f in families if f in d}  # noqa: E731
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    recorded = json.loads((stages["sft"] / "manifest.json").read_text()).get("metrics", {}).get("eval", {})
    ev = m.get("eval", {})
    curve = [{k: w.get(k) for k in ("step", "reward_mean", "flat_groups", "kl", "completion_length", "lr", "elapsed_s")}
             for w in map(json.loads, (tmp / "metrics.jsonl").read_text().splitlines())]
    line = {"name": job["name"], "set": job["set"], "train_s": round(secs, 1), "steps": m.get("step"),
            "before": pick(before), "after": pick(after), "min_before": min(pick(before).values()),
            "min_after": min(pick(after).values()), "mean_before": mean(pick(before)), "mean_after": mean(pick(after)),
            "all_sft": sft, "all_before": before, "all_after": after, "all_mean_sft": mean(sft),
            "all_mean_before": mean(before), "all_mean_after": mean(after), "all_min_after": min(after.values()),
            "n_rows": len(rows),
            "stage_eval": {"exact_match": ev.get("exact_match"), "min_family": ev.get("min_family"),
                           "per_family": ev.get("per_family")},
            "sft_stage_eval": {"exact_match": recorded.get("exact_match"), "min_family": recorded.get("min_family")},
            "curve": curve,
            "device": torch.cuda.get_device_name(0) if cfg.device == "cuda" else "cpu"}
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def main() -> None:
    run_dir, out, jobs = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([sys.executable, "-m", "bench.quality.rl_sweep", "--job", str(run_dir), str(out), json.dumps(j)],
                              stdout=open(out / f"{j['name']}.log", "w"), stderr=subprocess.STDOUT) for j in jobs]
    for p, j in zip(procs, jobs):
        print(j["name"], "rc", p.wait(), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--job":
        run_job(Path(sys.argv[2]), Path(sys.argv[3]), json.loads(sys.argv[4]))
    else:
        main()
