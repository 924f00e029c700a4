"""LoRA SFT and DPO steps: ours vs the strongest peer setup, in one process, 1B and 125M (GPU).

Providers per size, each over the same data (LoRA r64 α128 on all 7 projections, fp32 trainable weights,
bf16 autocast, fused AdamW):
  SFT  ours_flex          our Decoder, packed 8 × 2048 rows, kernels "auto", FlexAttention block mask; the
                          frozen base as a LoRA stage holds it (bf16 GEMM weights on CUDA, engine/adapter_stage.py)
       ours_sdpa          the same with the dense document mask + SDPA
       ours_varlen        the same with FlashAttention's varlen kernels, each document its own sequence
       ours_*_fp32base    the same with the frozen base in fp32 (cast by autocast at every use: before 2026-12-03)
       ours_*_nogroup     the same with q/k/v and gate/up each its own LoRA linear (before 2026-12-04), not
                          one stacked op per input (kernels.lora_linear_group; DPO's reference pass: stacked_linear)
       ours_*_unfusednorm the same with each residual add its own op and the norms written in fp32, cast by
                          autocast at each product (before 2026-12-04 pm; bench.workloads.norms_fused)
       ours_*_compiled    the same with model.hidden_states under torch.compile (as engine/compile.py compiles
                          it; inside it kernels "auto" takes the torch reference ops, fused by inductor)
       ours_*_graphed     the same compiled with mode "reduce-overhead": forward and backward replayed as CUDA
                          graphs (the step's launches from the host: one per graph instead of one per kernel)
       ours_*_cudagraph   the same with the blocks' training forward and backward replayed as CUDA graphs, our
                          kernels as they are (`cuda_graphs: true`, engine/cuda_graphs.py); DPO: the policy's
                          forward and backward, and the reference pass (no_grad) as a graph of its own; also
                          ours_*_shared_cudagraph
       hf_liger_packed    anchor (a), bench/anchors.py: HF + PEFT + Liger (RoPE, RMSNorm, SwiGLU, fused
                          linear CE), the same packed rows padding-free (position_ids, flex_attention), fp32 base
       hf_liger_packed_bf16base  the same with the base loaded in bf16 (as `torch_dtype=torch.bfloat16` loads
                          it: norms and embeddings too; PEFT keeps the adapter fp32)
       hf_peft_padded     anchor (b): HF + PEFT (SDPA), padded batches of N samples, N chosen so that
                          N × mean sample length ≈ the packed rows' real tokens per step; on OOM N/2, N/4
  DPO  ours_flex, ours_sdpa   engine.losses.PreferenceLoss (DPO) on packed rows (pairs kept in one row)
       ours_flex_simpo / _orpo  the same rows with dpo.loss simpo / orpo: no reference forward
       ours_*_shared      the same pairs packed with each prompt placed once (dpo.share_prompt, data/packing.py):
                          more pairs fit the 8 × 2048 rows, so DPO is compared in pairs/s (`pairs_per_s_vs_a`)
       hf_liger_packed    anchor (a): the same packed rows through HF + PEFT + Liger, LigerFusedLinearDPOLoss
                          on the answer positions, reference = adapter off
       hf_peft_naive      anchor (b): bench.e2e_dpo_gpu's naive DPO, N pairs per step (N = the packed
                          rows' pairs per step), padded rows; on OOM N/2, N/4
Timing: bench.workloads.WARMUP_RULE, then p20/p50/p80 of the step time, real tokens/s over the
measured steps, peak memory. With --profile, torch.profiler over 3 more steps of each provider named by
--profile-providers (ours_flex by default; ours and the Liger anchor, SFT and DPO): GPU kernel time against the
step's wall (a step the host cannot keep fed shows up as the gap), top kernels and time by kind, written beside the results.

With --attention-micro, attention alone (per layer fwd + bwd, and the mask build) flex vs dense at head_dim
64 and 128 and both widths, and what `auto` picks.

    python -m bench.peer_gpu [--sizes 1b,125m] [--steps 10] [--deadline-s 330] [--out DIR] [--profile]
                             [--attention-micro] [--smoke]
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from glm_lora.kernels import ops as kernels
from bench import anchors
from bench.common import write_result
from bench.e2e_dpo_gpu import BETA, naive_dpo_loss
from bench.workloads import (SIZES, TARGETS, WARMUP_RULE, RandomDPO, RandomSFT, autocast, decoder_config, free,
                             hf_model, hf_peft, our_model, parser, precision_note, result_name, scaled_lengths,
                             norms_fused, setup, siblings_stacked, timed_steps, train_step)
from glm_lora.data.packing import PackedBatches, padded_batches
from glm_lora.data.sampler import EpochSampler
from glm_lora.engine.losses import PreferenceLoss
from glm_lora.model.heads import causal_lm_loss
from glm_lora.engine.optim import build_optimizer
from glm_lora.engine.trainer import Runtime
from glm_lora.engine.cuda_graphs import graphed_training
from glm_lora.model import inject_lora
from glm_lora.model.lora import cast_frozen_gemm_weights
from glm_lora.configs.schema import LoRAConfig

SFT = ("ours_flex", "ours_sdpa", "ours_varlen", "ours_flex_fp32base", "ours_sdpa_fp32base", "ours_flex_nogroup", "ours_sdpa_nogroup",
       "ours_flex_unfusednorm", "ours_sdpa_unfusednorm", "ours_flex_compiled", "ours_sdpa_compiled", "ours_flex_graphed", "ours_sdpa_graphed", "ours_flex_cudagraph", "ours_sdpa_cudagraph", "hf_liger_packed", "hf_liger_packed_bf16base",
       "hf_peft_padded")
DPO = ("ours_flex", "hf_liger_packed", "hf_peft_naive", "ours_sdpa", "ours_varlen", "ours_flex_fp32base", "ours_sdpa_fp32base",
       "ours_flex_nogroup", "ours_sdpa_nogroup", "ours_flex_unfusednorm", "ours_sdpa_unfusednorm", "hf_liger_packed_bf16base",
       "ours_flex_simpo", "ours_flex_orpo", "ours_flex_shared", "ours_sdpa_shared", "ours_flex_cudagraph", "ours_sdpa_cudagraph",
       "ours_flex_shared_cudagraph", "ours_sdpa_shared_cudagraph")
T0 = time.perf_counter()


def packed_batches(src, n: int, seq_len: int, group_size: int = 1, share_prefix: bool = False) -> list[dict]:
    stream = PackedBatches(src, iter(EpochSampler(len(src) // group_size, seed=0)), rows=8, seq_len=seq_len,
                           group_size=group_size, share_prefix=share_prefix)
    return [next(stream) for _ in range(n)]


def ours(cfg, device, name: str = "ours"):
    """Our model with the adapter; the frozen base in the dtype a LoRA stage gives it, or fp32 (`*_fp32base`)."""
    model = our_model(cfg, device)
    inject_lora(model, LoRAConfig(target_modules=TARGETS, r=64, alpha=128))
    amp = autocast(device)
    if not name.endswith("_fp32base") and isinstance(amp, torch.autocast) and Runtime(
            device, amp.fast_dtype).weights_in_compute_dtype:
        cast_frozen_gemm_weights(model, amp.fast_dtype)
    return model


@contextlib.contextmanager
def our_kernels(name: str):
    """kernels "auto" with the provider's attention; `*_nogroup`: sibling projections each on its own;
    `*_unfusednorm`: residual adds and norms as before bench.workloads.norms_fused."""
    with siblings_stacked(not name.endswith("_nogroup")), norms_fused(not name.endswith("_unfusednorm")), \
            kernels.using("auto", name.split("_")[1]):
        yield


def flops_per_step(cfg, batches: list[dict], dpo: bool) -> float:
    """Model FLOPs of one LoRA step (mean over `batches`): frozen linears forward + input-gradient (4·N per
    token), LoRA forward + backward (6·r·(in+out) per projection and token), attention 2·n²·D·H per layer
    and document forward ×3, lm_head 2·C·V forward ×2 on labelled tokens (SFT) / all tokens (DPO).
    DPO adds the reference forward (a third of the policy's forward + backward of the frozen parts)."""
    h, L, i, H, D = cfg.hidden_size, cfg.num_layers, cfg.intermediate_size, cfg.num_heads, cfg.head_dim
    kv = cfg.num_kv_heads * D
    shapes = [(h, H * D), (h, kv), (h, kv), (H * D, h), (h, i), (h, i), (i, h)]
    n_lin = L * sum(a * b for a, b in shapes)
    n_lora = L * sum(64 * (a + b) for a, b in shapes)
    total = 0.0
    for b in batches:
        tokens = b["capacity"]
        docs = b["doc_ids"][b["doc_ids"] > 0]
        lens = torch.bincount(docs).double()
        attn_fwd = float((lens ** 2).sum()) * 2 * D * H * L
        head_rows = len(b["target_positions"]) if not dpo else tokens
        fwd = 2 * n_lin * tokens + attn_fwd + 2 * h * cfg.vocab_size * head_rows
        step = 2 * fwd + 6 * n_lora * tokens + attn_fwd     # + backward: dx of linears/head, 2× attention
        total += step + (fwd if dpo else 0.0)
    return total / len(batches)


KINDS = (("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_")),
         ("flex attention", ("flex", "tem_fused")), ("sdpa attention", ("fmha", "attention", "flash")),
         ("dtype casts / copies", ("copy",)), ("fp32 adds", ("add",)),
         ("triton fused ops", ("_kernel", "triton")), ("other elementwise/reduce", ("elementwise", "reduce", "vectorized")))


