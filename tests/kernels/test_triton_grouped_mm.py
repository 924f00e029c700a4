"""The MoE grouped GEMM (kernels.triton_grouped_mm) vs the per-group loop of kernels.reference: grouped_mm
(forward, dx, dW when W trains) and grouped_lora_mm (forward, dx, dA, dB; W frozen gets nothing). Triton
interpreter on CPU: odd sizes that cut every 32/64-wide interpreter tile, empty groups, one-row groups,
all rows in one group; the weight-gradient kernel's row split; offsets validation."""
import pytest
import torch

from glm_lora.kernels import ops as kernels
from glm_lora.kernels import reference
from glm_lora.kernels import triton_grouped_mm as tgm
from tests.kernel_check import Tol, check

torch.set_num_threads(1)

TOL = {torch.float32: Tol(1e-5, 1e-4, scaled=True), torch.float16: Tol(4e-3, 1e-2, scaled=True)}
DTYPES = list(TOL)
# (K, N, r, rows per group): one empty group and a 1-row group; all rows in one group (the others empty);
# groups of 1 row; none of K, N, M a multiple of the interpreter tiles
SHAPES = {"skewed": (48, 80, 6, (10, 0, 10, 16, 1)),
          "one_group": (40, 24, 16, (0, 33, 0)),
          "single_rows": (20, 36, 3, (1, 1, 0, 1, 1, 0))}


