"""Routed experts in 4 bits (QLoRA on a mixture of experts): model.quant.NF4Params stacks each expert's own NF4
quantisation (bitsandbytes' format per expert, byte for byte), and the grouped GEMM that dequantises each weight tile
in registers (kernels.triton_grouped_mm.grouped_nf4_mm, Triton interpreter on CPU) equals the reference —
dequantise the stack, then the per-expert loop — forward and every gradient (x, A, B), on odd shapes, empty
experts and a stack whose experts span more than one nested-scale block."""
import pytest
import torch

from glm_lora.kernels import ops as kernels
from glm_lora.kernels import reference
from glm_lora.kernels import triton_grouped_mm as tgm
from glm_lora.model.quant import NF4Params, quantize_nf4
from tests.kernel_check import Tol, check
from tests.kernels.test_triton_grouped_mm import _inputs as grouped_inputs

torch.set_num_threads(1)

TOL = {torch.float32: Tol(1e-5, 1e-4, scaled=True), torch.float16: Tol(4e-3, 1e-2, scaled=True)}
# (in K, out N, r, rows per expert): an empty expert and a 1-row one; N odd; the last shape puts 272 scale blocks in
# each expert (two nested blocks of 256), so a wrong nested index or per-expert stride shows
SHAPES = {"skewed": (48, 80, 6, (10, 0, 10, 16, 1)),
          "odd_out": (64, 17, 4, (0, 9, 0, 5)),
          "two_nested": (136, 128, 8, (7, 0, 12))}


def _experts(n, k, experts, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(experts, n, k, generator=g, dtype=torch.float64) * k ** -0.5).to(dtype)
    return w, NF4Params.stacked(w.unbind(0), experts)


def _inputs(k, n, r, counts, dtype, seed=1):
    """x (M, k), a (G, r, k), b (G, n, r), offsets, as the bf16/fp32 grouped GEMM's tests draw them."""
    x, _, a, b, offsets = grouped_inputs(k, n, r, counts, dtype, seed)
    return x, a, b, offsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_expert_is_quantised_as_a_linear_weight_alone(dtype):
    from glm_lora.kernels.triton_nf4 import dequantize_nf4_stack
    w, q = _experts(128, 136, 3, dtype)
    assert q.packed.dtype == torch.uint8 and not any(p.is_floating_point() for p in q.parameters())
    for e in range(3):
        alone = quantize_nf4(w[e])
        mine = q.expert(e)
        for field in ("packed", "absmax_codes", "nested_absmax", "offset", "code", "nested_code"):
            assert torch.equal(getattr(mine, field), getattr(alone, field)), (e, field)
        assert torch.equal(q.dequantize()[e], alone.dequantize())
    assert torch.equal(dequantize_nf4_stack(q.stack(), torch.float32), q.dequantize(torch.float32))   # one Triton pass
    assert q.dequantize().dtype == dtype


def test_each_expert_dequantises_as_bitsandbytes_quantised_it():
    bnb = pytest.importorskip("bitsandbytes.functional")
    # 272 scale blocks an expert: below 256, bnb's CPU dequantize_4bit disagrees with its own quantize_4bit
    w, q = _experts(128, 136, 3, torch.bfloat16)
    for e in range(3):
        packed, state = bnb.quantize_4bit(w[e], blocksize=64, quant_type="nf4", compress_statistics=True)
        assert torch.equal(q.packed[e], packed.view(-1)) and torch.equal(q.expert(e).offset, state.offset)
        # bnb's CPU library may pick a scale code one table bin away (tests/kernels/test_nf4.py): read its own state
        theirs = q.expert(e).__class__(packed=packed.view(-1), absmax_codes=state.absmax,
                                       nested_absmax=state.state2.absmax, offset=state.offset, code=state.code,
                                       nested_code=state.state2.code, shape=w[e].shape, dtype=w.dtype)
        assert torch.equal(theirs.dequantize(), bnb.dequantize_4bit(packed, state))


