"""QLoRA's frozen base weight in 4 bits: NF4 with double-quantised scales, in bitsandbytes' own format.

`quantize_nf4(W)` gives what `bitsandbytes.functional.quantize_4bit(W, blocksize=64, quant_type="nf4",
compress_statistics=True)` holds (QLoRA, arXiv:2305.14314, §3):
  packed         uint8 (n/2,): each weight's index into the 16 NF4 values, two per byte, the first in the
                 high nibble (bnb's quant tensor is this as (n/2, 1))
  absmax_codes   uint8 (n/64,): each 64-weight block's absmax minus `offset`, quantised in blocks of 256
                 to 8 bits over bnb's signed dynamic map (`nested_code`)
  nested_absmax  fp32 (⌈n/64/256⌉,): the absmax of each block of 256 such values
  offset         fp32 (): the mean of the absmaxes
Memory: 0.5 byte per weight + 1/64 byte (scale codes) + 4/16384 byte (nested scales), plus the two code
maps (`code`, `nested_code`: 1.1 KB a layer).

Rounding follows bnb's pure-torch backend (its `default` ops): a value is scaled by the reciprocal of its
block's absmax, clamped to [-1, 1] and given the nearest code, a tie to the lower one. bnb's CUDA kernel
rounds the same way; its CPU library picks the 8-bit scale codes through a 65536-entry lookup table and so,
on ~0.1% of them, a code up to one table bin farther (tests/kernels/test_nf4.py). The same weight quantised
on CUDA may get an offset one ulp apart (another reduction order) and so a few scale codes one step apart.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn

from glm_lora.kernels import ops as kernels
from glm_lora.kernels.reference import NESTED_BLOCK, NF4_BLOCK, NF4Stack, dequantize_nf4_stack

# bitsandbytes' get_4bit_type("nf4"): quantiles of N(0, 1) scaled to [-1, 1], with an exact zero.
NF4_VALUES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)


@functools.cache
def dynamic_map() -> torch.Tensor:
    """bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8), the 8-bit code of
    the nested scales (Dettmers, arXiv:1511.04561): for each exponent 10^-6 … 10^0, 2^i evenly spaced
    fractions in (0.1, 1], both signs, plus 0 and 1; 256 sorted fp32 values. Same float ops, same values."""
    data = []
    for i in range(7):
        boundaries = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist() + (-(10 ** (-6 + i)) * means).tolist()
    return torch.tensor(sorted(data + [0, 1.0]), dtype=torch.float32)


def _nearest(values: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of the sorted `code` for each value (a tie: the lower one), as uint8."""
    midpoints = (code[:-1] + code[1:]) / 2
    return torch.bucketize(values, midpoints).to(torch.uint8)


