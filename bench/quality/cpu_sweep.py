"""Answer-quality sweep on this machine's CPUs (for when no GPU is lent): the tiny default's stages, one job per
process at one thread each (so bf16 rounding, which follows the thread layout, is the same in every run of a job),
`--parallel` jobs at a time.

    python bench/quality/cpu_sweep.py JOBS.json OUT [--parallel 2]

A job: `name`, `seed` (pretrain, SFT and DPO seeds) and `set` (config overrides on configs/tiny.yaml, e.g.
`sft.max_steps=3000` or `data.synthetic.sft_weights={add_en: 3}`). Each seed's data → tokenizer → pretrain is built
once under OUT/base_seed{N} and copied into each of its jobs, whose data stage is then rebuilt with the job's
overrides: the SFT mix changes sft.jsonl only (every file has its own random stream), so pretraining is the same.
Results: OUT/results.jsonl — SFT and DPO held-out metrics and each model's greedy answers to the fixed prompts
(`eval.compare_prompts`, checked against data.synthetic.solve), as bench/quality/sweep.py writes them on the GPU,
and each model's exact match per family on ~160 fresh held-out prompts a family (bench.quality.fresh.fresh_eval;
the stages' own 20 a family move in steps of 5 points). Each job's run directory stays under OUT/runs.

    python bench/quality/cpu_sweep.py --fresh RUN_DIR     # the fresh-prompt figures of a finished run
"""
import argparse, fcntl, json, os, shutil, subprocess, sys, time
from pathlib import Path


def run_job(job: dict, out: Path) -> None:
    import torch
    torch.set_num_threads(1)
    from glm_lora.configs.load import load_config, parse_value
    from glm_lora.engine import dpo, sft
    from glm_lora.flows.cli import run_one_stage
    from bench.quality.fixed_prompts import with_fixed
    sft.eval_tasks = with_fixed(sft.eval_tasks)
    dpo.eval_preferences = with_fixed(dpo.eval_preferences)
    seed = job["seed"]
    seeds = {f"{s}.seed": seed for s in ("pretrain", "sft", "dpo")}
    base = out / f"base_seed{seed}"
    with open(out / f"base_seed{seed}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (base / "tiny" / "pretrain" / "manifest.json").exists():
            cfg = load_config("tiny", {**seeds, "runs_dir": str(base), "serve.enabled": False})
            for stage in ("data", "tokenizer", "pretrain"):
                run_one_stage(stage, cfg)
    runs = out / "runs" / job["name"]
    shutil.rmtree(runs, ignore_errors=True)
    shutil.copytree(base, runs)
    ov = {**seeds, "runs_dir": str(runs), "serve.enabled": False}
    for a in job.get("set", []):
        k, v = a.split("=", 1)
        ov[k] = parse_value(v)
    cfg = load_config("tiny", ov)
    res = {"name": job["name"], "job": job}
    t = time.time()
    for stage in ("data", "sft", "dpo"):
        m = run_one_stage(stage, cfg).manifest()["metrics"]
        if stage != "data":
            e = m["eval"]
            res[stage] = {k: e.get(k) for k in ("exact_match", "min_family", "per_family", "fixed_right", "fixed",
                                                "implicit_reward_accuracy", "mean_margin") if k in e}
            res[stage]["val"] = m.get("val_losses")
        res[f"{stage}_s"] = round(time.time() - t)
        t = time.time()
    from bench.quality.fresh import fresh_eval
    res["fresh"] = fresh_eval(cfg.run_dir)
    res["fresh_s"] = round(time.time() - t)
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("jobs", type=Path, nargs="?")
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--fresh", type=Path, metavar="RUN_DIR")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--job", type=int)
    a = ap.parse_args()
    if a.fresh:
        import torch
        torch.set_num_threads(1)
        from bench.quality.fresh import fresh_eval
        return print(json.dumps(fresh_eval(a.fresh)))
    jobs = json.loads(a.jobs.read_text())
    a.out.mkdir(parents=True, exist_ok=True)
    if a.job is not None:
        return run_job(jobs[a.job], a.out)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running: list[subprocess.Popen] = []
    for i, job in enumerate(jobs):
        while len(running) >= a.parallel:
            time.sleep(5)
            running = [p for p in running if p.poll() is None]
        log = open(a.out / f"{job['name']}.log", "w")
        running.append(subprocess.Popen([sys.executable, __file__, str(a.jobs), str(a.out), "--job", str(i)],
                                        stdout=log, stderr=subprocess.STDOUT, env=env))
    for p in running:
        p.wait()


if __name__ == "__main__":
    main()