@pytest.mark.parametrize("mode", ["tile", "stack"])
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_lora_over_4bit_experts_matches_dequantise_then_loop(shape, dtype, mode, monkeypatch):
    """tile: each weight tile dequantised in the GEMM; stack: the stack dequantised by the Triton kernel, then the
    bf16 grouped GEMM (kernels.triton_grouped_mm.NF4_EXPERTS)."""
    monkeypatch.setattr(tgm, "NF4_EXPERTS", mode)
    k, n, r, counts = SHAPES[shape]
    _, q = _experts(n, k, len(counts), dtype)
    stack = q.stack()
    x, a, b, offsets = _inputs(k, n, r, counts, dtype)
    gemms = []
    monkeypatch.setattr(tgm, "grouped_gemm", lambda lhs, rhs, *args, **kw: gemms.append(type(rhs).__name__)
                        or _GEMM(lhs, rhs, *args, **kw))
    check(lambda x, a, b: tgm.grouped_nf4_mm(x, stack, offsets, a, b, 1.5),
          lambda x, a, b: reference.grouped_nf4_mm(x, stack, offsets, a, b, 1.5), [x, a, b], TOL[dtype])
    # forward x Aᵀ then the 4-bit GEMM with the rank-r term folded in; backward dy B then dx through the 4-bit W
    w = "NF4Rhs" if mode == "tile" else "Tensor"
    assert gemms == ["Tensor", w, "Tensor", w]


_GEMM = tgm.grouped_gemm


@pytest.mark.parametrize("shape", ["skewed", "two_nested"])
def test_4bit_experts_without_lora_give_dx_only(shape):
    k, n, _, counts = SHAPES[shape]
    _, q = _experts(n, k, len(counts), torch.float32)
    x, _, _, offsets = _inputs(k, n, 2, counts, torch.float32)
    check(lambda x: tgm.grouped_nf4_mm(x, q.stack(), offsets),
          lambda x: reference.grouped_nf4_mm(x, q.stack(), offsets), [x], TOL[torch.float32])


def test_the_tile_kernel_reads_4_bits_not_a_dequantised_copy(monkeypatch):
    """In "tile" mode the Triton op never builds the full-precision stack: dequantising it is made to fail, and it
    still runs."""
    import glm_lora.kernels.triton_nf4 as tnf4
    monkeypatch.setattr(tgm, "NF4_EXPERTS", "tile")
    monkeypatch.setattr(tnf4, "dequantize_nf4_stack", lambda *_: pytest.fail("dequantised the whole stack"))
    _, q = _experts(80, 48, 5, torch.float32)
    x, a, b, offsets = _inputs(48, 80, 6, SHAPES["skewed"][3], torch.float32)
    expected = reference.grouped_nf4_mm(x, q.stack(), offsets, a, b, 2.0)
    monkeypatch.setattr(reference, "dequantize_nf4_stack", lambda *_: pytest.fail("dequantised the whole stack"))
    torch.testing.assert_close(tgm.grouped_nf4_mm(x, q.stack(), offsets, a, b, 2.0), expected)


def test_bad_inputs_are_refused():
    _, q = _experts(80, 48, 3, torch.float32)
    x, a, b, offsets = _inputs(48, 80, 4, (2, 3, 1), torch.float32)
    with pytest.raises(ValueError, match=r"x must be \(M, 48\)"):
        tgm.grouped_nf4_mm(x[:, :40], q.stack(), offsets)
    with pytest.raises(ValueError, match="a must be"):
        tgm.grouped_nf4_mm(x, q.stack(), offsets, a.transpose(1, 2), b, 1.0)
    with pytest.raises(ValueError, match="int32"):
        tgm.grouped_nf4_mm(x, q.stack(), offsets.long())
    with pytest.raises(ValueError, match="expert 1"):
        NF4Params.stacked([torch.randn(80, 48), torch.randn(48, 80)], 2)


def test_dispatch():
    _, q = _experts(80, 48, 3, torch.float32)
    x, _, _, offsets = _inputs(48, 80, 4, (2, 3, 1), torch.float32)
    with kernels.using("triton"):
        assert kernels._impl("grouped_nf4_mm", x) is tgm.grouped_nf4_mm
    with kernels.using("auto"):                       # CPU: dequantise, then the reference loop
        assert kernels._impl("grouped_nf4_mm", x) is reference.grouped_nf4_mm
        torch.testing.assert_close(kernels.grouped_nf4_mm(x, q.stack(), offsets),
                                   reference.grouped_mm(x, q.dequantize(), offsets))
