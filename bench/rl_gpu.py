"""GRPO step speed: ours vs TRL's GRPOTrainer, one process, one GPU, the same model, prompts and lengths.

The model is transformers' own Qwen3ForCausalLM at random init (seed 0; `--shape`: qwen3_0.5b = hidden 1024,
28 layers, 16 heads / 8 kv of head_dim 64, intermediate 3072, vocab 151936, tied embeddings ≈ 0.51B parameters —
Qwen3-0.6B's shape except head_dim 64 instead of 128, since model/hf.py takes head_dim = hidden / heads for dense
models), saved once as a HF checkpoint (bf16 safetensors) that both sides load: ours through the project's import
path (model/hf.py load_hf, as engine/import_base.py does), TRL through AutoModelForCausalLM.

Each optimizer step on both sides: 8 prompts × group 8 = 64 completions, sampled in-process at temperature 1
(no top-k / top-p), exactly `--completion` new tokens each (no early EOS: ours samples with no stop token —
Rollouts' stop set is empty; TRL's GenerationConfig gets min_new_tokens = max_completion_length, which masks the
EOS logit until then, and EOS is the pad token), then one GRPO update (one update per rollout, so ratio = 1,
clip ε 0.2, β = 0: no reference forward; per-answer token mean "grpo"), grad clip 1.0, AdamW, LoRA r16 α32 on
every linear layer but the head on both sides. Prompts: the same 512 random token-id sequences of `--prompt`
tokens on both sides (TRL gets them as text of a word-level tokenizer, one word per id: its tokenisation gives
back exactly these ids, checked). Reward: the share of even token ids in the answer (text in, float out, the same
function on both sides; random, so advantages are non-zero).

Providers:
  ours             engine/rollouts.py Rollouts.rollout (evaluation/decode.sample_decode, KV cache, the decode step
                   replayed from a CUDA graph: evaluation/decode.decode_graph_pays) + GRPOLoss through engine/trainer.train_step
                   (the stage's step), kernels "triton", attention "flex" (padded rows: causal SDPA either way), the
                   frozen GEMM weights in bf16 as the stage holds them on CUDA (engine/adapter_stage.py; adapter,
                   norms and the tied embedding fp32) + bf16 autocast, fused AdamW
  ours_eager_decode  the same with the decode step launched op by op from Python (before 2026-12-03)
  ours_ckpt        ours with activation checkpointing (rl.activation_checkpointing: true), the memory setting TRL's
                   GRPOConfig defaults to
  ours_ckpt_chunks4  ours_ckpt with each rollout's 64 answers trained in 4 micro-batches of 16 (rl.train_chunks: 4,
                   gradients accumulated: the same update)
  trl              trl.GRPOTrainer as its docs set it up: base in bf16, PEFT LoRA (fp32 adapter), bf16=True, its
                   default gradient checkpointing on, transformers generate()
  trl_no_gc        the same with gradient_checkpointing=False (faster, more memory)
Timing: `--warmup` steps untimed, then `--steps` steps, each bounded by torch.cuda.synchronize (ours: around
train_step; TRL: a callback at on_step_end); samples/s = completions / step time; the rollout (sampling + scoring +
batch building) and the generate call alone are timed inside the step (synchronised), train = step − rollout.
Peak memory: torch.cuda.max_memory_allocated over the provider's whole run (reset before it).

    python -m bench.rl_gpu [--steps 8] [--warmup 3] [--providers ours,trl,...] [--out DIR] [--smoke]
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import write_result

SHAPES = {
    "qwen3_0.5b": dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=64, intermediate_size=3072),
    "smoke": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128),
}
PROVIDERS = ("ours", "trl", "trl_no_gc", "ours_eager_decode", "ours_ckpt", "ours_ckpt_chunks4")
PROMPTS_PER_STEP, GROUP, LORA_R, LORA_ALPHA, LR = 8, 8, 16, 32, 1e-5


def even_share(text: str) -> float:
    """The reward on both sides: the share of the answer's tokens ("t<id>" words) whose id is even."""
    words = text.split()
    return sum(1 for w in words if w[1:].isdigit() and int(w[1:]) % 2 == 0) / max(len(words), 1)


def even_share_reward(completion: str, **_) -> float:
    """even_share as the RL stage calls a reward (`rl.rewards: ["bench.rl_gpu:even_share_reward"]`)."""
    return even_share(completion)


