"""Two cores: where a CPU training step's time goes, and the levers, A/B in one process.

    python -m bench.cpu_step --run runs/tiny [--seconds 120] [--min-steps 100] [--profile]

Uses a finished tiny run's tokenizer, data and pretrained base (`--run`), and the tiny SFT step exactly as
the engine runs it (LoRA r32 + embed/lm_head trained, 8 packed rows of 128 tokens, AdamW, clipping).

1. Profile (eager, 2 and 1 threads): milliseconds per step in data, forward, host copy of the metrics, backward and
   optimizer (clip + step + zero_grad); with --profile the top ATen ops too.
2. Variants, interleaved step by step on the same batches so that other load on the machine hits them alike:
   eager / compiled (engine/compile.py) x 2 / 1 threads, optionally bf16 autocast and fused AdamW
   (`--variants compiled-2t,compiled-bf16-fused-2t`). Each has its own copy of the model and optimizer
   from the same start; the table gives median and mean step time (a stage's wall time is the mean's: on a
   shared machine the 2-thread steps have long tails), steps/s, real tokens/s, the ratio to eager with 2
   threads, the first step's time (compile included) and the largest loss difference to eager-2-threads over
   the run (eager with 1 thread is the fp32-rounding yardstick: another summation order, nothing else).
3. Greedy decoding of the sft_eval prompts: the KV-cached decoder vs the previous one (kept verbatim in
   tests/evaluation/test_decode.py), interleaved, with a check that the token ids agree.

Writes bench/results/cpu_step_<date>_<commit>.json.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch

from bench.common import BENCH, write_result
from glm_lora.kernels import ops as kernels
from glm_lora.kernels import reference
from glm_lora.configs.load import load_config
from glm_lora.data.pipeline import StageData
from glm_lora.data.prepare import split_path
from glm_lora.data.tokenizer import end_of_turn_ids
from glm_lora.evaluation import decode, metrics
from glm_lora.engine.compile import compiled_training
from glm_lora.model.heads import causal_lm_loss
from glm_lora.engine.optim import build_optimizer, lr_at
from glm_lora.model import inject_lora
from glm_lora.model.hf import load_native


def sft_setup(run: Path, runs_dir: Path):
    cfg = load_config("tiny", {"runs_dir": str(runs_dir)})
    tc = cfg.sft
    data = StageData(cfg, run / "tokenizer", run / "data", "cpu")
    make, _ = data.batches("sft", tc)
    torch.manual_seed(tc.seed)
    model = load_native(run / "pretrain")
    inject_lora(model, tc.lora)
    return cfg, tc, data, make(None), model.train()


class Variant:
    def __init__(self, name: str, base, tc, threads: int, compile: bool | str, runs_dir: Path, bf16: bool = False,
                 fused: bool = False, stack: bool = False, repeat_kv: bool = False):
        self.name, self.threads, self.tc, self.stack, self.repeat_kv = name, threads, tc, stack, repeat_kv
        self.autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
        self.model = copy.deepcopy(base)
        self.opt = build_optimizer(self.model, tc.lr, tc.weight_decay, fused=fused,
                                   lora_b_lr_ratio=tc.lora.b_lr_ratio)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.ctx = compiled_training(self.model, compile, device=torch.device("cpu"), runs_dir=runs_dir, name=name)
        self.info = self.ctx.__enter__()
        self.times, self.losses, self.tokens, self.first = [], [], [], None

    def step(self, batch: dict, step: int) -> None:
        torch.set_num_threads(self.threads)
        kernels.STACK_SIBLINGS["cpu"] = self.stack
        reference.GQA_WITH_MASK["cpu"] = not self.repeat_kv
        tc = self.tc
        lr = lr_at(step, max_steps=tc.max_steps, warmup_steps=tc.warmup_steps, base_lr=tc.lr,
                   min_lr_ratio=tc.min_lr_ratio)
        t = time.perf_counter()
        for g in self.opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        with self.autocast:
            loss, m = causal_lm_loss(self.model, batch)
        values = torch.stack([loss.detach(), *(torch.as_tensor(v).float() for v in m.values())]).tolist()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.trainable, tc.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t
        if self.first is None:
            self.first = dt
        else:
            self.times.append(dt)
            self.tokens.append(int(batch["num_tokens"]))
        self.losses.append(values[0])

    def close(self):
        self.ctx.__exit__(None, None, None)


def profile_phases(model, tc, batches, steps: int, ops: bool, threads: int = 2) -> dict:
    torch.set_num_threads(threads)
    opt = build_optimizer(model, tc.lr, tc.weight_decay, lora_b_lr_ratio=tc.lora.b_lr_ratio)
    trainable = [p for p in model.parameters() if p.requires_grad]
    phases = dict(data=[], forward=[], metrics_copy=[], backward=[], optimizer=[])
    for i in range(steps + 5):
        t0 = time.perf_counter()
        batch = next(batches)
        t1 = time.perf_counter()
        loss, m = causal_lm_loss(model, batch)
        t2 = time.perf_counter()
        torch.stack([loss.detach(), *(torch.as_tensor(v).float() for v in m.values())]).tolist()
        t3 = time.perf_counter()
        loss.backward()
        t4 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(trainable, tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t5 = time.perf_counter()
        if i >= 5:
            for k, a, b in zip(phases, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                phases[k].append(b - a)
    out = {k: round(statistics.median(v) * 1000, 2) for k, v in phases.items()}
    out["step_sum"] = round(sum(out.values()), 2)
    table = None
    if ops:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(10):
                loss, _ = causal_lm_loss(model, next(batches))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trainable, tc.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
        table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
        print(table)
    return {"ms_per_step_median": out, "ops_top20": table}


def decode_ab(model, data, max_rows: int, max_new_tokens: int, repeats: int) -> dict:
    spec = importlib.util.spec_from_file_location("_greedy_ref", BENCH.parent / "tests/evaluation/test_decode.py")
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    rows = metrics.read_task_rows(split_path(data.data_dir, "sft_eval"), limit=max_rows)
    tok = data.tok
    ids = [decode.prompt_ids(tok, metrics.prompt_and_answer(r["conversations"], "row")[0]) for r in rows]
    eos = end_of_turn_ids(tok)
    torch.set_num_threads(2)
    times = {"uncached": [], "cached": []}
    model.eval()
    with torch.no_grad():
        for _ in range(repeats):
            t = time.perf_counter()
            old = ref.uncached_greedy_decode(model, ids, max_new_tokens=max_new_tokens, eos_id=eos)
            times["uncached"].append(time.perf_counter() - t)
            t = time.perf_counter()
            new = decode.greedy_decode(model, ids, max_new_tokens=max_new_tokens, eos_id=eos)
            times["cached"].append(time.perf_counter() - t)
    model.train()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"prompts": len(ids), "max_new_tokens": max_new_tokens, "repeats": repeats,
            "seconds_median": {k: round(v, 3) for k, v in med.items()}, "speedup": round(med["uncached"] / med["cached"], 2),
            "same_token_ids": old == new, "answer_tokens": sum(map(len, new))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=Path("runs/tiny"), help="a finished tiny run (tokenizer, data, pretrain)")
    ap.add_argument("--runs-dir", type=Path, default=Path("runs"), help="token cache and runs_dir/.cache/inductor")
    ap.add_argument("--seconds", type=float, default=120, help="wall time of the interleaved A/B")
    ap.add_argument("--min-steps", type=int, default=100, help="interleaved rounds at least (loss agreement)")
    ap.add_argument("--profile", action="store_true", help="also print the top ATen ops of the eager step")
    ap.add_argument("--variants", default="eager-2t,compiled-2t,eager-1t,compiled-1t",
                    help="kind[-bf16][-fused][-stack][-repeatkv][-autotune]-Nt (eager|compiled; bf16 autocast; fused AdamW; "
                         "q/k/v and gate/up stacked: kernels.stacks_siblings; k/v heads repeated before the masked "
                         "attention: reference.GQA_WITH_MASK off; compile: max-autotune), comma-separated; "
                         "the first is the baseline")
    args = ap.parse_args()
    cfg, tc, data, batches, base = sft_setup(args.run, args.runs_dir)
    started = time.perf_counter()
    out = {"setup": {"run": str(args.run), "sft": {"batch_size": tc.batch_size, "seq_len": tc.seq_len, "lora_r": tc.lora.r},
                     "torch": torch.__version__, "load_avg_start": list(os.getloadavg())}}
    for threads in (2, 1):
        key = f"profile_eager_{threads}t"
        out[key] = profile_phases(copy.deepcopy(base), tc, batches, 30, args.profile and threads == 2, threads)
        print(key, "(ms/step, median):", out[key]["ms_per_step_median"])
    variants = []
    for name in args.variants.split(","):
        kind, *options, threads = name.split("-")   # e.g. compiled-bf16-fused-2t: bf16 autocast, fused AdamW
        compile = ("max-autotune" if "autotune" in options else True) if kind == "compiled" else False
        variants.append(Variant(name, base, tc, int(threads[:-1]), compile, args.runs_dir,
                                bf16="bf16" in options, fused="fused" in options, stack="stack" in options,
                                repeat_kv="repeatkv" in options))
    step, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds or step < args.min_steps:
        batch = next(batches)
        for v in variants:
            v.step(batch, step)
        step += 1
    ref = variants[0]
    rows = {}
    for v in variants:
        med = statistics.median(v.times)
        rows[v.name] = {"steps": len(v.times) + 1, "median_step_ms": round(med * 1000, 2), "steps_per_s": round(1 / med, 2),
                        "tokens_per_s": round(statistics.median(v.tokens) / med), "first_step_s": round(v.first, 2),
                        "mean_step_ms": round(statistics.mean(v.times) * 1000, 2),
                        "ratio_vs_" + ref.name: round(statistics.median(ref.times) / med, 3),
                        "tokens_per_s_overall": round(sum(v.tokens) / sum(v.times)),
                        "mean_ratio_vs_" + ref.name: round(statistics.mean(ref.times) / statistics.mean(v.times), 3),
                        "max_abs_loss_diff_vs_" + ref.name: max(abs(a - b) for a, b in zip(v.losses, ref.losses)),
                        "last_loss": v.losses[-1], **{k: v.info[k] for k in ("compile", "compile_s", "compile_fallback")
                                                      if k in v.info}}
        print(v.name, rows[v.name])
        v.close()
    out["interleaved"] = rows
    out["decode"] = decode_ab(variants[0].model, data, cfg.eval.max_rows, cfg.eval.max_new_tokens, 3)
    print("decode:", out["decode"])
    out["setup"]["load_avg_end"] = list(os.getloadavg())
    out["setup"]["wall_s"] = round(time.perf_counter() - started, 1)
    batches.close()
    print(write_result("cpu_step", out))


if __name__ == "__main__":
    main()
