"""Triton RoPE vs the torch reference: forward and q/k gradients (interpreter on CPU)."""
import pytest
import torch

from glm_lora.kernels.triton_rope import apply_rope
from tests.kernel_check import check_rope, rope_projection, rope_tables

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

# dtype -> (atol, rtol) against the reference run on float64 copies (tables cast to dtype first,
# as the reference does). The kernel rounds once, so half precision is held to ~1 ulp.
TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-4, 1e-3)}
DTYPES = list(TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, H, Hkv, T, D", [(2, 4, 2, 7, 16), (1, 3, 3, 11, 6), (2, 5, 1, 3, 128)])
def test_rope_matches_reference_on_transposed_views(B, H, Hkv, T, D, dtype):
    q, k = rope_projection(B, T, H, D, dtype, seed=1), rope_projection(B, T, Hkv, D, dtype, seed=2)
    assert not q.is_contiguous()
    check_rope(apply_rope, q, k, *rope_tables(B, T, D), TOL[dtype])


def test_rope_contiguous_inputs():
    B, H, Hkv, T, D = 2, 4, 2, 5, 32
    q, k = (rope_projection(B, T, h, D, torch.float32, seed=s).detach().contiguous().requires_grad_(True)
            for h, s in ((H, 3), (Hkv, 4)))
    check_rope(apply_rope, q, k, *rope_tables(B, T, D), TOL[torch.float32])


def test_rope_slices_of_fused_qkv_projection():
    # Not dense (q and k are slices of one q/k/v output): the outputs are dense, heads-last.
    B, H, Hkv, T, D = 2, 4, 2, 5, 16
    qkv = torch.randn(B, T, H + 2 * Hkv, D, generator=torch.Generator().manual_seed(10))
    q = qkv[:, :, :H].transpose(1, 2).requires_grad_(True)
    k = qkv[:, :, H:H + Hkv].transpose(1, 2).requires_grad_(True)
    check_rope(apply_rope, q, k, *rope_tables(B, T, D), TOL[torch.float32])


def test_rope_broadcast_tables_over_batch():
    B, H, Hkv, T, D = 3, 2, 1, 4, 8
    q, k = rope_projection(B, T, H, D, torch.float32, seed=5), rope_projection(B, T, Hkv, D, torch.float32, seed=6)
    cos, sin = rope_tables(1, T, D)
    check_rope(apply_rope, q, k, cos, sin, TOL[torch.float32])


def test_rope_arbitrary_tables():
    # Halves that differ (not the HF layout) catch swapped halves and a backward that only
    # negates sin instead of transposing the rotation.
    B, H, Hkv, T, D = 2, 3, 2, 4, 10
    q, k = rope_projection(B, T, H, D, torch.float32, seed=7), rope_projection(B, T, Hkv, D, torch.float32, seed=8)
    gen = torch.Generator().manual_seed(9)
    cos, sin = torch.randn(B, T, D, generator=gen), torch.randn(B, T, D, generator=gen)
    check_rope(apply_rope, q, k, cos, sin, TOL[torch.float32])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("D, R", [(16, 16), (16, 8), (10, 4), (6, 2)])
def test_rope_glm_layouts(D, R, interleaved):
    # GLM: interleaved pairs, over the first R dims of each head (partial rotary); the rest pass through.
    B, H, Hkv, T = 2, 3, 1, 5
    q, k = rope_projection(B, T, H, D, torch.float32, seed=11), rope_projection(B, T, Hkv, D, torch.float32, seed=12)
    check_rope(apply_rope, q, k, *rope_tables(B, T, R, interleaved=interleaved), TOL[torch.float32],
               interleaved=interleaved)


def test_rope_interleaved_arbitrary_tables():
    # Table entries that differ within a pair catch a kernel reading the halves' indices when interleaved.
    B, H, Hkv, T, D, R = 2, 2, 2, 3, 12, 8
    q, k = rope_projection(B, T, H, D, torch.float32, seed=13), rope_projection(B, T, Hkv, D, torch.float32, seed=14)
    gen = torch.Generator().manual_seed(15)
    cos, sin = torch.randn(B, T, R, generator=gen), torch.randn(B, T, R, generator=gen)
    check_rope(apply_rope, q, k, cos, sin, TOL[torch.float32], interleaved=True)


@pytest.mark.parametrize("interleaved, R", [(False, 16), (False, 8), (True, 8)])
def test_rope_heads_split_over_programs(monkeypatch, interleaved, R):
    # Wide heads × dims (GLM-4-9B: 32 × 128) are split into blocks of heads, one program each: here blocks of
    # 2 heads of 16 dims, q's 5 heads in three (the last one ragged) and k's 3 in two.
    import glm_lora.kernels.triton_rope as triton_rope
    monkeypatch.setattr(triton_rope, "HEAD_TILE", 32)
    B, H, Hkv, T, D = 2, 5, 3, 4, 16
    q, k = rope_projection(B, T, H, D, torch.float32, seed=16), rope_projection(B, T, Hkv, D, torch.float32, seed=17)
    gen = torch.Generator().manual_seed(18)
    cos, sin = torch.randn(B, T, R, generator=gen), torch.randn(B, T, R, generator=gen)
    check_rope(apply_rope, q, k, cos, sin, TOL[torch.float32], interleaved=interleaved)


def test_rope_rejects_bad_shapes():
    q, k = torch.ones(1, 2, 3, 6), torch.ones(1, 1, 4, 6)
    cos = sin = torch.ones(1, 3, 6)
    with pytest.raises(ValueError):
        apply_rope(q, k, cos, sin)
    with pytest.raises(ValueError):
        apply_rope(torch.ones(1, 2, 3, 5), torch.ones(1, 1, 3, 5), torch.ones(1, 3, 5), torch.ones(1, 3, 5))
    with pytest.raises(ValueError):        # tables wider than the head
        apply_rope(torch.ones(1, 2, 3, 4), torch.ones(1, 1, 3, 4), torch.ones(1, 3, 6), torch.ones(1, 3, 6))
    with pytest.raises(ValueError):        # an odd rotary width
        apply_rope(torch.ones(1, 2, 3, 6), torch.ones(1, 1, 3, 6), torch.ones(1, 3, 3), torch.ones(1, 3, 3))
