"""Triton fused linear + loss heads vs kernels.reference: forward and every gradient (interpreter on CPU)."""
import pytest
import torch

from glm_lora.kernels import reference as ref
from glm_lora.kernels import triton_linear_loss as tll
from tests.kernel_check import close, leaf

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

# dtype -> (atol, rtol) for loss/logprobs, and for gradients. The op and the reference run in the same
# dtype; half-precision logits/gradients round differently when chunked, so gradients get ~1 ulp of slack.
TOL = {
    torch.float32: dict(out=(1e-4, 1e-5), grad=(1e-5, 1e-4)),
    torch.float16: dict(out=(2e-3, 1e-4), grad=(4e-3, 4e-3)),
    torch.float64: dict(out=(1e-10, 1e-12), grad=(1e-12, 1e-10)),
}
AUTOCAST_TOL = dict(out=(2e-3, 1e-4), grad=(4e-2, 2e-2))   # fp32 leaves under bf16 autocast
N, C, V = 37, 40, 1003       # odd sizes: rows not a multiple of the chunk, vocab not a power of two
CHUNK = 8


@pytest.fixture(autouse=True)
def small_vocab_block(monkeypatch):
    """Several vocab blocks per row (the last one partial), so the online softmax is exercised."""
    monkeypatch.setattr(tll, "_MAX_BLOCK_V", 256)


def make_labels(shape, seed, ignored=0.3):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < ignored] = -100
    labels.view(-1)[0] = V - 1      # the last (masked-block) column is a target somewhere
    return labels


def grads_or_none(out, inputs, g):
    wanted = [t for t in inputs if t.requires_grad]
    got = iter(torch.autograd.grad(out, wanted, g))
    return [next(got) if t.requires_grad else None for t in inputs]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("hidden_grad,weight_grad", [(True, True), (True, False), (False, True)])
def test_cross_entropy_matches_reference(dtype, hidden_grad, weight_grad):
    h = leaf(N, C, dtype=dtype, seed=1, requires_grad=hidden_grad)
    w = leaf(V, C, dtype=dtype, seed=2, scale=0.3, requires_grad=weight_grad)
    labels = make_labels((N,), seed=3)
    g = torch.tensor(0.7)           # upstream gradient of loss_sum, e.g. 1 / count

    loss, count = tll.linear_cross_entropy(h, w, labels, chunk_size=CHUNK)
    ref_loss, ref_count = ref.linear_cross_entropy(h, w, labels)
    close(loss, ref_loss, TOL[dtype]["out"])
    assert count.dtype == torch.long and count.item() == ref_count.item() == (labels != -100).sum().item()
    assert loss.item() > 0

    got = grads_or_none(loss, (h, w), g.to(loss.dtype))
    want = grads_or_none(ref_loss, (h, w), g.to(ref_loss.dtype))
    for a, b in zip(got, want):
        if b is None:
            assert a is None
        else:
            assert a.dtype == b.dtype and a.abs().sum() > 0
            close(a, b, TOL[dtype]["grad"])
    if hidden_grad:
        ignored = labels == -100
        assert got[0][ignored].abs().max() == 0 and got[0][~ignored].abs().amax(-1).min() > 0


def test_cross_entropy_detects_wrong_label():
    h = leaf(N, C, dtype=torch.float32, seed=1)
    w = leaf(V, C, dtype=torch.float32, seed=2, scale=0.3)
    labels = make_labels((N,), seed=3)
    loss, _ = tll.linear_cross_entropy(h, w, labels, chunk_size=CHUNK)
    shifted = labels.clone()
    shifted[labels >= 0] = (labels[labels >= 0] + 1) % V
    other, _ = tll.linear_cross_entropy(h, w, shifted, chunk_size=CHUNK)
    assert (loss - other).abs() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cross_entropy_all_ignored(dtype):
    h = leaf(N, C, dtype=dtype, seed=1)
    w = leaf(V, C, dtype=dtype, seed=2, scale=0.3)
    labels = torch.full((N,), -100)
    loss, count = tll.linear_cross_entropy(h, w, labels, chunk_size=CHUNK)
    assert loss.item() == 0 and count.item() == 0
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert gh.abs().max() == 0 and gw.abs().max() == 0


def test_cross_entropy_custom_ignore_index_and_default_config(monkeypatch):
    monkeypatch.setattr(tll, "_MAX_BLOCK_V", 8192)      # the production block: one vocab block per row
    h = leaf(N, C, dtype=torch.float32, seed=4)
    w = leaf(V, C, dtype=torch.float32, seed=5, scale=0.3)
    labels = make_labels((N,), seed=6)
    labels[labels == -100] = 7
    loss, count = tll.linear_cross_entropy(h, w, labels, ignore_index=7)            # default chunking
    ref_loss, ref_count = ref.linear_cross_entropy(h, w, labels, ignore_index=7)
    close(loss, ref_loss, TOL[torch.float32]["out"])
    assert count.item() == ref_count.item() < N
    for a, b in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref_loss, (h, w))):
        close(a, b, TOL[torch.float32]["grad"])