def build_model_dir(shape: str, max_len: int, root: Path) -> Path:
    """transformers' Qwen3ForCausalLM at random init (seed 0), saved as a HF checkpoint in bf16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    s = SHAPES[shape]
    V = s["vocab_size"]
    cfg = Qwen3Config(**s, max_position_embeddings=max_len, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, use_sliding_window=False,
                      attention_bias=False, hidden_act="silu", bos_token_id=None, eos_token_id=V - 1,
                      pad_token_id=V - 1, dtype="bfloat16")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    out = root / f"hf_{shape}"
    model.save_pretrained(out, safe_serialization=True)
    return out


def word_tokenizer(vocab_size: int):
    """One word per id ("t0" … "t{V-2}", eos = pad = id V-1): text made of these words tokenises to exactly those ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(vocab_size - 1)}
    vocab["<eos>"] = vocab_size - 1
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>")


def prompt_ids(n: int, length: int, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return rng.integers(0, vocab_size - 1, (n, length)).tolist()


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def summarise(step_s: list[float], rollout_s: list[float], generate_s: list[float], completions: int) -> dict:
    st, ro, ge = (np.array(x) for x in (step_s, rollout_s, generate_s))
    return {"samples_per_s": completions * len(st) / st.sum(), "samples_per_s_p50": completions / float(np.median(st)),
            "step_s_p20": float(np.percentile(st, 20)), "step_s_p50": float(np.median(st)),
            "step_s_p80": float(np.percentile(st, 80)), "step_s_mean": float(st.mean()),
            "rollout_s_mean": float(ro.mean()), "generate_s_mean": float(ge.mean()),
            "train_s_mean": float((st - ro).mean()), "rollout_share": float(ro.sum() / st.sum()),
            "steps_measured": len(st), "step_s": [round(float(x), 4) for x in st]}


# ------------------------------------------------------------------------------------------------ ours
def ours(model_dir: Path, prompts: list[list[int]], tok, args, device, graphs: bool = True, ckpt: bool = False,
         chunks: int = 1) -> dict:
    from glm_lora.configs.load import load_config
    from glm_lora.kernels import ops as kernels
    from glm_lora.configs.schema import LoRAConfig, RLConfig
    from glm_lora.engine import rollouts as rollouts_mod
    from glm_lora.evaluation import decode
    from glm_lora.engine.losses import GRPOLoss
    from glm_lora.engine.optim import build_optimizer
    from glm_lora.engine.trainer import Runtime, train_step
    from glm_lora.model.hf import load_hf
    from glm_lora.model.lora import cast_frozen_gemm_weights, inject_lora

    smoke = device.type != "cuda"
    rt = Runtime(device, torch.float32 if smoke else torch.bfloat16)
    tc = RLConfig(batch_size=PROMPTS_PER_STEP, group_size=GROUP, max_new_tokens=args.completion, temperature=1.0,
                  seq_len=args.prompt + args.completion, lr=LR, warmup_steps=0, min_lr_ratio=1.0, grad_clip=1.0,
                  max_steps=10_000, lora=LoRAConfig(r=LORA_R, alpha=LORA_ALPHA, target_modules="all-linear"),
                  train_chunks=chunks, rewards=["bench.rl_gpu:even_share_reward"])
    tc = tc.model_copy(update={"grad_accum": chunks})   # as engine/fit.py sets it: each rollout arrives in `chunks` parts
    torch.manual_seed(0)
    t_load = time.perf_counter()
    model = load_hf(model_dir)
    inject_lora(model, tc.lora)
    if rt.weights_in_compute_dtype:
        cast_frozen_gemm_weights(model, rt.dtype)
    model.to(device).train()
    model.gradient_checkpointing = ckpt         # what engine/fit.py sets from rl.activation_checkpointing
    load_s = time.perf_counter() - t_load
    opt = build_optimizer(model, tc.lr, tc.weight_decay, fused=True)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    trainable = [p for p in model.parameters() if p.requires_grad]

    # Rollouts through its constructor, as the stage builds it, with the bench's prompts instead of an SFT split and
    # no stop token (every answer exactly max_new_tokens long)
    rows = [{"prompt": [{"role": "user", "content": f"prompt {k}"}], "reference": "", "task": "bench", "ids": p}
            for k, p in enumerate(prompts)]
    ro = rollouts_mod.Rollouts(load_config("tiny").model_copy(update={"rl": tc}), tok, None, model, rt,
                               rows=rows, stop=[])
    make, _ = ro.batches("rl", tc)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rollout_s, generate_s, lengths = [], [], []
    real_sample = decode.sample_decode

    def timed_sample(*a, **k):
        sync()
        t = time.perf_counter()
        out = real_sample(*a, **{**k, "cuda_graph": k["cuda_graph"] and graphs})
        sync()
        generate_s.append(time.perf_counter() - t)
        return out

    def timed_batches(stream):
        for part in itertools.count():          # a rollout arrives in `chunks` parts: its time is theirs together
            sync()
            t = time.perf_counter()
            b = next(stream)
            sync()
            if part % chunks == 0:
                rollout_s.append(time.perf_counter() - t)
                lengths.append(float(b["rollout_completion_length"]))
            else:
                rollout_s[-1] += time.perf_counter() - t
            yield b

    loss = GRPOLoss.of(tc)
    step_s = []
    decode.sample_decode = timed_sample
    try:
        with kernels.using("reference" if smoke else "triton", "sdpa" if smoke else "flex"):
            batches = timed_batches(make(None))
            for i in range(args.warmup + args.steps):
                sync()
                t = time.perf_counter()
                r = train_step(model, loss, batches, opt, scaler, trainable, tc, rt, i)
                sync()
                step_s.append(time.perf_counter() - t)
                if r is None:
                    raise RuntimeError("non-finite loss")
    finally:
        decode.sample_decode = real_sample
    w = args.warmup
    out = summarise(step_s[w:], rollout_s[w:], generate_s[w:], PROMPTS_PER_STEP * GROUP)
    out.update(warmup_step_s=[round(x, 3) for x in step_s[:w]], load_s=load_s,
               completion_length_min=min(lengths), completion_length_max=max(lengths),
               trainable_params=sum(p.numel() for p in trainable),
               peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
               peak_reserved_gb=torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None)
    del model, opt, trainable, ro, batches
    return out


# ------------------------------------------------------------------------------------------------ TRL
def trl(model_dir: Path, prompts: list[list[int]], tok, args, device, gc_on: bool, work: Path) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    smoke = device.type != "cuda"
    texts = [" ".join(f"t{i}" for i in p) for p in prompts]
    wanted = {tuple(p) for p in prompts}
    data = Dataset.from_dict({"prompt": texts})

    def even_share_reward(prompts, completions, **_):
        return [even_share(c) for c in completions]

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    marks, rollout_s, generate_s, lengths, checks = [], [], [], [], {"prompt_ids_match": True, "prompt_lengths": set()}

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if not marks:
                sync()
                marks.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            sync()
            marks.append(time.perf_counter())

    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32 if smoke else torch.bfloat16)
    n = args.warmup + args.steps
    cfg = GRPOConfig(
        output_dir=str(work / "trl_out"), per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
        gradient_accumulation_steps=1, num_generations=GROUP, max_completion_length=args.completion,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, epsilon=0.2, loss_type="grpo",
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
        bf16=not smoke, gradient_checkpointing=gc_on, max_steps=n, logging_steps=10_000, save_strategy="no",
        report_to="none", seed=0, disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
        generation_kwargs={"min_new_tokens": args.completion}, use_cpu=smoke)
    peft_cfg = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules="all-linear", lora_dropout=0.0,
                          task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=even_share_reward, args=cfg, train_dataset=data,
                          processing_class=tok, peft_config=peft_cfg, callbacks=[Clock()])
    load_s = time.perf_counter() - t_load
    real_gen, real_roll = trainer._generate_single_turn, trainer._generate_and_score_completions

    def timed_gen(prompt_ids, *a, **k):
        for p in prompt_ids:
            checks["prompt_lengths"].add(len(p))
            checks["prompt_ids_match"] &= tuple(p) in wanted
        sync()
        t = time.perf_counter()
        out = real_gen(prompt_ids, *a, **k)
        sync()
        generate_s.append(time.perf_counter() - t)
        return out

    def timed_roll(*a, **k):
        sync()
        t = time.perf_counter()
        out = real_roll(*a, **k)
        sync()
        rollout_s.append(time.perf_counter() - t)
        lens = out["completion_mask"].sum(1)
        lengths.extend([int(lens.min()), int(lens.max())])
        return out

    trainer._generate_single_turn, trainer._generate_and_score_completions = timed_gen, timed_roll
    trainer.train()
    step_s = list(np.diff(marks))
    w = args.warmup
    out = summarise(step_s[w:], rollout_s[w:], generate_s[w:], PROMPTS_PER_STEP * GROUP)
    out.update(warmup_step_s=[round(float(x), 3) for x in step_s[:w]], load_s=load_s,
               completion_length_min=min(lengths), completion_length_max=max(lengths),
               prompt_ids_match=checks["prompt_ids_match"], prompt_lengths=sorted(checks["prompt_lengths"]),
               trainable_params=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
               gradient_checkpointing=gc_on,
               peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
               peak_reserved_gb=torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None)
    del trainer, model
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3_0.5b", choices=list(SHAPES))
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--completion", type=int, default=128, help="new tokens per answer (forced, both sides)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--providers", default="ours,trl,trl_no_gc,ours_ckpt,ours_eager_decode")
    ap.add_argument("--deadline-s", type=float, default=0, help="skip providers not started by then (0: none)")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, fp32, to check the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.prompt, args.completion, args.steps, args.warmup = "smoke", 16, 8, 2, 1
        torch.set_num_threads(1)
    device = torch.device("cpu" if args.smoke else "cuda")
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp())
    model_dir = build_model_dir(args.shape, 2 * (args.prompt + args.completion), work)
    V = SHAPES[args.shape]["vocab_size"]
    tok = word_tokenizer(V)
    prompts = prompt_ids(512, args.prompt, V)
    assert tok(" ".join(f"t{i}" for i in prompts[0]))["input_ids"] == prompts[0], "word tokenizer round trip"
    results: dict = {}
    figures = {"shape": {args.shape: SHAPES[args.shape]}, "prompt_tokens": args.prompt,
               "completion_tokens": args.completion, "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP,
               "completions_per_step": PROMPTS_PER_STEP * GROUP, "lora": f"r{LORA_R} alpha{LORA_ALPHA} all linear",
               "warmup_steps": args.warmup, "steps": args.steps, "results": results}
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    for p in [p for p in args.providers.split(",") if p]:
        if p not in PROVIDERS:
            raise SystemExit(f"unknown provider {p}; choose from {PROVIDERS}")
        if args.deadline_s and time.perf_counter() - t0 > args.deadline_s:
            results[p] = {"skipped": "deadline"}
            continue
        t = time.perf_counter()
        if device.type == "cuda":
            free()
        try:
            if p.startswith("ours"):
                results[p] = ours(model_dir, prompts, tok, args, device, graphs=p != "ours_eager_decode",
                                  ckpt=p.startswith("ours_ckpt"), chunks=4 if p.endswith("_chunks4") else 1)
            else:
                results[p] = trl(model_dir, prompts, tok, args, device, gc_on=p == "trl", work=work)
        except Exception as e:          # one provider failing must not lose the others' figures
            import traceback
            traceback.print_exc()
            results[p] = {"error": f"{type(e).__name__}: {e}"[:800]}
        if device.type == "cuda":
            free()
        results[p]["provider_wall_s"] = round(time.perf_counter() - t, 1)
        r = results[p]
        print(f"[{time.perf_counter() - t0:5.0f}s] {p:15s} " + (
            f"{r['samples_per_s']:7.1f} samples/s  step p20/50/80 {r['step_s_p20']:.3f}/{r['step_s_p50']:.3f}/"
            f"{r['step_s_p80']:.3f} s  rollout {r['rollout_s_mean']:.3f} s (generate {r['generate_s_mean']:.3f}) "
            f"train {r['train_s_mean']:.3f} s  peak {r['peak_mem_gb'] or 0:.1f} GB  lengths "
            f"{r['completion_length_min']}-{r['completion_length_max']}  {r['provider_wall_s']}s"
            if "samples_per_s" in r else str(r.get("error") or r.get("skipped"))), flush=True)
        if out:
            (out / "rl_gpu_partial.json").write_text(json.dumps(figures, indent=1, default=str) + "\n")
    cmp = {}
    for o in ("ours", "ours_eager_decode", "ours_ckpt", "ours_ckpt_chunks4"):
        for t in ("trl", "trl_no_gc"):
            a, b = results.get(o, {}), results.get(t, {})
            if "samples_per_s" in a and "samples_per_s" in b:
                c = {"samples_per_s": a["samples_per_s"] / b["samples_per_s"],
                     "samples_per_s_p50": a["samples_per_s_p50"] / b["samples_per_s_p50"],
                     "generate_time": a["generate_s_mean"] / b["generate_s_mean"],
                     "train_time": a["train_s_mean"] / b["train_s_mean"]}
                if a.get("peak_mem_gb") and b.get("peak_mem_gb"):
                    c["peak_mem"] = a["peak_mem_gb"] / b["peak_mem_gb"]
                    c["target_met"] = bool(c["samples_per_s"] >= 2 and c["peak_mem"] <= 0.7)
                cmp[f"{o}_vs_{t}"] = c
    figures["compare"] = cmp
    print("compare:", json.dumps(cmp, indent=1))
    path = write_result("rl_gpu" + ("_smoke" if args.smoke else ""), figures)
    print("->", path)
    if out:
        shutil.copy(path, out / path.name)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
