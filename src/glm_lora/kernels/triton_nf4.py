"""NF4 dequantisation in one pass: packed 4-bit codes + double-quantised scales → the bf16/fp16/fp32 weight.

Same numbers as `kernels.reference.dequantize_nf4` (bitsandbytes' NF4 format, QLoRA arXiv:2305.14314): each
program reads BLOCK packed bytes (2·BLOCK weights), their 8-bit scale codes and nested fp32 scales, rebuilds
each block's scale nested_code[q] · nested_absmax + offset, looks both nibbles up in the 16-entry NF4 table and
writes the weights in order (high nibble first). Memory traffic: 0.5 byte read per weight (plus 1/64 byte
of scale code), the output's bytes written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm_lora.kernels.reference import NESTED_BLOCK, NF4_BLOCK, NF4Stack

BLOCK = 1024       # packed bytes per program


@triton.jit
def _dequantize_nf4_kernel(packed_ptr, absmax_codes_ptr, nested_absmax_ptr, offset_ptr, code_ptr, nested_code_ptr,
                           out_ptr, n_bytes, group_bytes, nested_per_group, BYTES_PER_SCALE: tl.constexpr,
                           SCALES_PER_NESTED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)      # byte index
    mask = offs < n_bytes
    byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
    block = offs // BYTES_PER_SCALE                                          # both nibbles share a block
    group = offs // group_bytes                                              # a stack's expert: its own scales
    local = block - group * (group_bytes // BYTES_PER_SCALE)
    q = tl.load(absmax_codes_ptr + block, mask=mask, other=0).to(tl.int32)
    nested = tl.load(nested_absmax_ptr + group * nested_per_group + local // SCALES_PER_NESTED, mask=mask, other=0.0)
    absmax = tl.load(nested_code_ptr + q) * nested + tl.load(offset_ptr + group, mask=mask, other=0.0)
    hi = tl.load(code_ptr + (byte >> 4)) * absmax
    lo = tl.load(code_ptr + (byte & 0xF)) * absmax
    out = tl.reshape(tl.join(hi, lo), (2 * BLOCK,))                          # element 2i: hi of byte i
    offs_out = tl.program_id(0).to(tl.int64) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + offs_out, out.to(out_ptr.dtype.element_ty), mask=offs_out < 2 * n_bytes)


def _launch(packed, absmax_codes, nested_absmax, offset, code, nested_code, dtype, groups: int) -> torch.Tensor:
    n_bytes = packed.numel()
    out = torch.empty(2 * n_bytes, dtype=dtype, device=packed.device)
    # No FMA contraction: the scale's multiply and add round apart, like the reference (and bitsandbytes).
    _dequantize_nf4_kernel[(triton.cdiv(n_bytes, BLOCK),)](
        packed, absmax_codes, nested_absmax, offset, code, nested_code, out, n_bytes, n_bytes // groups,
        nested_absmax.numel() // groups, BYTES_PER_SCALE=NF4_BLOCK // 2, SCALES_PER_NESTED=NESTED_BLOCK, BLOCK=BLOCK,
        enable_fp_fusion=False)
    return out


def dequantize_nf4(packed: torch.Tensor, absmax_codes: torch.Tensor, nested_absmax: torch.Tensor,
                   offset: torch.Tensor, code: torch.Tensor, nested_code: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """The flat weight (2 · packed.numel(),) in `dtype`; arguments as `kernels.reference.dequantize_nf4`."""
    return _launch(packed, absmax_codes, nested_absmax, offset, code, nested_code, dtype, 1)


def dequantize_nf4_stack(w: NF4Stack, dtype: torch.dtype) -> torch.Tensor:
    """A 4-bit stack (G, N, K) in `dtype`, every group with its own scales, in one launch (as
    `kernels.reference.dequantize_nf4_stack`)."""
    return _launch(w.packed, w.absmax_codes, w.nested_absmax, w.offset, w.code, w.nested_code, dtype,
                   w.shape[0]).view(w.shape)
