"""Where the 125M pretraining step's time goes (bench.e2e_pretrain_gpu's ours_fused step: 8 × 2048 random tokens,
every weight trained, bf16 autocast, fused AdamW): GPU busy time vs wall time per step (launch-bound or not), the
top kernels, and time by kind.

    PYTHONPATH=. python bench/probe/pretrain_probe.py [--size 125m] [--rows 8] [--compile] [--sdpa cudnn]
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.e2e_pretrain_gpu import PEAK_FLOPS, flops_per_token, random_batches, sdpa_backend
from bench.peer_gpu import KINDS
from bench.workloads import decoder_config, our_model, train_step
from glm_lora.kernels import ops as kernels
from glm_lora.model.heads import causal_lm_loss
from glm_lora.engine.optim import build_optimizer

ap = argparse.ArgumentParser()
ap.add_argument("--size", default="125m")
ap.add_argument("--compile", action="store_true", help="torch.compile(model.hidden_states), as ours_fused_compiled")
ap.add_argument("--cudagraphs", action="store_true", help="with --compile: mode reduce-overhead (CUDA graphs) unless --mode")
ap.add_argument("--inner-reference", action="store_true",
                help="with --compile: the blocks' ops as the torch reference (inductor fuses them), the loss head fused")
ap.add_argument("--no-targets", action="store_true", help="batches without target_positions (the loss finds them: "
                                                          "a host sync per step)")
ap.add_argument("--rows", type=int, default=8, help="rows of 2048 tokens a step")
ap.add_argument("--sdpa", choices=["flash", "cudnn", "efficient"],
                help="SDPA's backend for the causal attention (torch.nn.attention.sdpa_kernel); default: torch's choice")
ap.add_argument("--bf16-weights", action="store_true",
                help="the matrices stored in bf16 (no per-step autocast casts), fp32 master copies: one torch.compile'd "
                     "update casts their gradients, runs torch's functional AdamW on the masters and copies them back")
ap.add_argument("--compile-blocks", action="store_true", help="torch.compile each decoder block on its own "
                "(nn.Module.compile; torchtitan's granularity) instead of model.hidden_states as one graph")
ap.add_argument("--mode", help="torch.compile's mode for --compile / --compile-blocks (e.g. max-autotune-no-cudagraphs)")
ap.add_argument("--rope-heads-last", action="store_true", help="the reference RoPE (what a compiled graph fuses) "
                "computed on (B, T, H, D), q/k's memory order, and handed back as (B, H, T, D) views")
ap.add_argument("--rope-halves", action="store_true", help="the reference RoPE written on the two halves of each head "
                "(x1·c − x2·s, x2·c + x1·s, stacked) instead of cat((−x2, x1)): no masked selects for inductor")
ap.add_argument("--top", type=int, default=25, help="kernels listed")
args = ap.parse_args()
if args.rope_halves:
    from glm_lora.kernels import reference

    def halves(q, k, cos, sin, interleaved=False):
        assert not interleaved and cos.shape[-1] == q.shape[-1]
        h = q.shape[-1] // 2
        c, s = cos[:, None, :, :h].to(q.dtype), sin[:, None, :, :h].to(q.dtype)       # the table is [f, f]

        def rope(x):
            x1, x2 = x.unflatten(-1, (2, h)).unbind(-2)
            return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-2).flatten(-2)
        return rope(q), rope(k)
    reference.apply_rope = halves
if args.rope_heads_last:
    from glm_lora.kernels import reference

    def heads_last(q, k, cos, sin, interleaved=False):
        c, s = cos[:, :, None].to(q.dtype), sin[:, :, None].to(q.dtype)                  # (B, T, 1, R)
        rotate, R = reference._rotate_pairs if interleaved else reference._rotate_half, c.shape[-1]

        def rope(x):
            x = x.transpose(1, 2)
            y = x * c + rotate(x) * s if R == x.shape[-1] else \
                torch.cat((x[..., :R] * c + rotate(x[..., :R]) * s, x[..., R:]), dim=-1)
            return y.transpose(1, 2)
        return rope(q), rope(k)
    reference.apply_rope = heads_last
dev = torch.device("cuda")
cfg = decoder_config(args.size, 32000, 2048)
model = our_model(cfg, dev)
per_token = flops_per_token(cfg, 2048)
if args.compile:
    compiled = torch.compile(model.hidden_states, mode=args.mode or ("reduce-overhead" if args.cudagraphs else None))

    def hidden_states(*a, **k):
        with kernels.using("reference" if args.inner_reference else "auto"):
            return compiled(*a, **k)
    model.hidden_states = hidden_states
if args.compile_blocks:
    for layer in model.model.layers:
        layer.compile(mode=args.mode)
if args.bf16_weights:
    from torch.optim.adam import adam
    low = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    masters = [p.detach().clone() for p in low]
    for p in low:
        p.data = p.data.to(torch.bfloat16)
    ids = {id(p) for p in low}
    rest = [p for p in model.parameters() if id(p) not in ids]
    opt = torch.optim.AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": 0.1},
                             {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), fused=True)
    exp_avgs = [torch.zeros_like(m) for m in masters]
    exp_avg_sqs = [torch.zeros_like(m) for m in masters]
    steps = [torch.zeros((), device=dev) for _ in masters]

    @torch.compile
    @torch.no_grad()
    def master_update(grads):
        adam(masters, [g.float() for g in grads], exp_avgs, exp_avg_sqs, [], steps, foreach=True, capturable=True,
             decoupled_weight_decay=True, amsgrad=False, beta1=0.9, beta2=0.95, lr=3e-4, weight_decay=0.1, eps=1e-8,
             maximize=False)
        torch._foreach_copy_(low, masters)

    def inner(b):
        with torch.autocast("cuda", torch.bfloat16):
            loss = causal_lm_loss(model, b)[0]
        loss.backward()
        opt.step()
        master_update([p.grad for p in low])
        opt.zero_grad(set_to_none=True)
        for p in low:
            p.grad = None
else:
    opt = build_optimizer(model, 3e-4, 0.1, fused=True)
    inner = train_step(lambda b: causal_lm_loss(model, b)[0], opt, dev)


def step(b):
    if args.cudagraphs or args.mode in ("reduce-overhead", "max-autotune"):      # these modes record CUDA graphs
        torch.compiler.cudagraph_mark_step_begin()
    inner(b)


batches = [{k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
           for b in random_batches(12, args.rows, 2048, 32000)]
if args.no_targets:
    for b in batches:
        del b["target_positions"]
with kernels.using("auto"), sdpa_backend(args.sdpa):
    for b in batches[:6]:
        step(b)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in batches[6:9]:
        step(b)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in batches[9:12]:
            step(b)
        torch.cuda.synchronize()
events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
gpu = sum(e.device_time_total for e in events) / 3 / 1000
launches = sum(e.count for e in events) / 3
print(f"{args.size}{' compiled' if args.compile else ''}{' cudagraphs' if args.cudagraphs else ''}"
      f"{' inner reference' if args.inner_reference else ''}"
      f"{' blocks compiled one by one' if args.compile_blocks else ''}{' mode ' + args.mode if args.mode else ''}{' no target_positions' if args.no_targets else ''}{' bf16 weights compiled' if args.bf16_weights else ''} rows {args.rows} sdpa {args.sdpa or 'default'}: wall {wall * 1000:.1f} ms/step, GPU kernels {gpu:.1f} ms/step "
      f"({gpu / (wall * 1000):.0%} busy), {launches:.0f} kernels/step, "
      f"MFU {args.rows * 2048 / wall * per_token / PEAK_FLOPS:.3f}")
by_kind: dict = {}
for e in events:
    kind = next((k for k, keys in KINDS if any(s in e.key.lower() for s in keys)), "other")
    by_kind[kind] = by_kind.get(kind, 0) + e.device_time_total / 3 / 1000
print("by kind (ms/step):", {k: round(v, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])})
for e in sorted(events, key=lambda e: -e.device_time_total)[:args.top]:
    print(f"  {e.device_time_total / 3 / 1000:7.2f} ms  x{e.count // 3:4d}  {e.key[:110]}")
