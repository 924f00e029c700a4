"""Sibling LoRA linears as one op (kernels.lora_group) vs kernels.reference.lora_linear_group (each sibling
alone): outputs, dx, every dA and dB; and the model using it for q/k/v and gate/up (`model.project`)."""
import pytest
import torch

from glm_lora.kernels import ops as kernels
from glm_lora.kernels import reference
from glm_lora.kernels.lora_group import lora_linear_group
from glm_lora.model import inject_lora
from glm_lora.model.model import Decoder, DecoderConfig
from glm_lora.configs.schema import LoRAConfig
from tests.kernel_check import Tol, check, leaf

torch.set_num_threads(1)

# dtype -> (atol as a fraction of the reference's max |value|, rtol), against a float64 reference.
TOL = {torch.float32: Tol(1e-5, 1e-4, scaled=True), torch.bfloat16: Tol(2e-2, 3e-2, scaled=True)}
SCALE = 1.5
# (leading dims, in, the siblings' outs, the siblings' ranks): q/k/v-like (GQA: narrower k/v), gate/up-like,
# odd sizes, ranks that differ
SHAPES = [((2, 7), 48, (48, 16, 16), (8, 8, 8)), ((13,), 33, (70, 70), (4, 4)), ((3, 1, 5), 40, (9, 31, 2), (3, 5, 1))]


def inputs(lead, k, outs, ranks, dtype, seed=0):
    x = leaf(*lead, k, dtype=dtype, seed=seed)
    ws = [leaf(n, k, dtype=dtype, seed=seed + 1 + i, scale=k ** -0.5, requires_grad=False) for i, n in enumerate(outs)]
    As = [leaf(r, k, dtype=dtype, seed=seed + 10 + i, scale=k ** -0.5) for i, r in enumerate(ranks)]
    Bs = [leaf(n, r, dtype=dtype, seed=seed + 20 + i, scale=r ** -0.5) for i, (n, r) in enumerate(zip(outs, ranks))]
    return x, ws, As, Bs


def as_op(fn, n):
    """fn(x, weights, As, Bs, SCALE) with flat tensor arguments, as `check` calls it."""
    return lambda x, *t: fn(x, list(t[:n]), list(t[n:2 * n]), list(t[2 * n:]), SCALE)


@pytest.mark.parametrize("lead,k,outs,ranks", SHAPES)
def test_matches_reference_fp32(lead, k, outs, ranks):
    x, ws, As, Bs = inputs(lead, k, outs, ranks, torch.float32)
    n = len(outs)
    got, _ = check(as_op(lora_linear_group, n), as_op(reference.lora_linear_group, n), (x, *ws, *As, *Bs),
                   TOL[torch.float32])
    assert got[0].shape == (*lead, sum(outs))
    assert all(w.grad is None for w in ws)


@pytest.mark.parametrize("lead,k,outs,ranks", SHAPES[:2])
def test_under_bf16_autocast_matches_the_siblings_one_by_one(lead, k, outs, ranks):
    """Under CPU autocast both paths compute in bf16; the stacked one rounds dx once instead of per sibling."""
    x, ws, As, Bs = inputs(lead, k, outs, ranks, torch.float32)
    n = len(outs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = lora_linear_group(x, ws, As, Bs, SCALE).split(list(outs), dim=-1)
    want = reference.lora_linear_group(x.detach().double(), [w.double() for w in ws], [a.double() for a in As],
                                       [b.double() for b in Bs], SCALE).split(list(outs), dim=-1)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.double(), w, atol=TOL[torch.bfloat16].atol * w.abs().max().item(), rtol=3e-2)
    dys = [torch.randn_like(g) for g in got]
    dx, *dab = torch.autograd.grad(got, [x, *As, *Bs], dys)
    xr, Ar, Br = x.detach().double().requires_grad_(), [a.detach().double().requires_grad_() for a in As], \
        [b.detach().double().requires_grad_() for b in Bs]
    ref = reference.lora_linear_group(xr, [w.double() for w in ws], Ar, Br, SCALE)
    rdx, *rdab = torch.autograd.grad(ref, [xr, *Ar, *Br], torch.cat(dys, dim=-1).double())
    for g, r in zip([dx, *dab], [rdx, *rdab]):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), r, atol=3e-2 * r.abs().max().item(), rtol=5e-2)
    assert n == len(got)


def test_base_weights_must_be_frozen():
    x, ws, As, Bs = inputs((2, 3), 16, (8, 8), (2, 2), torch.float32)
    ws[1].requires_grad_(True)
    with pytest.raises(ValueError, match="freeze"):
        lora_linear_group(x, ws, As, Bs, SCALE)


def tiny_model(layout: str, bias: bool = False) -> Decoder:
    cfg = DecoderConfig(vocab_size=50, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=72, max_seq_len=32, arch=layout)
    torch.manual_seed(0)
    model = Decoder(cfg)
    inject_lora(model, LoRAConfig(r=4, alpha=8))
    for name, p in model.named_parameters():          # B non-zero: the adapters take part
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


