"""GPU micro-benchmark: fused linear + loss heads (Triton) vs the eager reference vs torch.compile(reference).

One forward + backward at N = 16384 tokens, vocab 32000, hidden 768 and 2048, bf16, with the lm_head
frozen (LoRA) and trainable. Each row: {op, shape, dtype, impl, ms, peak_mem_mb, ratio_vs_eager}, where
ms is the do_bench median, peak_mem_mb the peak allocated above the inputs during one step, and
ratio_vs_eager = ms / eager ms (< 1: faster than eager).

    python -m bench.kernels.linear_loss
"""
from __future__ import annotations

import torch
import triton

from glm_lora.kernels import reference, triton_linear_loss

N, V = 16384, 32000
HIDDEN = (768, 2048)
OPS = ("linear_cross_entropy", "linear_token_logprobs")


def _inputs(op: str, C: int, weight_grad: bool, device: str):
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (N,) if op == "linear_cross_entropy" else (8, N // 8)
    h = torch.randn(*shape, C, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (torch.randn(V, C, device=device, generator=gen) * 0.02).to(torch.bfloat16).requires_grad_(weight_grad)
    labels = torch.randint(0, V, shape, device=device, generator=gen)
    labels[torch.rand(shape, device=device, generator=gen) < 0.3] = -100
    # upstream gradient: 1/count for the summed loss, per-token weights for the log-probs
    g = (torch.tensor(1e-4, device=device) if op == "linear_cross_entropy"
         else torch.randn(shape, device=device, generator=gen))
    return h, w, labels, g


def _step(fn, h, w, labels, g):
    leaves = [t for t in (h, w) if t.requires_grad]

    def step():
        out = fn(h, w, labels)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out, leaves, g)
    return step


def _peak_mb(step) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench(device: str = "cuda") -> list[dict]:
    rows = []
    for op in OPS:
        ref = getattr(reference, op)
        impls = {"eager": ref, "compile": torch.compile(ref, dynamic=False), "triton": getattr(triton_linear_loss, op)}
        for C in HIDDEN:
            for weight_grad in (False, True):
                h, w, labels, g = _inputs(op, C, weight_grad, device)
                shape = f"{'x'.join(map(str, labels.shape))} tokens, C={C}, V={V}, " + ("dW" if weight_grad else "W frozen")
                eager_ms = None
                for impl, fn in impls.items():
                    step = _step(fn, h, w, labels, g)
                    step()                                  # warm-up: Triton JIT / inductor compile
                    peak = _peak_mb(step)
                    ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
                    if impl == "eager":
                        eager_ms = ms
                    rows.append({"op": op, "shape": shape, "dtype": "bf16", "impl": impl, "ms": ms,
                                 "peak_mem_mb": peak, "ratio_vs_eager": ms / eager_ms})
                del h, w, labels, g
                torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    from bench.common import write_result
    results = bench()
    for r in results:
        print(f"{r['op']:22s} {r['shape']:42s} {r['impl']:8s} {r['ms']:8.2f} ms  {r['peak_mem_mb']:8.0f} MB  "
              f"{r['ratio_vs_eager']:.2f}x eager")
    print("->", write_result("kernels_linear_loss", {"rows": results}))
