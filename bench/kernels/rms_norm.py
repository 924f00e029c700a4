"""GPU micro-benchmark: Triton RMSNorm vs eager and torch.compile'd references, fwd+bwd.

Rows M = 16384 (8 × 2048 tokens), hidden 768 and 2048. bf16, plus fp32 because under bf16 autocast
the residual stream (and so the norms' input) stays fp32. "frozen_w" is the LoRA case: the norm
weight needs no gradient.

    python -m bench.kernels.rms_norm
"""
from __future__ import annotations

import torch
import triton.testing

from glm_lora.kernels import reference as ref
from glm_lora.kernels.triton_rms_norm import rms_norm

M, HIDDEN, EPS = 16384, (768, 2048), 1e-5


def measure(fn, inputs, cotangents) -> tuple[float, float]:
    """(median ms, peak MB above what was allocated before) of one forward + backward of fn(*inputs)."""
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        outs = fn(*inputs)
        torch.autograd.grad(outs if isinstance(outs, tuple) else (outs,), wrt, cotangents)

    for _ in range(3):                 # compiles (Triton JIT, torch.compile) before anything is measured
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    return triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median"), peak_mb


def compare(op: str, shape: str, dtype: torch.dtype, impls: dict, inputs, cotangents) -> list[dict]:
    """One row per implementation; ratio_vs_eager = ms / eager ms (below 1 is faster than eager)."""
    rows = []
    for impl, fn in impls.items():
        ms, peak_mb = measure(fn, inputs, cotangents)
        rows.append({"op": op, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "impl": impl,
                     "ms": round(ms, 4), "peak_mem_mb": round(peak_mb, 1)})
    eager_ms = next(r["ms"] for r in rows if r["impl"] == "eager")
    for r in rows:
        r["ratio_vs_eager"] = round(r["ms"] / eager_ms, 3)
    return rows


def bench(device: str = "cuda") -> list[dict]:
    rows = []
    gen = torch.Generator(device).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for C in HIDDEN:
            torch._dynamo.reset()      # fresh compile caches: the recompile limit counts per code object
            x = torch.randn(M, C, device=device, dtype=dtype, generator=gen).requires_grad_(True)
            w = (1 + 0.1 * torch.randn(C, device=device, dtype=dtype, generator=gen)).requires_grad_(True)
            w_frozen = w.detach()
            dy = torch.randn(M, C, device=device, dtype=dtype, generator=gen)
            norm = {"triton": lambda x, w: rms_norm(x, w, EPS), "eager": lambda x, w: ref.rms_norm(x, w, EPS),
                    "compiled": torch.compile(lambda x, w: ref.rms_norm(x, w, EPS), dynamic=False)}
            rows += compare("rms_norm", f"{M}x{C}", dtype, norm, (x, w), (dy,))
            rows += compare("rms_norm_frozen_w", f"{M}x{C}", dtype, norm, (x, w_frozen), (dy,))
    return rows


if __name__ == "__main__":
    from bench.common import write_result
    print("->", write_result("kernels_rms_norm", {"rows": bench()}))
