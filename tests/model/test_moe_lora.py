"""LoRA on GLM-4.5's mixture of experts: which projections a target reaches (attention, dense MLP, shared
expert, routed experts per expert), the router frozen unless asked, the adapter off = the base model,
merging = the adapted model, gradients only where they belong."""
import copy

import pytest
import torch

from glm_lora.configs.schema import LoRAConfig
from glm_lora.model import Decoder, DecoderConfig, inject_lora, lora_disabled, merge_lora
from glm_lora.model.lora import LoRAConfigError, LoRAExperts, lora_modules, lora_state_dict
from glm_lora.model.model import Experts
from glm_lora.model.quant import NF4Params

torch.set_num_threads(1)
VOCAB = 61


def moe_model(seed=0) -> Decoder:
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=24,
                        intermediate_size=40, max_seq_len=32, arch="glm4_moe", attention_bias=True, qk_norm=True,
                        n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.0)
    m = Decoder(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return m


def ids(B=2, T=9, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def randomise_b(m, std=0.2):
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, std)


def test_all_linear_reaches_attention_dense_shared_and_every_routed_expert():
    m = moe_model()
    base = copy.deepcopy(m)
    wrapped = inject_lora(m, LoRAConfig(target_modules="all-linear", r=4, alpha=8))
    assert "model.layers.0.mlp.gate_proj" in wrapped                        # the dense layer
    assert "model.layers.1.mlp.shared_experts.down_proj" in wrapped
    assert {"model.layers.2.mlp.experts.gate_proj", "model.layers.2.mlp.experts.up_proj",
            "model.layers.2.mlp.experts.down_proj"} <= set(wrapped)
    experts = m.model.layers[1].mlp.experts
    assert isinstance(experts, LoRAExperts)
    assert experts.gate_proj.lora_A.weight.shape == (6, 4, 32) and experts.down_proj.lora_B.weight.shape == (6, 32, 4)
    sd = lora_state_dict(m)
    assert "model.layers.1.mlp.experts.up_proj.lora_B.weight" in sd and not any("mlp.gate." in k for k in sd)
    assert not m.model.layers[1].mlp.gate.weight.requires_grad              # the router stays frozen
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(m(x), base(x), atol=0, rtol=0)           # B = 0: the base model
        randomise_b(m)
        adapted = m(x)
        assert (adapted - base(x)).abs().max() > 1e-2
        with lora_disabled(m):
            torch.testing.assert_close(m(x), base(x), atol=1e-6, rtol=1e-6)
        merge_lora(m)
        torch.testing.assert_close(m(x), adapted, atol=1e-5, rtol=1e-5)
    assert set(m.state_dict()) == set(base.state_dict()) and not lora_modules(m)


def test_gradients_reach_each_experts_lora_and_never_the_frozen_weights():
    m = moe_model(seed=2)
    inject_lora(m, LoRAConfig(target_modules=["experts.gate_proj", "experts.up_proj", "experts.down_proj", "q_proj"],
                              r=3, alpha=6))
    randomise_b(m)
    m.train()
    m(ids(B=4, T=12)).pow(2).mean().backward()
    grads = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    assert all("lora_" in n for n in grads)
    # every expert that saw a token got a gradient on its own slice of the stack
    a = m.model.layers[1].mlp.experts.down_proj.lora_B.weight.grad                # (E, C, r)
    assert (a.flatten(1).abs().sum(1) > 0).sum() >= 2


def test_targets_choose_shared_or_routed_experts():
    m = moe_model()
    wrapped = inject_lora(m, LoRAConfig(target_modules=["shared_experts.gate_proj"], r=2, alpha=2))
    assert wrapped == ["model.layers.1.mlp.shared_experts.gate_proj", "model.layers.2.mlp.shared_experts.gate_proj"]
    m = moe_model()
    wrapped = inject_lora(m, LoRAConfig(target_modules=["experts.gate_proj", "experts.up_proj"], r=2, alpha=2))
    assert all(".mlp.experts." in w for w in wrapped) and len(wrapped) == 4


@pytest.mark.parametrize("lora, message", [
    (LoRAConfig(target_modules=["experts.gate_proj"]), "name gate_proj and up_proj together"),
    (LoRAConfig(target_modules=["gate_up_proj"]), "lora.target_modules ['gate_up_proj'] not found in the model "
                                                  "(glm4_moe layout); supported: "),
    (LoRAConfig(target_modules="all-linear", dropout=0.1), "dropout 0.1 on the routed experts is not supported"),
])
def test_moe_targets_refused_naming_what_exists(lora, message):
    m = moe_model()
    with pytest.raises(LoRAConfigError) as e:
        inject_lora(m, lora)
    assert message in str(e.value)
    if "not found" in message:
        assert "'experts.gate_proj'" in str(e.value) and "'shared_experts.down_proj'" in str(e.value)
    assert not lora_modules(m)


def test_the_router_trains_only_when_asked():
    m = moe_model()
    inject_lora(m, LoRAConfig(target_modules=["q_proj"], r=2, alpha=2, modules_to_save=["gate"]))
    assert m.model.layers[1].mlp.gate.weight.requires_grad
    assert "model.layers.2.mlp.gate.weight" in lora_state_dict(m, ["gate"])
    assert not m.model.layers[1].mlp.gate.e_score_correction_bias.requires_grad


def test_bf16_autocast_trains_the_moe_adapter_like_fp32():
    """precision bf16 on the CPU (autocast, as on CPUs with AMX tiles) through the routed experts' grouped GEMMs:
    the same loss to bf16 rounding, gradients on every expert adapter."""
    m = moe_model(seed=5)
    inject_lora(m, LoRAConfig(target_modules="all-linear", r=4, alpha=8))
    randomise_b(m, std=0.05)
    m.train()
    x = ids(B=2, T=10)
    ref = m(x).float().pow(2).mean()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(x).float().pow(2).mean()
    loss.backward()
    assert abs(loss.item() - ref.item()) < 0.05 * ref.item()
    g = m.model.layers[2].mlp.experts.gate_proj.lora_A.weight.grad
    assert g is not None and g.dtype == torch.float32 and g.abs().sum() > 0


def _dequantised_copy(m: Decoder) -> Decoder:
    """`m` (nf4) with every 4-bit expert stack put back as the parameter it dequantises to."""
    ref = copy.deepcopy(m)
    for e in ref.modules():
        if type(e) is Experts:
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(e, name)
                delattr(e, name)
                setattr(e, name, torch.nn.Parameter(w.dequantize(), requires_grad=False))
    return ref


def test_nf4_puts_every_routed_expert_in_4_bits_and_trains_their_lora_like_the_dequantised_base():
    """QLoRA on a mixture of experts: targeted and untargeted experts alike are held in 4 bits (only the adapter
    trains and is saved); the forward, the expert LoRA's gradients, the adapter off and the merge all equal the same
    model on the dequantised experts."""
    m = moe_model(seed=3)
    full = copy.deepcopy(m)
    inject_lora(m, LoRAConfig(target_modules=["q_proj", "experts.gate_proj", "experts.up_proj"], r=4, alpha=8,
                              quantization="nf4"))
    targeted, untargeted = m.model.layers[1].mlp.experts, m.model.layers[2].mlp.experts
    assert isinstance(targeted, LoRAExperts) and isinstance(targeted.base_layer.gate_up_proj, NF4Params)
    assert isinstance(targeted.base_layer.down_proj, NF4Params)
    assert isinstance(untargeted, LoRAExperts) and isinstance(untargeted.base_layer.down_proj, NF4Params)
    assert not any(p.is_floating_point() and not p.requires_grad and p.dim() == 3 for p in m.parameters())
    assert set(lora_state_dict(m)) == {k for k, p in m.named_parameters() if p.requires_grad}
    randomise_b(m)
    ref = _dequantised_copy(m)
    x = ids(B=3, T=11)
    m.train(), ref.train()
    out, expected = m(x), ref(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert (out - full(x)).abs().max() > 1e-3                  # 4 bits are not the full-precision experts
    out.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    grads = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
    ref_grads = dict(ref.named_parameters())
    assert any(".experts.gate_proj.lora_A" in n for n in grads)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n].grad, atol=1e-5, rtol=1e-4)
    with torch.no_grad(), lora_disabled(m), lora_disabled(ref):
        torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        adapted = m(x)
        merge_lora(m)
        torch.testing.assert_close(m(x), adapted, atol=1e-5, rtol=1e-5)
    assert set(m.state_dict()) == set(full.state_dict())       # plain experts again, nothing 4-bit left
    assert m.model.layers[2].mlp.experts.gate_up_proj.dtype == torch.float32


def test_nf4_experts_refused_when_an_expert_is_not_whole_blocks():
    torch.manual_seed(0)
    m = Decoder(DecoderConfig(vocab_size=VOCAB, hidden_size=36, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=20,
                              intermediate_size=64, max_seq_len=16, arch="glm4_moe", n_routed_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=10, first_k_dense_replace=1))
    with pytest.raises(LoRAConfigError, match=r"each routed expert's weight to hold a multiple of 64 weights; not "
                                              r"\(20, 36\), \(36, 10\)"):
        inject_lora(m, LoRAConfig(target_modules=["experts.gate_proj", "experts.up_proj"], quantization="nf4"))
