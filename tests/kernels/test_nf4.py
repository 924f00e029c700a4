"""NF4 with double-quantised scales (model/quant.py, kernels/triton_nf4.py): the Triton dequantiser vs the
reference (interpreter on CPU), the quantisation error, and bitsandbytes' own format, byte for byte.

bitsandbytes runs on the CPU: `quantize_4bit` there is its pure-torch ("default") op, except the 8-bit
quantisation of the scales, which its CPU library does through a 65536-entry lookup table. Our scale codes
are compared byte for byte with bnb's pure-torch op (reached by redispatching its torch.library op) and,
against the CPU library, may differ only where the table's resolution let it pick a code farther than ours.
"""
from dataclasses import replace

import pytest
import torch

from glm_lora.kernels import ops as kernels
from glm_lora.kernels import reference
from glm_lora.kernels.triton_nf4 import dequantize_nf4 as triton_dequantize_nf4
from glm_lora.model.quant import NF4_VALUES, dynamic_map, quantize_nf4

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# numel a multiple of 64 with odd sides; 37 × 448 has 259 scale blocks (two nested blocks, the second partial)
# and spans 9 Triton programs, the last one partial.
SHAPES = [(3, 64), (5, 192), (7, 320), (37, 448)]


def weight(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Gaussian weights whose scale varies by row, as trained layers' do."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.rand(shape[0], 1, generator=g) * 3 + 0.5
    return (torch.randn(shape, generator=g) * 0.02 * rows).to(dtype)


def parts(q):
    return q.packed, q.absmax_codes, q.nested_absmax, q.offset, q.code, q.nested_code


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_dequantize_matches_reference(shape, dtype):
    q = quantize_nf4(weight(shape, dtype))
    got, want = triton_dequantize_nf4(*parts(q), dtype), reference.dequantize_nf4(*parts(q), dtype)
    assert got.dtype == dtype and got.shape == (q.packed.numel() * 2,)
    if dtype == torch.bfloat16:
        # Triton's interpreter casts fp32 → bf16 by truncation, the GPU (and torch) to nearest: one bf16 ulp.
        torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)
        assert torch.equal(triton_dequantize_nf4(*parts(q), torch.float32).to(dtype), want)
    else:
        assert torch.equal(got, want)


def test_backend_choice_reaches_the_triton_kernel(monkeypatch):
    q = quantize_nf4(weight((4, 64)))
    from glm_lora.kernels import triton_nf4
    calls = []
    monkeypatch.setattr(triton_nf4, "dequantize_nf4", lambda *a: calls.append(a) or triton_dequantize_nf4(*a))
    kernels._triton_op.cache_clear()
    try:
        with kernels.using("triton"):
            on_triton = q.dequantize()
        with kernels.using("auto"):
            on_auto = q.dequantize()            # CPU: the reference
    finally:
        kernels._triton_op.cache_clear()
    assert len(calls) == 1 and torch.equal(on_triton, on_auto)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(256, 512)])
def test_quantisation_error_is_bounded_per_block(shape, dtype):
    """|w − ŵ| ≤ (half the widest NF4 gap) · absmax + the scale's own 8-bit error, in every 64-block."""
    w = weight(shape, dtype)
    q = quantize_nf4(w)
    assert q.dequantize().dtype == dtype and q.dequantize().shape == w.shape
    blocks = w.float().view(-1, 64)
    err = (q.dequantize(torch.float32) - w.float()).view(-1, 64).abs().amax(dim=1)
    absmax = blocks.abs().amax(dim=1)
    nf4_half_gap = max(b - a for a, b in zip(NF4_VALUES, NF4_VALUES[1:])) / 2           # 0.1385, near ±1
    code = dynamic_map()
    scale_half_gap = (code[1:] - code[:-1]).max().item() / 2                           # 0.007, near ±1
    nested = q.nested_absmax.repeat_interleave(256)[: absmax.numel()]
    bound = nf4_half_gap * absmax + scale_half_gap * nested + 1e-6 * absmax
    if dtype != torch.float32:
        bound = bound + absmax * 2 ** -8        # ŵ rounded to the half-precision dtype
    assert (err <= bound).all(), (err / bound).max()
    rel = (q.dequantize(torch.float32) - w.float()).norm() / w.float().norm()
    assert 0.02 < rel < 0.15               # NF4 on Gaussian weights: ~0.1 relative RMS error