def _inputs(k, n, r, counts, dtype, seed=0, w_grad=False):
    """x (M, k), w (G, n, k), a (G, r, k), b (G, n, r), offsets (G,) int32: one float64 stream, rounded."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, std=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * std).to(dtype)   # noqa: E731
    G, M = len(counts), sum(counts)
    x = rnd(M, k).requires_grad_(True)
    w = rnd(G, n, k, std=k ** -0.5).requires_grad_(w_grad)
    a = rnd(G, r, k, std=k ** -0.5).requires_grad_(True)
    b = rnd(G, n, r, std=r ** -0.5).requires_grad_(True)
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return x, w, a, b, offsets


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("w_grad", [True, False], ids=["w_trains", "w_frozen"])
def test_grouped_mm_matches_reference(shape, dtype, w_grad, monkeypatch):
    k, n, _, counts = SHAPES[shape]
    x, w, _, _, offsets = _inputs(k, n, 4, counts, dtype, w_grad=w_grad)
    wgrads = []
    monkeypatch.setattr(tgm, "grouped_wgrad", lambda *args: wgrads.append(args[0].shape) or _WGRAD(*args))
    check(lambda x, w: tgm.grouped_mm(x, w, offsets), lambda x, w: reference.grouped_mm(x, w, offsets),
          [x, w], TOL[dtype])
    assert wgrads == ([x.shape[:1] + (n,)] if w_grad else [])          # dW computed only for a trainable W


_WGRAD = tgm.grouped_wgrad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_grouped_lora_mm_matches_reference(shape, dtype, monkeypatch):
    k, n, r, counts = SHAPES[shape]
    x, w, a, b, offsets = _inputs(k, n, r, counts, dtype, seed=1)
    gemms, wgrads = [], []
    monkeypatch.setattr(tgm, "grouped_gemm", lambda *args, **kw: gemms.append((args[1].shape[-1], "p" in kw))
                        or _GEMM(*args, **kw))
    monkeypatch.setattr(tgm, "grouped_wgrad", lambda *args: wgrads.append(tuple(args[i].shape[1] for i in (0, 1)))
                        or _WGRAD(*args))
    check(lambda x, a, b: tgm.grouped_lora_mm(x, w, a, b, 1.5, offsets),
          lambda x, a, b: reference.grouped_lora_mm(x, w.to(x.dtype), a, b, 1.5, offsets), [x, a, b], TOL[dtype])
    # forward: x Aᵀ, then the base GEMM with the rank-r term folded in; backward: dy B, then dx folded the same
    # way; dA, dB by the weight-gradient kernel, no dW for the frozen base
    assert gemms == [(r, False), (n, True), (r, False), (k, True)]
    assert wgrads == [(r, k), (n, r)]


_GEMM = tgm.grouped_gemm


def test_the_lora_term_is_really_added():
    x, w, a, b, offsets = _inputs(48, 80, 6, (10, 0, 10, 16, 1), torch.float32)
    base = tgm.grouped_mm(x, w, offsets)
    torch.testing.assert_close(tgm.grouped_lora_mm(x, w, a, b, 0.0, offsets), base)
    assert not torch.allclose(tgm.grouped_lora_mm(x, w, a, b, 2.0, offsets), base, atol=1e-3)


@pytest.mark.parametrize("split", [2, 3])
def test_weight_gradients_split_over_rows_match(split, monkeypatch):
    monkeypatch.setattr(tgm, "WGRAD_SPLIT", split)
    x, w, a, b, offsets = _inputs(48, 80, 6, (70, 0, 3, 33), torch.float32, seed=2, w_grad=True)
    check(lambda x, w, a, b: tgm.grouped_lora_mm(x, w, a, b, 0.5, offsets),
          lambda x, w, a, b: reference.grouped_lora_mm(x, w, a, b, 0.5, offsets), [x, w, a, b], TOL[torch.float32])


def test_strided_inputs_need_no_copy():
    x, w, _, _, offsets = _inputs(96, 80, 4, (5, 20, 12), torch.float32, seed=3)
    xs, ws = x.detach()[:, ::2], w.detach().transpose(1, 2).contiguous().transpose(1, 2)[:, :, ::2]   # (M, 48), (G, 80, 48)
    torch.testing.assert_close(tgm.grouped_mm(xs, ws, offsets), reference.grouped_mm(xs, ws, offsets))


def test_all_groups_empty():
    w = torch.randn(3, 24, 40, requires_grad=True)
    x = torch.zeros(0, 40, requires_grad=True)
    y = tgm.grouped_mm(x, w, torch.zeros(3, dtype=torch.int32))
    assert y.shape == (0, 24)
    (dw,) = torch.autograd.grad(y, [w], torch.zeros(0, 24))
    assert dw.shape == w.shape and not dw.any()


@pytest.mark.parametrize("op", [tgm.grouped_mm, reference.grouped_mm], ids=["triton", "reference"])
@pytest.mark.parametrize("offsets,match", [
    (torch.tensor([3, 5, 9], dtype=torch.int64), "int32"),
    (torch.tensor([3, 9], dtype=torch.int32), r"\(G,\)"),
    (torch.tensor([3, 5, 8], dtype=torch.int32), "end at M"),
    (torch.tensor([5, 3, 9], dtype=torch.int32), "non-decreasing"),
    (torch.tensor([-1, 3, 9], dtype=torch.int32), "non-decreasing"),
])
def test_bad_offsets_are_refused(op, offsets, match):
    x, w = torch.randn(9, 16), torch.randn(3, 8, 16)
    with pytest.raises(ValueError, match=match):
        op(x, w, offsets)


def test_bad_shapes_are_refused():
    x, w, a, b, offsets = _inputs(16, 8, 4, (2, 3), torch.float32)
    with pytest.raises(ValueError, match="x must be"):
        tgm.grouped_mm(x, w.transpose(1, 2), offsets)
    with pytest.raises(ValueError, match="dtype"):
        tgm.grouped_mm(x, w.half(), offsets)
    with pytest.raises(ValueError, match="grouped_lora_mm"):
        tgm.grouped_lora_mm(x, w, a, b.transpose(1, 2), 1.0, offsets)


def test_dispatch():
    x, w, _, _, offsets = _inputs(16, 8, 4, (2, 3), torch.float32)
    with kernels.using("triton"):
        assert kernels._impl("grouped_mm", x) is tgm.grouped_mm
        assert kernels._impl("grouped_lora_mm", x) is tgm.grouped_lora_mm
    with kernels.using("auto"):                       # CPU: the reference loop
        assert kernels._impl("grouped_mm", x) is reference.grouped_mm
        torch.testing.assert_close(kernels.grouped_mm(x, w, offsets), reference.grouped_mm(x, w, offsets))
    assert not tgm.torch_grouped_mm_supported(x, w)   # torch._grouped_mm's fast kernel: bf16 on sm90+ only