def _quantize_blocks(values: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values (blocks, size) fp32 → (indices into `code`, each block's absmax). An all-zero block gets the
    code nearest 0 (bnb clamps the absmax to 1e-38 before taking its reciprocal)."""
    absmax = values.abs().amax(dim=1)
    scaled = (values * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp(-1, 1)
    return _nearest(scaled, code), absmax


@dataclass
class NF4Weight:
    """A frozen weight in bitsandbytes' NF4 + double quantisation (see the module docstring)."""

    packed: torch.Tensor
    absmax_codes: torch.Tensor
    nested_absmax: torch.Tensor
    offset: torch.Tensor
    code: torch.Tensor          # the 16 NF4 values (fp32)
    nested_code: torch.Tensor   # the 256 values of the dynamic map (fp32)
    shape: torch.Size
    dtype: torch.dtype          # of the weight it was made from: what `dequantize()` gives by default

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        flat = kernels.dequantize_nf4(self.packed, self.absmax_codes, self.nested_absmax, self.offset, self.code,
                                      self.nested_code, dtype or self.dtype)
        return flat.view(self.shape)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in vars(self).values() if isinstance(t, torch.Tensor))


def quantize_nf4(weight: torch.Tensor) -> NF4Weight:
    """`weight` (any shape, numel a multiple of 64; bf16/fp16/fp32) in NF4 with double-quantised scales."""
    n = weight.numel()
    if n % NF4_BLOCK:
        raise ValueError(f"NF4 needs a multiple of {NF4_BLOCK} weights, got {tuple(weight.shape)} ({n})")
    device = weight.device
    if weight.is_meta:      # shapes only (a model built to load a gathered state dict into, engine/dist.py)
        blocks = n // NF4_BLOCK
        empty = lambda *s, dtype=torch.float32: torch.empty(*s, dtype=dtype, device=device)   # noqa: E731
        return NF4Weight(packed=empty(n // 2, dtype=torch.uint8), absmax_codes=empty(blocks, dtype=torch.uint8),
                         nested_absmax=empty(-(-blocks // NESTED_BLOCK)), offset=empty(()), code=empty(16),
                         nested_code=empty(256), shape=weight.shape, dtype=weight.dtype)
    code, nested_code = torch.tensor(NF4_VALUES, device=device), dynamic_map().to(device)
    indices, absmax = _quantize_blocks(weight.detach().reshape(-1, NF4_BLOCK).float(), code)
    indices = indices.view(-1)
    packed = (indices[0::2] << 4) | indices[1::2]
    offset = absmax.mean()
    centred = absmax - offset
    padding = -centred.numel() % NESTED_BLOCK          # zeros: they change no block's absmax
    nested = torch.cat((centred, centred.new_zeros(padding))).view(-1, NESTED_BLOCK)
    absmax_codes, nested_absmax = _quantize_blocks(nested, nested_code)
    return NF4Weight(packed=packed, absmax_codes=absmax_codes.view(-1)[:centred.numel()].contiguous(),
                     nested_absmax=nested_absmax, offset=offset, code=code, nested_code=nested_code,
                     shape=weight.shape, dtype=weight.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


_ARRAYS = ("packed", "absmax_codes", "nested_absmax", "offset")      # one row per weight of a stack
_TABLES = ("code", "nested_code")                                      # shared by all of them


class NF4Params(nn.Module):
    """Frozen weights in 4 bits (`quantize_nf4`'s arrays, bitsandbytes' format) as frozen parameters of integer dtypes,
    the fp32 scales and code tables as their int32 bits. So FSDP2 shards them like any frozen weight (on the expert
    dim for a stack) and gathers them bit for bit, never casting them; `.to(dtype)` leaves them as they are; a state
    dict holds them (FSDP2 gathers a trained model through one). Checkpoints keep trainable tensors only: the adapter.

    Either one weight (`NF4Params.of(w)`: flat arrays, `weight()` gives its NF4Weight) or a stack of routed experts,
    each quantised alone (`NF4Params.stacked(experts, E)`: arrays with a leading expert dim, `stack()` gives what the
    grouped GEMM reads; expert e dequantises as bitsandbytes' quantize_4bit of that expert does)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, rows: int | None, first: NF4Weight):
        super().__init__()
        self.shape, self.dtype, self.rows = tuple(shape), dtype, rows
        for name in _ARRAYS + _TABLES:
            t = _bits(first.offset.reshape(1)) if name == "offset" else getattr(first, name)
            t = _bits(t) if t.is_floating_point() else t
            if rows is not None and name in _ARRAYS:
                t = t.new_empty(rows, *t.shape)
            setattr(self, name, nn.Parameter(t, requires_grad=False))

    @classmethod
    def of(cls, weight: torch.Tensor) -> "NF4Params":
        return cls(weight.shape, weight.dtype, None, quantize_nf4(weight))

    @classmethod
    def stacked(cls, experts: Iterable[torch.Tensor], num_experts: int) -> "NF4Params":
        """`experts`: each expert's (out, in) weight in turn (e.g. `w.unbind(0)`, or made one at a time on the GPU so
        the full-precision stack never exists)."""
        out = None
        for e, weight in enumerate(experts):
            q = quantize_nf4(weight)
            if out is None:
                out = cls((num_experts, *weight.shape), weight.dtype, num_experts, q)
            elif weight.shape != out.shape[1:]:
                raise ValueError(f"NF4Params: expert {e} is {tuple(weight.shape)}, expert 0 {tuple(out.shape[1:])}")
            for name in _ARRAYS:
                t = q.offset.reshape(1) if name == "offset" else getattr(q, name)
                getattr(out, name)[e] = _bits(t) if t.is_floating_point() else t
        if out is None or e + 1 != num_experts:
            raise ValueError(f"NF4Params: {0 if out is None else e + 1} expert weights given for {num_experts} experts")
        return out

    def _apply(self, fn, recurse=True):
        """.to(dtype)/.half()… give `dequantize()` that dtype, as they would the weight it was made from."""
        super()._apply(fn, recurse)
        self.dtype = fn(torch.empty(0, dtype=self.dtype, device=self.packed.device)).dtype
        return self

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def _float(self, name: str) -> torch.Tensor:
        return getattr(self, name).view(torch.float32)

    def weight(self) -> NF4Weight:
        """One weight's NF4Weight (views of the parameters)."""
        return NF4Weight(packed=self.packed, absmax_codes=self.absmax_codes, nested_absmax=self._float("nested_absmax"),
                         offset=self._float("offset").view(()), code=self._float("code"),
                         nested_code=self._float("nested_code"), shape=torch.Size(self.shape), dtype=self.dtype)

    def stack(self) -> NF4Stack:
        """A stack's arrays as the kernels read them (kernels.reference.NF4Stack)."""
        return NF4Stack(self.packed, self.absmax_codes, self._float("nested_absmax"), self._float("offset").view(-1),
                        self._float("code"), self._float("nested_code"), self.shape)

    def expert(self, e: int) -> NF4Weight:
        """Expert e of a stack alone, as `quantize_nf4` gave it."""
        s = self.stack()
        return NF4Weight(packed=s.packed[e], absmax_codes=s.absmax_codes[e], nested_absmax=s.nested_absmax[e],
                         offset=s.offset[e], code=s.code, nested_code=s.nested_code, shape=torch.Size(self.shape[1:]),
                         dtype=self.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight (or the (E, out, in) stack) in `dtype` (default: that of the weights it was made from)."""
        if self.rows is None:
            return self.weight().dequantize(dtype)
        return dequantize_nf4_stack(self.stack(), dtype or self.dtype)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, nf4"
