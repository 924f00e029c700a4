"""GPU micro-benchmark: fused linear + loss heads (Triton) vs the eager reference vs torch.compile(reference).

One forward + backward at N = 16384 tokens, vocab 32000, hidden 768 and 2048, bf16, with the lm_head
frozen (LoRA) and trainable. Each row: {op, shape, dtype, impl, ms, peak_mem_mb, ratio_vs_eager}, where
ms is the do_bench median, peak_mem_mb the peak allocated above the inputs during one step, and
ratio_vs_eager = ms / eager ms (< 1: faster than eager). --smoke: N = 64, vocab 300, hidden 64, fp32 on the CPU
(bench/kernels/timing.py).

    python -m bench.kernels.linear_loss [--smoke]
"""
from __future__ import annotations

import torch
import triton.testing

from bench.kernels.timing import SKIP_COMPILED, device_from_cli, dtype_for, ratio, skipped, write
from glm_lora.kernels import reference, triton_linear_loss

N, V, HIDDEN = 16384, 32000, (768, 2048)
SMOKE_N, SMOKE_V, SMOKE_HIDDEN = 64, 300, (64,)
OPS = ("linear_cross_entropy", "linear_token_logprobs")


def _inputs(op: str, n: int, v: int, C: int, weight_grad: bool, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = dtype_for(device)
    shape = (n,) if op == "linear_cross_entropy" else (8, n // 8)
    h = torch.randn(*shape, C, device=device, dtype=dtype, generator=gen).requires_grad_()
    w = (torch.randn(v, C, device=device, generator=gen) * 0.02).to(dtype).requires_grad_(weight_grad)
    labels = torch.randint(0, v, shape, device=device, generator=gen)
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


def bench(device: torch.device) -> list[dict]:
    cuda = device.type == "cuda"
    n, v, hidden = (N, V, HIDDEN) if cuda else (SMOKE_N, SMOKE_V, SMOKE_HIDDEN)
    rows = []
    for op in OPS:
        ref = getattr(reference, op)
        impls = {"eager": ref, "compile": torch.compile(ref, dynamic=False), "triton": getattr(triton_linear_loss, op)}
        for C in hidden:
            for weight_grad in (False, True):
                h, w, labels, g = _inputs(op, n, v, C, weight_grad, device)
                shape = f"{'x'.join(map(str, labels.shape))} tokens, C={C}, V={v}, " + ("dW" if weight_grad else "W frozen")
                eager_ms = None
                for impl, fn in impls.items():
                    row = {"op": op, "shape": shape, "dtype": str(h.dtype).removeprefix("torch."), "impl": impl}
                    if skipped(impl, device):
                        rows.append({**row, "skipped": SKIP_COMPILED})
                        continue
                    step = _step(fn, h, w, labels, g)
                    step()                                  # warm-up: Triton JIT / inductor compile (smoke: the one call)
                    peak = _peak_mb(step) if cuda else None
                    ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median") if cuda else None
                    if impl == "eager":
                        eager_ms = ms
                    rows.append({**row, "ms": ms, "peak_mem_mb": peak, "ratio_vs_eager": ratio(ms, eager_ms)})
                del h, w, labels, g
                if cuda:
                    torch.cuda.empty_cache()
    return rows


def main() -> None:
    device = device_from_cli(__doc__)
    write("kernels_linear_loss", bench(device), device)


if __name__ == "__main__":
    main()
