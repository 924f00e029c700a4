"""LoRA SFT step throughput, packed vs padded, same run, same model (GPU).

125M Llama-shaped config (h768, L12, 12 heads, vocab 32000), LoRA r64 α128 on all 7 projections,
bf16 autocast, skewed lengths (80% 16–511, 15% 512–1536, 5% 1537–2048), answer-only labels
(last 30% of each sample). Providers, each with the same samples in the same order:
  padded   batches of 8, padded to the longest, SDPA causal (flash)
  packed         8 × 2048 token rows, FlexAttention document mask (kernels "flex")
  packed_dense   the same packed rows through SDPA with a dense bool mask (kernels "auto")
Real tokens/s counts non-padding tokens only. --smoke: h64 L2, vocab 1000, 128-token rows, 1 + 2 steps, fp32
on the CPU (no autocast, no peak memory) to check the script runs.

    python -m bench.sft_packing_gpu [--steps 20] [--hidden 768 --layers 12 ...] [--smoke]
"""
from __future__ import annotations

import argparse
import time

import torch

from glm_lora.kernels import ops as kernels
from bench.common import write_result
from bench.workloads import SIZES, TARGETS, RandomSFT, autocast, scaled_lengths, to_device
from glm_lora.data.packing import PackedBatches, padded_batches
from glm_lora.data.sampler import EpochSampler
from glm_lora.model.heads import causal_lm_loss
from glm_lora.engine.optim import build_optimizer
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from glm_lora.configs.schema import LoRAConfig


def run(provider: str, args, src, device: torch.device) -> dict:
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    cfg = DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                        num_kv_heads=args.kv_heads, intermediate_size=args.inter, max_seq_len=args.seq_len)
    model = Decoder(cfg).to(device)
    inject_lora(model, LoRAConfig(target_modules=TARGETS, r=64, alpha=128))
    opt = build_optimizer(model, 2e-4, 0.0, fused=cuda)
    order = iter(EpochSampler(len(src), seed=0))
    if provider == "padded":
        batches = padded_batches(src, order, batch_size=8)
    else:
        batches = PackedBatches(src, order, rows=8, seq_len=args.seq_len)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step():
        b = to_device(next(batches), device)
        with autocast(device):                    # bf16 on CUDA; none (fp32) on the CPU
            loss, _ = causal_lm_loss(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return int(b["num_tokens"]), int(b["capacity"])
    for _ in range(args.warmup):
        step()
    sync()
    real = slots = 0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        r, c = step()
        real, slots = real + r, slots + c
    sync()
    dt = time.perf_counter() - t0
    out = {"real_tokens_per_s": real / dt, "token_efficiency": real / slots, "step_ms": 1000 * dt / args.steps,
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "steps": args.steps}
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=12)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=2048, help="packed row length (and the longest sample)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, fp32, 1 + 2 steps")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        torch.set_num_threads(1)        # the CPU smoke machine is shared: 2 threads contend and run slower
        smoke = SIZES["smoke"]
        args.hidden, args.layers, args.heads = smoke["hidden_size"], smoke["num_layers"], smoke["num_heads"]
        args.kv_heads, args.inter = smoke["num_kv_heads"], smoke["intermediate_size"]
        args.vocab, args.seq_len, args.samples, args.steps, args.warmup = 1000, 128, 200, 2, 1
    src = RandomSFT(scaled_lengths(args.samples, args.seq_len), args.vocab)
    results = {}
    for p in ("padded", "packed", "packed_dense"):
        with kernels.using("auto", "sdpa" if p == "packed_dense" else "flex"):
            results[p] = run(p, args, src, device)
    for p, r in results.items():
        print(f"{p:13s} {r['real_tokens_per_s']:>10.0f} real tok/s  eff {r['token_efficiency']:.3f}  "
              f"{r['step_ms']:.1f} ms/step  peak {r['peak_mem_gb'] or 0:.1f} GB")
    figures = {"config": vars(args), "results": results,
               "speedup_packed_vs_padded": results["packed"]["real_tokens_per_s"] / results["padded"]["real_tokens_per_s"],
               "speedup_flex_vs_dense_mask": results["packed"]["real_tokens_per_s"] / results["packed_dense"]["real_tokens_per_s"]}
    print(f"packed/padded {figures['speedup_packed_vs_padded']:.2f}x; flex/dense-mask {figures['speedup_flex_vs_dense_mask']:.2f}x")
    print("->", write_result("sft_packing_gpu" + ("_smoke" if args.smoke else ""), figures))


if __name__ == "__main__":
    main()