def profile(step, batches, device, path: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch_profile(activities=acts) as prof:
        for b in batches:
            step({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()})
        sync()
    wall = (time.perf_counter() - t0) / len(batches)
    rows, seen = [], set()
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        # kernels only: CPU-side rows (aten::*, autograd Functions, the compiled-kernel launch record, which
        # shares its kernel's name) carry the device time of what they launched and would count it twice
        if (not t or t <= 0 or e.key in seen or e.key.startswith(("aten::", "autograd::", "ProfilerStep"))
                or e.key.endswith(("Function", "FunctionBackward"))):
            continue
        seen.add(e.key)
        rows.append((e.key, t / 1000 / len(batches), e.count // len(batches)))
    rows.sort(key=lambda r: -r[1])
    gpu = sum(r[1] for r in rows)
    kinds: dict[str, float] = {}
    for key, ms, _ in rows:
        low = key.lower()
        kind = next((k for k, subs in KINDS if any(s in low for s in subs)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms
    lines = [f"profiled wall per step (profiler on): {1000 * wall:.1f} ms; GPU kernel time per step: {gpu:.1f} ms",
             "", "time by kind (ms/step): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])),
             "", f"{'ms/step':>8} {'calls':>6}  kernel"]
    lines += [f"{ms:8.2f} {n:6d}  {key[:150]}" for key, ms, n in rows[:40]]
    path.write_text("\n".join(lines) + "\n")
    return {"profiled_step_ms": 1000 * wall, "gpu_kernel_ms_per_step": gpu,
            "ms_per_step_by_kind": {k: round(v, 2) for k, v in kinds.items()},
            "top_kernels": [{"kernel": k[:150], "ms_per_step": round(ms, 3), "calls": n} for k, ms, n in rows[:15]]}


def sft(name, size, src, args, device, vocab, seq_len, out: Path | None) -> dict:
    cfg = decoder_config(size, vocab, seq_len)
    n_batches = args.max_warmup + args.steps
    packed = packed_batches(src, n_batches + 3, seq_len)
    if name == "hf_peft_padded":
        per_step = float(np.mean([b["num_tokens"] for b in packed]))
        n = max(8, round(per_step / float(src.lengths().mean())))
        return padded_with_retry(cfg, device, n, lambda k: _padded_sft(src, k, n_batches), args,
                                 lambda m: (lambda b: m(input_ids=b["input_ids"], attention_mask=(b["doc_ids"] != 0).long(),
                                                        labels=b["labels"], use_cache=False).loss), "samples")
    if name.startswith("hf_liger_packed"):
        with anchors.liger_llama():
            model = anchors.liger_peft(cfg, device, bf16_base=name.endswith("_bf16base"))
            check = anchors.check_packing(model, packed[0], device, autocast(device))
            if not check.get("ok"):
                anchors.HF_MASK["mode"] = "explicit"
                check = {"detect_from_position_ids": check,
                         "explicit_block_mask": anchors.check_packing(model, packed[0], device, autocast(device))}
            opt = build_optimizer(model, 2e-4, 0.0, fused=device.type == "cuda")
            step = train_step(anchors.liger_sft_loss(model), opt, device)
            res = timed_steps(step, packed[:n_batches], device, args.steps, max_warmup=args.max_warmup)
            if args.profile and name in args.profile_providers and out is not None:
                res["profile"] = profile(step, packed[n_batches:n_batches + 3], device,
                                         out / f"profile_sft_{size}_{name}.txt")
            return {**res, "packing_check": check, "hf_mask": anchors.HF_MASK["mode"]}
    model = ours(cfg, device, name)
    if name.endswith(("_compiled", "_graphed")):
        model.hidden_states = torch.compile(model.hidden_states, dynamic=False,
                                            mode="reduce-overhead" if name.endswith("_graphed") else None)
    opt = build_optimizer(model, 2e-4, 0.0, fused=device.type == "cuda")

    def loss_of(b):
        if name.endswith("_graphed"):   # a new step: the previous replay's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        return causal_lm_loss(model, b)[0]
    step = train_step(loss_of, opt, device)
    with our_kernels(name), graphed_training(model, name.endswith("_cudagraph"), device=device, name=name) as graphs:
        res = timed_steps(step, packed[:n_batches], device, args.steps, max_warmup=args.max_warmup)
        res["cuda_graphs"] = graphs
        res["model_tflops_per_step"] = flops_per_step(cfg, packed[:n_batches], dpo=False) / 1e12
        res["model_tflop_per_s"] = res["model_tflops_per_step"] / (res["step_ms_mean"] / 1000)
        if args.profile and name in args.profile_providers and out is not None:
            res["profile"] = profile(step, packed[n_batches:n_batches + 3], device, out / f"profile_sft_{size}_{name}.txt")
    return res


def _padded_sft(src, k, n_batches):
    stream = padded_batches(src, iter(EpochSampler(len(src), seed=0)), batch_size=k)
    return [next(stream) for _ in range(n_batches)]


def padded_with_retry(cfg, device, n, make_batches, args, make_loss, unit) -> dict:
    """Anchor (b): one model; N per step, then N/2, N/4 after a CUDA OOM (the OOMs are recorded)."""
    model = hf_peft(cfg, device, base=hf_model(cfg, device, use_cache=False))
    opt = build_optimizer(model, 2e-4 if unit == "samples" else 5e-6, 0.0, fused=device.type == "cuda")
    step = train_step(make_loss(model), opt, device)
    ooms = []
    for k in dict.fromkeys([n, max(1, n // 2), max(1, n // 4)]):
        failed = False
        try:
            # its step time follows each batch's padded width, so the 5% rule rarely holds: ≤ 4 warm-up steps
            res = timed_steps(step, make_batches(k), device, args.steps, max_warmup=min(4, args.max_warmup),
                              max_warmup_s=10.0, max_measure_s=args.max_measure_s)
            return {**res, f"{unit}_per_step": k, f"{unit}_wanted": n, "oom_at": ooms}
        except torch.OutOfMemoryError:
            failed = True
        if failed:        # outside the except block: its traceback (and tensors) are gone
            ooms.append(k)
            opt.zero_grad(set_to_none=True)
            free(device)
    return {"error": f"torch.OutOfMemoryError at {unit} per step {ooms}"}


def dpo(name, size, src, args, device, vocab, seq_len, out: Path | None) -> dict:
    cfg = decoder_config(size, vocab, seq_len)
    n_batches = args.max_warmup + args.steps
    packed = packed_batches(src, n_batches + 3, seq_len, group_size=2)
    pairs = float(np.mean([len(b["group_docs"]) for b in packed]))
    if name == "hf_peft_naive":
        def make(k):
            stream = padded_batches(src, iter(EpochSampler(len(src) // 2, seed=0)), batch_size=k, group_size=2)
            return [next(stream) for _ in range(n_batches)]
        return padded_with_retry(cfg, device, max(1, round(pairs)), make, args,
                                 lambda m: (lambda b: naive_dpo_loss(m, b)), "pairs")
    if name.startswith("hf_liger_packed"):
        with anchors.liger_llama():
            model = anchors.liger_peft(cfg, device, bf16_base=name.endswith("_bf16base"))
            opt = build_optimizer(model, 5e-6, 0.0, fused=device.type == "cuda")
            batches = [anchors.add_answer_index(b) for b in packed[:n_batches]]
            res = timed_steps(train_step(anchors.liger_dpo_loss(model, BETA), opt, device), batches, device,
                              args.steps, max_warmup=args.max_warmup)
            return {**res, **pair_rates(res, batches), "hf_mask": anchors.HF_MASK["mode"]}
    model = ours(cfg, device, name)
    opt = build_optimizer(model, 5e-6, 0.0, fused=device.type == "cuda")
    kind = name.rsplit("_", 1)[1] if name.endswith(("_simpo", "_orpo")) else "dpo"   # reference-free: one forward
    loss = PreferenceLoss(beta=BETA, nll_weight=0.0, kind=kind)
    step = train_step(lambda b: loss(model, b)[0], opt, device)
    if "_shared" in name:
        packed = packed_batches(src, n_batches + 3, seq_len, group_size=2, share_prefix=True)
    with our_kernels(name), graphed_training(model, name.endswith("_cudagraph"), device=device, name=name) as graphs:
        res = timed_steps(step, packed[:n_batches], device, args.steps, max_warmup=args.max_warmup)
        res["cuda_graphs"] = graphs
        res.update(pair_rates(res, packed[:n_batches]))
        res["model_tflops_per_step"] = flops_per_step(cfg, packed[:n_batches], dpo=True) / 1e12
        res["model_tflop_per_s"] = res["model_tflops_per_step"] / (res["step_ms_mean"] / 1000)
        if args.profile and name in args.profile_providers and out is not None:
            res["profile"] = profile(step, packed[n_batches:n_batches + 3], device, out / f"profile_dpo_{size}_{name}.txt")
    return res


def pair_rates(res: dict, batches: list[dict]) -> dict:
    """Pairs per step and per second over the steps `timed_steps` measured (those after its warm-up)."""
    measured = batches[res["warmup_steps"]:res["warmup_steps"] + res["steps"]]
    per_step = float(np.mean([len(b["group_docs"]) for b in measured]))
    return {"pairs_per_step": per_step, "pairs_per_s": per_step / (res["step_ms_mean"] / 1000),
            "p50_step_pairs_per_s": per_step / (res["step_ms_p50"] / 1000)}


MICRO_SHAPES = ((12, 12, 64), (16, 8, 128), (6, 6, 128), (32, 8, 64))   # (heads, kv heads, head_dim): 125M, 1B,
                                                                      # then 768 wide at 128 and 2048 wide at 64


def attention_micro(doc_ids: torch.Tensor, device, deadline) -> dict:
    """Attention alone, per layer forward + backward (median of triton.testing.do_bench), and the mask
    build once per forward, flex vs the dense mask, on one packed batch's document ids; and which
    form `auto` (kernels.flex_pays) takes for each head size, with its output against the dense path."""
    from triton.testing import do_bench
    doc_ids = doc_ids.to(device)
    B, T = doc_ids.shape
    out = {}
    for H, Hkv, D in MICRO_SHAPES:
        if deadline():
            out[f"H{H}/{Hkv} D{D}"] = {"skipped": "deadline"}
            continue
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
        k, v = (torch.randn(B, Hkv, T, D, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
                for _ in range(2))
        grad = torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16, generator=g)
        real = (doc_ids > 0)[:, None, :, None]
        row, outs = {}, {}
        for kind in ("flex", "sdpa", "varlen", "auto"):
            with kernels.using("auto", kind):
                mask = kernels.document_causal_mask(doc_ids)
                o = kernels.attention(q, k, v, mask)
                outs[kind] = o.detach()
                if kind == "auto":
                    row["auto_picks"] = "flex" if not isinstance(mask.resolve(q), torch.Tensor) else "sdpa"
                    continue

                def fwd_bwd():
                    q.grad = k.grad = v.grad = None
                    kernels.attention(q, k, v, mask).backward(grad)
                row[f"{kind}_fwd_bwd_ms"] = do_bench(fwd_bwd, warmup=25, rep=100, return_mode="median")
                row[f"{kind}_mask_ms"] = do_bench(lambda: kernels.document_causal_mask(doc_ids), warmup=10, rep=50,
                                                  return_mode="median")
        row["flex_vs_sdpa_time"] = row["flex_fwd_bwd_ms"] / row["sdpa_fwd_bwd_ms"]
        row["varlen_vs_flex_time"] = row["varlen_fwd_bwd_ms"] / row["flex_fwd_bwd_ms"]
        row["varlen_max_abs_diff_vs_sdpa"] = float(((outs["varlen"] - outs["sdpa"]) * real).abs().max())
        row["auto_max_abs_diff_vs_sdpa"] = float(((outs["auto"] - outs["sdpa"]) * real).abs().max())
        out[f"H{H}/{Hkv} D{D}"] = row
        print(f"  attention H{H}/{Hkv} D{D}: {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})}",
              flush=True)
    return out


def compare(rows: dict) -> dict:
    """Ours (the faster of flex / sdpa, and each) vs the anchors, with the issue's targets."""
    best = max((p for p in ("ours_flex", "ours_sdpa", "ours_varlen") if "real_tokens_per_s" in rows.get(p, {})),
               key=lambda p: rows[p]["real_tokens_per_s"], default=None)
    if best is None:
        return {}
    out = {"ours_best": best}
    o = rows[best]
    for anchor, key in (("hf_liger_packed", "a"), ("hf_liger_packed_bf16base", "a_bf16base"), ("hf_peft_padded", "b"),
                        ("hf_peft_naive", "b"), (f"{best}_fp32base", "ours_fp32base")):
        r = rows.get(anchor, {})
        if "real_tokens_per_s" not in r:
            continue
        out[f"tokens_per_s_vs_{key}"] = o["real_tokens_per_s"] / r["real_tokens_per_s"]
        out[f"p50_step_tokens_per_s_vs_{key}"] = ((o["real_tokens_per_step"] / o["step_ms_p50"]) /
                                                  (r["real_tokens_per_step"] / r["step_ms_p50"]))
        if o.get("peak_mem_gb") and r.get("peak_mem_gb"):
            out[f"peak_mem_vs_{key}"] = o["peak_mem_gb"] / r["peak_mem_gb"]
    for key in ("a", "a_bf16base"):
        if f"tokens_per_s_vs_{key}" in out:
            out[f"target_{key}_met"] = out[f"tokens_per_s_vs_{key}"] >= 1.6 and out.get(f"peak_mem_vs_{key}", 9) <= 0.8
    if "tokens_per_s_vs_b" in out:
        out["target_b_met"] = out["tokens_per_s_vs_b"] >= 8
    a = rows.get("hf_liger_packed", {})
    for p in ("ours_flex", "ours_sdpa", "ours_varlen", "ours_flex_shared", "ours_sdpa_shared"):    # DPO: the same pairs, per second
        if "pairs_per_s" in rows.get(p, {}) and "pairs_per_s" in a:
            out[f"{p}_pairs_per_s_vs_a"] = rows[p]["pairs_per_s"] / a["pairs_per_s"]
            out[f"{p}_p50_step_pairs_per_s_vs_a"] = rows[p]["p50_step_pairs_per_s"] / a["p50_step_pairs_per_s"]
    if "real_tokens_per_s" in rows.get("ours_sdpa", {}) and "real_tokens_per_s" in rows.get("ours_flex", {}):
        out["flex_vs_sdpa_tokens_per_s"] = rows["ours_flex"]["real_tokens_per_s"] / rows["ours_sdpa"]["real_tokens_per_s"]
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.set_defaults(sizes="1b,125m")
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--max-warmup", type=int, default=8)
    ap.add_argument("--max-measure-s", type=float, default=8.0, help="anchor (b): stop measuring after this (min 4 steps)")
    ap.add_argument("--deadline-s", type=float, default=0, help="skip providers not started by then (0: none)")
    ap.add_argument("--workloads", default="sft,dpo")
    ap.add_argument("--out", default="", help="also copy the results (and a partial file after each provider) here")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-providers", default="ours_flex", help="with --profile: which providers (comma-separated)")
    ap.add_argument("--attention-micro", action="store_true", help="attention-only flex vs dense timings at the end")
    args = ap.parse_args()
    args.steps = args.steps if not args.smoke else 2
    args.profile_providers = args.profile_providers.split(",")
    sizes, device, vocab, seq_len = setup(args)
    if args.smoke:
        args.steps, args.max_warmup, args.max_measure_s = 2, 2, None
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    srcs = {"sft": RandomSFT(scaled_lengths(args.samples, seq_len), vocab), "dpo": RandomDPO(args.pairs, vocab, seq_len)}
    results: dict = {"sft": {}, "dpo": {}}
    figures = {"workload": {"sft": "LoRA SFT r64 a128 on 7 projections, skewed lengths, answer-only labels (last 30%)",
                            "dpo": f"LoRA r64 a128 DPO beta {BETA}, prompt skewed mix capped, answers 16-256"},
               "precision": precision_note() if device.type == "cuda" else "fp32 (smoke, CPU)",
               "warmup_rule": WARMUP_RULE, "steps": args.steps, "seq_len": seq_len, "vocab": vocab,
               "shapes": {s: SIZES[s] for s in sizes},
               "tree": os.environ.get("GLM_LORA_TREE", ""), "results": results}

    def save_partial():
        if out:
            (out / "peer_gpu_partial.json").write_text(json.dumps(figures, indent=1, default=str) + "\n")

    for size in sizes:
        anchors.HF_MASK["mode"] = "detect"       # the SFT anchor's packing check may switch it for this size
        for wl in args.workloads.split(","):
            fn, provs = (sft, SFT) if wl == "sft" else (dpo, DPO)
            rows = results[wl].setdefault(size, {})
            wanted = [p for p in args.providers.split(",") if p]
            if set(wanted) - set(SFT) - set(DPO):
                raise SystemExit(f"unknown providers {sorted(set(wanted) - set(SFT) - set(DPO))}")
            for p in [p for p in provs if not wanted or p in wanted]:
                if args.deadline_s and time.perf_counter() - T0 > args.deadline_s:
                    rows[p] = {"skipped": "deadline"}
                    continue
                t = time.perf_counter()
                free(device)
                try:
                    rows[p] = fn(p, size, srcs[wl], args, device, vocab, seq_len, out)
                except torch.OutOfMemoryError:
                    rows[p] = {"error": "torch.OutOfMemoryError"}
                except Exception as e:      # one provider failing must not lose the others' figures
                    import traceback
                    traceback.print_exc()
                    rows[p] = {"error": f"{type(e).__name__}: {e}"[:800]}
                free(device)
                rows[p]["provider_wall_s"] = round(time.perf_counter() - t, 1)
                r = rows[p]
                print(f"[{time.perf_counter() - T0:6.0f}s] {wl} {size} {p:16s} " +
                      (f"{r['real_tokens_per_s']:>9,.0f} tok/s  p20/50/80 {r['step_ms_p20']:.1f}/{r['step_ms_p50']:.1f}/"
                       f"{r['step_ms_p80']:.1f} ms  peak {r['peak_mem_gb'] or 0:.1f} GB  warm-up {r['warmup_steps']}"
                       f"{'' if r['warmup_stable'] else ' (not stable)'}  {r['provider_wall_s']}s"
                       if "real_tokens_per_s" in r else str(r.get("error") or r.get("skipped"))), flush=True)
                save_partial()
            rows["_compare"] = compare(rows)
            print(f"  {wl} {size} compare: {json.dumps(rows['_compare'])}", flush=True)
            save_partial()
    if args.attention_micro:
        if device.type == "cuda":
            free(device)
            doc_ids = packed_batches(srcs["sft"], 1, seq_len)[0]["doc_ids"]
            try:
                figures["attention_micro"] = attention_micro(
                    doc_ids, device, lambda: args.deadline_s and time.perf_counter() - T0 > args.deadline_s + 30)
            except Exception as e:
                figures["attention_micro"] = {"error": f"{type(e).__name__}: {e}"[:800]}
            save_partial()
        else:
            figures["attention_micro"] = {"skipped": "needs CUDA (FlexAttention backward)"}
    path = write_result(result_name("peer_gpu", args), figures)
    print("->", path)
    if out:
        shutil.copy(path, out / path.name)


if __name__ == "__main__":
    main()
