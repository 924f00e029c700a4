"""Answer-quality sweep: many variants of the tiny default's pretrain → SFT → DPO recipe, one
process each, in parallel on one GPU (each is launch-bound, so 15 share an H200 well).

    python bench/quality/sweep.py JOBS.json OUT INPUTS

INPUTS holds stage outputs made on the CPU beforehand (`python -m glm_lora.flows.cli stage data|tokenizer`):
`tokenizer/`, `data/` and any other data dirs a job names. Each job (see jobs_*.json): `set` =
config overrides, `pretrain` = pretrain on the GPU first, `data` = data dir under INPUTS, `full` =
full fine-tuning instead of LoRA (by switching LoRA injection off: a measurement, not a feature),
`dpo` = DPO override lists run one after another on the SFT result. Results: OUT/results.jsonl,
with each SFT and DPO model's greedy answers to the fixed prompts (`eval.compare_prompts`) and how
many are right (`fixed_right`, against data.synthetic.solve).
Learning dynamics are those of the CPU default (fp32, pure-torch ops); only the clock differs.
"""
import json, os, subprocess, sys, time
from pathlib import Path

HERE = Path(os.environ.get("SWEEP_INPUTS", "."))


def graphs_report(metrics: dict) -> dict:
    """A stage's `cuda_graphs` report (used, capture seconds, why not)."""
    return {k: v for k, v in metrics.items() if k.startswith("cuda_graphs")}


def run_job(job: dict, out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import logging, tempfile
    from glm_lora.kernels import ops as kernels
    from glm_lora.configs.load import load_config, parse_value
    from glm_lora.engine import adapter_stage, dpo, pretrain, sft
    name = job["name"]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", filename=str(out / f"{name}.log"))
    ov = {"run_name": name, "runs_dir": "/tmp/sweep_runs", "checkpoint.save_every": 0, "checkpoint.resume": "never",
          "device": "cuda", "precision": "fp32", "kernels": "reference", "attention": "sdpa", "threads": 1,
          "model.arch": "qwen3", "sft.log_every": 500}
    for a in job.get("set", []):
        k, v = a.split("=", 1); ov[k] = parse_value(v)
    cfg = load_config("tiny", ov)
    from bench.quality.fixed_prompts import with_fixed
    sft.eval_tasks = with_fixed(sft.eval_tasks)
    dpo.eval_preferences = with_fixed(dpo.eval_preferences)
    kernels.using(cfg.kernels, cfg.attention).__enter__()     # this process runs one job: for its whole life
    if job.get("cpu_attention"):    # as on the CPU under bf16 autocast: attention in fp32 (kernels/reference.py)
        import torch
        import glm_lora.kernels.reference as ref
        eager = ref.attention
        ref.attention = lambda q, k, v, m: (ref.attention_in_fp32(q, k, v, m) if torch.is_autocast_enabled(q.device.type)
                                            else eager(q, k, v, m))
    base = HERE / job.get("base", ".")
    data = HERE / job.get("data", "data")
    t = time.time()
    if job.get("pretrain"):
        pdir = Path("/tmp/sweep_runs") / name / "pretrain"; pdir.mkdir(parents=True, exist_ok=True)
        pm = pretrain.run(cfg, {"tokenizer": HERE / "tokenizer", "data": data}, pdir)
        (pdir / "manifest.json").write_text(json.dumps({"digest": name, "metrics": pm}, default=str))
        base_pre = pdir
    else:
        base_pre = base / "pretrain"
    if job.get("full"):
        def no_lora(model, *a, **k):
            for p in model.parameters(): p.requires_grad_(True)
        adapter_stage.inject_lora = no_lora
        adapter_stage.save_adapter = lambda *a, **k: None
    sdir = Path(tempfile.mkdtemp())
    m = sft.run(cfg, {"base": base_pre, "tokenizer": HERE / "tokenizer", "data": data}, sdir)
    e = m["eval"]
    res = {"name": name, "job": job, "secs": round(time.time() - t), "em": e["exact_match"], "min": e["min_family"],
           "fam": e["per_family"], "fixed_right": e["fixed_right"], "fixed": e["fixed"],
           "val": m.get("val_losses"), "best_step": m.get("best_step"),
           "graphs": graphs_report(m), "dpo": []}
    (sdir / "manifest.json").write_text(json.dumps({"digest": name + "-sft", "metrics": {}}))
    for i, dsets in enumerate(job.get("dpo", [])):
        dcfg = load_config("tiny", {**ov, **{k: parse_value(v) for k, v in (a.split("=", 1) for a in dsets)}})
        ddir = Path(tempfile.mkdtemp())
        try:
            dm = dpo.run(dcfg, {"base": base_pre, "sft": sdir, "tokenizer": HERE / "tokenizer", "data": data}, ddir)
            de = dm["eval"]
            res["dpo"].append({"set": dsets, **{k: v for k, v in de.items() if k not in ("samples",)},
                               "val": dm.get("val_losses"), "best_step": dm.get("best_step"),
                               "graphs": graphs_report(dm)})
        except Exception as ex:
            res["dpo"].append({"set": dsets, "error": repr(ex)})
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")


def main():
    jobs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
    if len(sys.argv) > 4:
        return run_job(jobs[int(sys.argv[4])], out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SWEEP_INPUTS": str(Path(sys.argv[3]).resolve())}
    procs = [subprocess.Popen([sys.executable, __file__, sys.argv[1], str(out), sys.argv[3], str(i)],
                              stdout=open(out / f"{j['name']}.out", "w"), stderr=subprocess.STDOUT, env=env)
             for i, j in enumerate(jobs)]
    for p in procs:
        p.wait()


if __name__ == "__main__":
    main()
