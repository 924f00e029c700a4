"""GPU micro-benchmark: the MoE grouped GEMM (kernels/triton_grouped_mm.py) vs the per-expert loop and torch._grouped_mm.

MoE shapes (bf16), rows = tokens × top-k sorted by expert, expert loads log-normal (σ 0.7, as
tests/gpu/test_grouped_mm_gpu.py), hidden 2048, moe intermediate 1408, LoRA r 16:
  64e_top8_up    16384 tokens × top-8 over 64 experts: 131072 rows, 2048 → 1408 (a gate or up projection)
  64e_top8_down  the same routing, 1408 → 2048 (the down projection)
  16e_top4_up    16384 tokens × top-4 over 16 experts: 65536 rows, 2048 → 1408

One provider function each (returns the output for given leaves):
  dense                 one cuBLAS GEMM over all rows with expert 0's weight: the same FLOPs, no grouping (a floor)
  loop                  kernels.reference.grouped_mm, one F.linear per expert (what a MoE layer does without a grouped GEMM)
  torch_grouped_mm      torch._grouped_mm (CUTLASS, kernels.triton_grouped_mm.torch_grouped_mm)
  triton                kernels.triton_grouped_mm.grouped_mm
The base providers train W (backward = dx + dW, full fine-tuning). LoRA providers keep W frozen (backward = dx,
dA, dB), scale 2:
  loop_lora             kernels.reference.grouped_lora_mm
  torch_grouped_mm_lora three torch._grouped_mm calls
  triton_lora_unfused   three Triton grouped_mm passes: y = gmm(x, W) + s · gmm(gmm(x, A), B)
  triton_lora_fused     kernels.triton_grouped_mm.grouped_lora_mm: x Aᵀ, then the base GEMM with s·(xAᵀ)Bᵀ in its tiles
QLoRA providers: the same W held in 4 bits (model.quant.NF4Params, each expert in bitsandbytes' NF4), W frozen:
  nf4_lora_fused        kernels.triton_grouped_mm.grouped_nf4_mm: each weight tile dequantised in the GEMM's registers
  nf4_dequant_then_fused  the stack dequantised whole (the Triton dequantisation kernel, expert by expert) into a
                        temporary, then triton_lora_fused (the temporary is kept for the backward here: its memory
                        is a floor)

Each row: triton.testing.do_bench quantiles (p20, p50, p80, ms) of forward, backward (retained graph) and full
(forward + backward), and the peak memory of one full step above what was allocated before it. Then a forward
sweep of a few block configs of the Triton base GEMM (`sweep` rows) and of its 4-bit form (`nf4_sweep`). One JSON line per row on stdout (GPU, date,
commit, torch/triton versions in each), all of them in --out.

--smoke: one tiny shape (64 rows over 4 experts, 64 → 64, r 8) in fp32 on the CPU, Triton in its interpreter
(TRITON_INTERPRET=1): each provider's forward + backward once, untimed; torch._grouped_mm's providers skipped
(CUTLASS: CUDA only).

    python -m bench.grouped_mm_gpu [--out bench/results/grouped_mm_gpu.jsonl] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.testing

from bench import common
from bench.common import commit, provenance
from glm_lora.kernels import ops, reference
from glm_lora.kernels import triton_grouped_mm as tgm
from glm_lora.model.quant import NF4Params

HIDDEN, INTER, RANK, SCALE, TOKENS = 2048, 1408, 16, 2.0, 16384
SHAPES = {"64e_top8_up": (8, 64, HIDDEN, INTER), "64e_top8_down": (8, 64, INTER, HIDDEN),
          "16e_top4_up": (4, 16, HIDDEN, INTER)}           # (top-k, experts, K in, N out)
SMOKE_TOKENS, SMOKE_RANK, SMOKE_SHAPES = 32, 8, {"smoke": (2, 4, 64, 64)}
CUDA_ONLY = "torch_grouped_mm"      # providers named with it call torch._grouped_mm's CUTLASS kernel
QUANTILES = [0.2, 0.5, 0.8]
SWEEP = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
         dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
         dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
         dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
         dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)]


def offsets_for(rows: int, experts: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    probs = torch.exp(torch.randn(experts, generator=g, dtype=torch.float64) * 0.7)
    counts = torch.bincount(torch.multinomial(probs, rows, replacement=True, generator=g), minlength=experts)
    return counts.cumsum(0).to(torch.int32).to(device)


BASE = {"dense": lambda x, w, o: x @ w.t(),                 # w: expert 0's weight alone (a 2-D leaf)
        "loop": reference.grouped_mm,
        "torch_grouped_mm": tgm.torch_grouped_mm,
        "triton": tgm.grouped_mm}
LORA = {"loop_lora": lambda x, w, a, b, o: reference.grouped_lora_mm(x, w, a, b, SCALE, o),
        "torch_grouped_mm_lora": lambda x, w, a, b, o: tgm.torch_grouped_lora_mm(x, w, a, b, SCALE, o),
        "triton_lora_unfused": lambda x, w, a, b, o: tgm.grouped_mm(x, w, o) + SCALE * tgm.grouped_mm(
            tgm.grouped_mm(x, a, o), b, o),
        "triton_lora_fused": lambda x, w, a, b, o: tgm.grouped_lora_mm(x, w, a, b, SCALE, o)}


NF4_SWEEP = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
             dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
             dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
             dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=4),
             dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
             dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)]


def _dequantized(stack) -> torch.Tensor:
    flat = [ops.dequantize_nf4(stack.packed[e], stack.absmax_codes[e], stack.nested_absmax[e], stack.offset[e],
                               stack.code, stack.nested_code, torch.bfloat16) for e in range(stack.shape[0])]
    return torch.stack(flat).view(stack.shape)


NF4 = {"nf4_lora_fused": lambda x, q, a, b, o: tgm.grouped_nf4_mm(x, q, o, a, b, SCALE),
       "nf4_dequant_then_fused": lambda x, q, a, b, o: tgm.grouped_lora_mm(x, _dequantized(q).to(x.dtype), a, b,
                                                                           SCALE, o)}


def _q(fn, leaves) -> list[float]:
    return [round(float(t), 4) for t in triton.testing.do_bench(fn, quantiles=QUANTILES, grad_to_none=leaves)]


def measure(fn, args, leaves, dy) -> dict:
    """p20/p50/p80 ms of forward, backward, full; peak MB of one full step above the memory before it.
    On the CPU (--smoke): one forward + backward, no figures."""
    if not dy.is_cuda:
        torch.autograd.backward(fn(*args), dy)
        return {}
    for _ in range(2):                                         # JIT compiles before anything is timed
        torch.autograd.backward(fn(*args), dy)
    with torch.no_grad():
        fwd = _q(lambda: fn(*args), leaves)
    y = fn(*args)
    bwd = _q(lambda: torch.autograd.backward(y, dy, retain_graph=True), leaves)
    del y
    full = _q(lambda: torch.autograd.backward(fn(*args), dy), leaves)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.autograd.backward(fn(*args), dy)
    torch.cuda.synchronize()
    return {"fwd_ms": fwd, "bwd_ms": bwd, "full_ms": full,
            "peak_mem_mb": round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)}


def bench(device: torch.device) -> list[dict]:
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32          # the interpreter's bf16 dot is wrong
    tokens, rank, shapes = (TOKENS, RANK, SHAPES) if cuda else (SMOKE_TOKENS, SMOKE_RANK, SMOKE_SHAPES)
    meta = {**provenance(), "gpu": torch.cuda.get_device_name() if cuda else "CPU (smoke)", "torch": torch.__version__,
            "triton": triton.__version__, "dtype": str(dtype).removeprefix("torch."), "quantiles": QUANTILES}
    rows = []
    for shape, (top_k, G, k, n) in shapes.items():
        M = tokens * top_k
        offsets = offsets_for(M, G, device)
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        gen = torch.Generator(device).manual_seed(0)
        rnd = lambda *s, std=1.0: (torch.randn(*s, generator=gen, device=device) * std).to(dtype)   # noqa: E731
        x, w = rnd(M, k).requires_grad_(True), rnd(G, n, k, std=k ** -0.5).requires_grad_(True)
        a, b = rnd(G, rank, k, std=k ** -0.5).requires_grad_(True), rnd(G, n, rank, std=rank ** -0.5).requires_grad_(True)
        dy = rnd(M, n)
        info = {**meta, "shape": shape, "rows": M, "experts": G, "k": k, "n": n, "r": rank,
                "max_over_mean_rows": round(counts.max().item() / counts.float().mean().item(), 2),
                "gemm_tflop": round(2 * M * k * n / 1e12, 3)}
        for name, fn in BASE.items():
            w_ = w[0].detach().requires_grad_(True) if name == "dense" else w
            rows.append(_provider_row({**info, "provider": name, "w_trains": True},
                                      lambda: measure(fn, (x, w_, offsets), [x, w_], dy)))
        wf = w.detach()
        for name, fn in LORA.items():
            rows.append(_provider_row({**info, "provider": name, "w_trains": False},
                                      lambda: measure(fn, (x, wf, a, b, offsets), [x, a, b], dy)))
        stack = NF4Params.stacked(wf.unbind(0), G).stack()
        for name, fn in NF4.items():
            rows.append(_provider_row({**info, "provider": name, "w_trains": False},
                                      lambda: measure(fn, (x, stack, a, b, offsets), [x, a, b], dy)))
        if shape in ("64e_top8_up", "smoke"):
            sweep, nf4_sweep = (SWEEP, NF4_SWEEP) if cuda else (SWEEP[:1], NF4_SWEEP[:1])    # --smoke: one of each
            for cfg in sweep:
                row = {**info, "provider": "sweep", "config": cfg}
                try:
                    tgm.grouped_gemm(x, w.transpose(1, 2), offsets, config=cfg)
                    if cuda:
                        row["fwd_ms"] = _q(lambda: tgm.grouped_gemm(x, w.transpose(1, 2), offsets, config=cfg), None)
                except Exception as e:                                       # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
            for cfg in nf4_sweep:
                row = {**info, "provider": "nf4_sweep", "config": cfg}
                rhs = tgm.NF4Rhs(stack, True)
                try:
                    tgm.grouped_gemm(x, rhs, offsets, config=cfg)
                    if cuda:
                        row["fwd_ms"] = _q(lambda: tgm.grouped_gemm(x, rhs, offsets, config=cfg), None)
                except Exception as e:                                       # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
        del x, w, a, b, dy, wf, stack
        if cuda:
            torch.cuda.empty_cache()
    return rows


def _provider_row(row: dict, measured) -> dict:
    """The row with measured()'s figures, or the error it raised (recorded: the other providers go on);
    torch._grouped_mm's providers skipped on the CPU."""
    if CUDA_ONLY in row["provider"] and row["gpu"] == "CPU (smoke)":
        row["skipped"] = "--smoke: torch._grouped_mm's kernel is CUDA only"
    else:
        try:
            row.update(measured())
        except Exception as e:                                               # noqa: BLE001 — record and go on
            row["error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict]) -> str:
    """p50 forward / backward / full per provider, with ratios to the loop and, for LoRA, fused vs unfused."""
    out = [f"{'shape':14} {'provider':22} {'fwd':>8} {'bwd':>8} {'full':>8} {'MB':>8}  ratios (full p50)"]
    for shape in SHAPES:
        got = {r["provider"]: r for r in rows if r["shape"] == shape and "full_ms" in r}
        for name, r in got.items():
            p50 = lambda key, rr=r: rr[key][1]                                # noqa: E731
            ratio = []
            for ref in ("loop", "torch_grouped_mm", "loop_lora", "torch_grouped_mm_lora", "triton_lora_unfused",
                        "triton_lora_fused"):
                if ref in got and ref != name and (ref in BASE) == (name in BASE):
                    ratio.append(f"/{ref} {p50('full_ms') / got[ref]['full_ms'][1]:.2f}")
            out.append(f"{shape:14} {name:22} {p50('fwd_ms'):8.3f} {p50('bwd_ms'):8.3f} {p50('full_ms'):8.3f} "
                       f"{r['peak_mem_mb']:8.0f}  {' '.join(ratio)}")
        for r in rows:
            if r["shape"] == shape and r["provider"] in ("sweep", "nf4_sweep") and "fwd_ms" in r:
                c = r["config"]
                out.append(f"{shape:14} {r['provider']} {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} "
                           f"s{c['num_stages']}  fwd {r['fwd_ms'][1]:.3f}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON-lines file for the rows (default: bench/results/grouped_mm_gpu[_smoke]_<date>_<commit>.jsonl)")
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, fp32, untimed (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    if args.smoke:
        torch.set_num_threads(1)        # tiny shapes: extra threads only add contention on a shared CPU
    rows = bench(torch.device("cpu" if args.smoke else "cuda"))
    name = "grouped_mm_gpu" + ("_smoke" if args.smoke else "")
    out = args.out or common.RESULTS / f"{name}_{time.strftime('%Y-%m-%d', time.gmtime())}_{commit()}.jsonl"
    with open(out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))
    print("->", out)


if __name__ == "__main__":
    main()
