"""Two CPU-step levers for the tiny default's compiled SFT step at one thread (CI's quality run), A/B in one process.

    python bench/probe/cpu_sft_levers.py RUN_DIR [--steps 160] [--variants now,rope-op,attn-math-fp32,attn-math-bf16]

RUN_DIR: a finished tiny run (tokenizer, data, pretrain), e.g. from `python -m glm_lora.flows.cli stage pretrain`.
Variants (each its own model copy, optimizer and compiled graph, from the same start, on the same batches; the order
alternates every step so that neither pays the first slot's cache misses each time):
  now             the product's step (bench.cpu_step's compiled bf16 variant with fused AdamW)
  rope-op         RoPE's cos/sin built by an opaque custom op: inductor otherwise inlines `cos`/`sin` of the positions
                  into every kernel that reads the tables, recomputing them per head and element, forward and backward
  attn-math-*     attention as q·kᵀ → masked softmax → ·v (fp32, or bf16 matmuls with an fp32 softmax) inside the
                  compiled graph, instead of SDPA's CPU flash kernel in fp32
Prints median / mean ms a step per variant and the largest loss difference to the first variant.
"""
import argparse
import statistics
from pathlib import Path

import torch

from bench.cpu_step import Variant, sft_setup
from glm_lora.kernels import ops as kernels
from glm_lora.kernels import reference

MODE = {"now": "now"}


@torch.library.custom_op("glm_lora_probe::rope_cos_sin", mutates_args=())
def _rope_op(positions: torch.Tensor, rotary_dim: int, theta: float,
             interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.rope_cos_sin(positions, rotary_dim, theta, interleaved)


@_rope_op.register_fake
def _(positions, rotary_dim, theta, interleaved):
    shape = (*positions.shape, rotary_dim)
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


def _rope(positions, rotary_dim, theta, interleaved=False):
    if MODE["now"] == "rope-op":
        return _rope_op(positions, rotary_dim, theta, interleaved)
    return reference.rope_cos_sin(positions, rotary_dim, theta, interleaved)


def _math_attention(q, k, v, mask):
    B, H, T, D = q.shape
    Hk = k.shape[1]
    s = torch.matmul(q.reshape(B, Hk, H // Hk * T, D), k.transpose(-1, -2)) * D ** -0.5
    s = s.view(B, Hk, H // Hk, T, T).masked_fill(~mask.view(B, 1, 1, T, T), float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(v.dtype).view(B, Hk, H // Hk * T, T)
    return torch.matmul(p, v).view(B, H, T, D)


_reference_attention = reference.attention


def _attention(q, k, v, mask):
    if mask is not None and MODE["now"] == "attn-math-bf16":
        return _math_attention(q, k, v, mask)
    if mask is not None and MODE["now"] == "attn-math-fp32":
        with torch.autocast("cpu", enabled=False):
            return _math_attention(q.float(), k.float(), v.float(), mask).to(q.dtype)
    return _reference_attention(q, k, v, mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--variants", default="now,rope-op")
    ap.add_argument("--runs-dir", type=Path, default=Path("/tmp/cpu_sft_levers"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    kernels.rope_cos_sin = _rope
    reference.attention = _attention
    cfg, tc, data, batches, model = sft_setup(args.run, args.runs_dir)
    names = args.variants.split(",")
    variants = {}
    for n in names:
        MODE["now"] = n
        variants[n] = Variant(n, model, tc, 1, True, args.runs_dir, bf16=True, fused=True)
    for i in range(args.steps):
        batch = next(batches)
        for n in names if i % 2 == 0 else names[::-1]:
            MODE["now"] = n
            variants[n].step(batch, i)
    for n, v in variants.items():
        times = v.times[5:]
        diff = max(abs(a - b) for a, b in zip(variants[names[0]].losses, v.losses))
        print(f"{n:16s} median {1000 * statistics.median(times):6.1f} ms  mean {1000 * statistics.mean(times):6.1f} ms"
              f"  first step {v.first:5.1f} s  max |loss - {names[0]}| {diff:.4f}")
    for v in variants.values():
        v.close()


if __name__ == "__main__":
    main()