@pytest.mark.parametrize("layout", ["llama", "qwen2", "qwen3"])
def test_model_with_stacked_siblings_matches_the_reference_backend(layout, monkeypatch):
    """The decoder's loss and every adapter gradient: stacked q/k/v and gate/up vs each projection alone."""
    from glm_lora.kernels import lora_group
    calls = []
    group = lora_group.lora_linear_group
    monkeypatch.setattr(lora_group, "lora_linear_group", lambda *a: calls.append(1) or group(*a))
    model = tiny_model(layout)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for backend in ("triton", "reference"):
        model.zero_grad(set_to_none=True)
        with kernels.using(backend):
            logits = model(ids)
        loss = logits.float().logsumexp(-1).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (l1, g1), (l2, g2) = results
    assert len(calls) == 2 * 2             # q/k/v and gate/up of both layers, on the "triton" pass only
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)
    assert g1.keys() == g2.keys() and any("q_proj.lora_A" in n for n in g1)
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], atol=1e-5, rtol=1e-4, msg=n)


def test_siblings_that_cannot_share_the_op_run_one_by_one():
    """Dropout while training, or some adapters on and some off: each projection alone."""
    from glm_lora.model.lora import LoRALinear, lora_disabled
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    mods = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = torch.randn(2, 5, 48)
    assert LoRALinear.groupable(mods)
    with lora_disabled(model):                                  # DPO's reference pass: the stacked base alone
        assert LoRALinear.groupable(mods)
        base = LoRALinear.project_group(x, mods)
        torch.testing.assert_close(base, torch.cat([torch.nn.functional.linear(x, m.weight, m.bias) for m in mods], -1))
    attn.k_proj.enabled = False
    assert not LoRALinear.groupable(mods)
    attn.k_proj.enabled = True
    attn.k_proj.dropout = 0.1
    assert not LoRALinear.groupable(mods)                       # training (Decoder's default mode)
    model.eval()
    assert LoRALinear.groupable(mods)


@pytest.mark.parametrize("layout", ["llama", "qwen2"])
@pytest.mark.parametrize("adapter", ["none", "disabled"])
def test_plain_siblings_stacked_match_one_by_one(layout, adapter, monkeypatch):
    """Pretraining (plain linears, every weight trained) and the adapter-off pass: stacked vs one by one."""
    from glm_lora.model.lora import lora_disabled
    calls = []
    stacked = kernels.stacked_linear
    monkeypatch.setattr(kernels, "stacked_linear", lambda *a: calls.append(1) or stacked(*a))
    model = tiny_model(layout) if adapter == "disabled" else Decoder(
        DecoderConfig(vocab_size=50, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=72, max_seq_len=32, arch=layout))
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for backend in ("triton", "reference"):
        model.zero_grad(set_to_none=True)
        with kernels.using(backend):
            if adapter == "disabled":
                with lora_disabled(model), torch.no_grad():
                    results.append((model(ids), {}))
                continue
            loss = model(ids).float().logsumexp(-1).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l1, g1), (l2, g2) = results
    assert len(calls) == 2 * 2             # q/k/v and gate/up of both layers, on the "triton" pass only
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)
    assert adapter == "disabled" or "model.layers.0.self_attn.q_proj.weight" in g1
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], atol=1e-5, rtol=1e-4, msg=n)


def test_stack_rows_is_a_view_only_of_consecutive_row_blocks():
    from glm_lora.kernels.lora_group import stack_rows
    base = torch.arange(60.0).view(10, 6)
    blocks = list(base.split([4, 2, 4]))
    stacked = stack_rows(blocks)
    assert stacked.data_ptr() == base.data_ptr() and torch.equal(stacked, base)
    for other in (blocks[::-1], [blocks[0], blocks[2]], [b.clone() for b in blocks]):   # out of order, a gap, apart
        out = stack_rows(other)
        assert out.data_ptr() != base.data_ptr() and torch.equal(out, torch.cat(other))
    half = stack_rows(blocks, torch.bfloat16)                    # another dtype: a cast copy
    assert half.dtype == torch.bfloat16 and torch.equal(half, base.to(torch.bfloat16))


def test_frozen_siblings_share_one_storage_and_train_and_save_as_before(tmp_path):
    """cast_frozen_gemm_weights (a LoRA stage on the GPU) lays q/k/v and gate/up out as row blocks of one tensor:
    the stacked op then takes a view of them, the loss and every adapter gradient are unchanged, and the merged
    model still saves (safetensors refuses tensors that share memory)."""
    from glm_lora.kernels.lora_group import stack_rows
    from glm_lora.model.hf import save_hf
    from glm_lora.model.lora import cast_frozen_gemm_weights, merge_lora
    from safetensors.torch import load_file
    model = tiny_model("qwen2")
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        with kernels.using("triton"):
            loss = model(ids).float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    before = loss_and_grads()
    cast_frozen_gemm_weights(model, torch.float32)
    groups = [[l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj] for l in model.model.layers]
    groups += [[l.mlp.gate_proj, l.mlp.up_proj] for l in model.model.layers]
    for mods in groups:
        assert stack_rows([m.weight for m in mods]).data_ptr() == mods[0].weight.data_ptr()
        assert all(not m.weight.requires_grad for m in mods)
    after = loss_and_grads()
    assert torch.equal(before[0], after[0]) and before[1].keys() == after[1].keys()
    for n in before[1]:
        assert torch.equal(before[1][n], after[1][n]), n
    merged_q = groups[0][0].merged_weight()
    save_hf(merge_lora(model), tmp_path, bos_id=1, eos_id=2, pad_id=0)
    saved = load_file(tmp_path / "model.safetensors")
    assert torch.equal(saved["model.layers.0.self_attn.q_proj.weight"], merged_q)