def test_cross_entropy_no_grad_and_noncontiguous():
    h = leaf(N, 2 * C, dtype=torch.float32, seed=1)[:, ::2]       # strided rows and columns
    w = leaf(V, C, dtype=torch.float32, seed=2, scale=0.3)
    labels = make_labels((2 * N,), seed=3)[::2]
    with torch.no_grad():
        loss, _ = tll.linear_cross_entropy(h, w, labels, chunk_size=CHUNK)
        ref_loss, _ = ref.linear_cross_entropy(h, w, labels)
    assert not loss.requires_grad
    close(loss, ref_loss, TOL[torch.float32]["out"])


def test_cross_entropy_under_autocast():
    """The training path: fp32 leaves, bf16 autocast → bf16 logits, fp32 softmax, fp32 gradients."""
    h = leaf(N, C, dtype=torch.float32, seed=1)
    w = leaf(V, C, dtype=torch.float32, seed=2, scale=0.3)
    labels = make_labels((N,), seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = tll.linear_cross_entropy(h, w, labels, chunk_size=CHUNK)
        ref_loss, _ = ref.linear_cross_entropy(h, w, labels)
    close(loss, ref_loss, AUTOCAST_TOL["out"])
    for a, b in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref_loss, (h, w))):
        close(a, b, AUTOCAST_TOL["grad"])


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("weight_grad", [True, False])
def test_token_logprobs_matches_reference(dtype, weight_grad):
    B, T = 3, 13
    full = leaf(B, T + 1, C, dtype=dtype, seed=1)
    h = full[:, :-1]                                        # non-contiguous, as in engine.losses
    w = leaf(V, C, dtype=dtype, seed=2, scale=0.3, requires_grad=weight_grad)
    labels = make_labels((B, T), seed=3)
    labels[1] = -100                                         # one fully ignored row
    out = tll.linear_token_logprobs(h, w, labels, chunk_size=CHUNK)
    want = ref.linear_token_logprobs(h, w, labels)
    close(out, want, TOL[dtype]["out"])
    assert (out[labels == -100] == 0).all() and (out[labels != -100] < 0).all()

    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    got = grads_or_none(out, (full, w), g)
    exp = grads_or_none(want, (full, w), g)
    for a, b in zip(got, exp):
        if b is None:
            assert a is None
        else:
            assert a.abs().sum() > 0
            close(a, b, TOL[dtype]["grad"])
    assert got[0][1].abs().max() == 0 and got[0][:, -1].abs().max() == 0


def test_token_logprobs_hidden_frozen_and_all_ignored():
    h = leaf(2, 9, C, dtype=torch.float32, seed=1, requires_grad=False)
    w = leaf(V, C, dtype=torch.float32, seed=2, scale=0.3)
    labels = torch.full((2, 9), -100)
    out = tll.linear_token_logprobs(h, w, labels, chunk_size=CHUNK)
    assert out.shape == (2, 9) and out.abs().max() == 0
    (gw,) = torch.autograd.grad(out, (w,), torch.ones_like(out))
    assert gw.abs().max() == 0

    labels = make_labels((2, 9), seed=4)
    out = tll.linear_token_logprobs(h, w, labels, chunk_size=CHUNK)
    want = ref.linear_token_logprobs(h, w, labels)
    close(out, want, TOL[torch.float32]["out"])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    close(torch.autograd.grad(out, (w,), g)[0], torch.autograd.grad(want, (w,), g)[0], TOL[torch.float32]["grad"])


def test_token_logprobs_under_autocast_and_no_grad():
    full = leaf(2, 10, C, dtype=torch.float32, seed=1)
    w = leaf(V, C, dtype=torch.float32, seed=2, scale=0.3, requires_grad=False)
    labels = make_labels((2, 9), seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tll.linear_token_logprobs(full[:, :-1], w, labels, chunk_size=CHUNK)
        want = ref.linear_token_logprobs(full[:, :-1], w, labels)
        with torch.no_grad():                    # DPO's reference-policy pass
            frozen = tll.linear_token_logprobs(full[:, :-1], w, labels, chunk_size=CHUNK)
    assert not frozen.requires_grad and torch.equal(frozen, out.detach())
    close(out, want, AUTOCAST_TOL["out"])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    close(torch.autograd.grad(out, full, g)[0], torch.autograd.grad(want, full, g)[0], AUTOCAST_TOL["grad"])