def test_zero_blocks_and_memory():
    w = weight((512, 512))
    w[3, :128] = 0                          # two whole 64-blocks of zeros
    q = quantize_nf4(w)
    assert torch.equal(q.dequantize()[3, :128], torch.zeros(128))
    n = w.numel()
    assert q.packed.dtype == q.absmax_codes.dtype == torch.uint8
    assert q.packed.numel() == n // 2 and q.absmax_codes.numel() == n // 64
    assert q.nbytes <= 0.5 * n + n / 64 + 4 * (n / 64 / 256) + 4 + 4 * (16 + 256)      # ≈ 0.52 byte / weight


def test_refuses_a_partial_block():
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_nf4(torch.ones(3, 30))


# ---------------------------------------------------------------- bitsandbytes' format

@pytest.fixture(scope="module")
def bnb():
    return pytest.importorskip("bitsandbytes.functional")


def bnb_state(bnb, q):
    """Our NF4Weight as bnb's QuantState (what bnb.functional.quantize_4bit returns beside the packed bytes)."""
    nested = bnb.QuantState(absmax=q.nested_absmax, code=q.nested_code, blocksize=256, dtype=torch.float32)
    return bnb.QuantState(absmax=q.absmax_codes, shape=q.shape, dtype=q.dtype, blocksize=64, code=q.code,
                          quant_type="nf4", offset=q.offset, state2=nested)


def test_code_maps_are_bnbs(bnb):
    assert torch.equal(torch.tensor(NF4_VALUES), bnb.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(dynamic_map(), bnb.create_dynamic_map())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(1024, 1024)])
def test_quantize_matches_bnb_byte_for_byte(bnb, shape, dtype):
    w = weight(shape, dtype, seed=1)
    q = quantize_nf4(w)
    packed, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    assert torch.equal(q.packed, packed.view(-1))
    assert torch.equal(q.offset, state.offset) and torch.equal(q.nested_absmax, state.state2.absmax)
    assert torch.equal(q.code, state.code) and torch.equal(q.nested_code, state.state2.code)
    assert (q.shape, q.dtype) == (state.shape, state.dtype)

    # The scale codes: bnb's pure-torch op exactly ...
    absmax = w.float().view(-1, 64).abs().amax(dim=1)
    centred = absmax - absmax.mean()
    default = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    codes, _ = torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(default, centred, dynamic_map(), 256)
    assert torch.equal(q.absmax_codes, codes)
    # ... and the CPU library's except where its table (2/65535 wide bins over [-1, 1]) picked a code up to
    # a bin farther than the nearest one, which is ours.
    differ = q.absmax_codes != state.absmax
    assert differ.sum() <= 1 + 0.01 * differ.numel()
    scaled = centred[differ] / q.nested_absmax.repeat_interleave(256)[: absmax.numel()][differ]
    ours, theirs = ((dynamic_map()[c[differ].long()] - scaled).abs() for c in (q.absmax_codes, state.absmax))
    assert (ours <= theirs).all() and (theirs - ours <= 2 / 65535).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_equals_bnbs_both_ways(bnb, shape, dtype):
    w = weight(shape, dtype, seed=2)
    q = quantize_nf4(w)
    assert torch.equal(q.dequantize(), bnb.dequantize_4bit(q.packed.view(-1, 1), bnb_state(bnb, q)))
    packed, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    theirs = type(q)(packed=packed.view(-1), absmax_codes=state.absmax, nested_absmax=state.state2.absmax,
                     offset=state.offset, code=state.code, nested_code=state.state2.code, shape=w.shape, dtype=dtype)
    assert torch.equal(theirs.dequantize(), bnb.dequantize_4bit(packed, state))
    with kernels.using("triton"):
        got = theirs.dequantize(torch.float32)       # the Triton kernel (interpreter) reads bnb's state too
    assert torch.equal(got, bnb.dequantize_4bit(packed, bnb_state(bnb, replace(theirs, dtype=torch.float32))))
