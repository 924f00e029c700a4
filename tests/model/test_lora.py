"""model/lora.py: inject / disable / merge / save, checked against the frozen base model."""
import copy

import pytest
import torch
import torch.nn as nn

from glm_lora.model import Decoder, DecoderConfig, inject_lora, load_lora_state_dict, lora_disabled, lora_state_dict, merge_lora
from glm_lora.model.lora import LoRALinear, linear_names, lora_modules
from glm_lora.configs.schema import LoRAConfig

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

VOCAB = 199
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny(seed=0, tie=False) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(DecoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=48, max_seq_len=32, tie_embeddings=tie)).eval()


def ids(seed=1):
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


def randomise_b(model, seed=3, std=0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * std)


def test_inject_freezes_base_and_only_lora_trains():
    m = tiny()
    wrapped = inject_lora(m, LoRAConfig(target_modules=["q_proj", "v_proj", "down_proj"], r=4, alpha=8))
    assert wrapped == [f"model.layers.{i}.{p}" for i in range(2)
                       for p in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == {f"{w}.lora_{ab}.weight" for w in wrapped for ab in "AB"}
    assert isinstance(m.model.layers[0].self_attn.q_proj, LoRALinear)
    assert isinstance(m.model.layers[0].self_attn.k_proj, nn.Linear)
    assert m.model.layers[1].mlp.down_proj.lora_A.weight.shape == (4, 48)
    assert m.model.layers[1].mlp.down_proj.lora_B.weight.shape == (32, 4)
    assert m.model.layers[1].mlp.down_proj.scale == 2.0
    assert m.num_params(trainable_only=True) == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4 + 4 * 48 + 32 * 4)


def test_backward_reaches_only_adapter():
    m = tiny()
    inject_lora(m, LoRAConfig(target_modules=ALL, r=2, alpha=2))
    randomise_b(m)
    m(ids()).sum().backward()
    for n, p in m.named_parameters():
        if "lora_" in n:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n


def test_unknown_target_names_available_linears():
    m = tiny()
    with pytest.raises(ValueError) as e:
        inject_lora(m, LoRAConfig.model_construct(target_modules=["q_proj", "qkv_proj", "lm_head"], r=2, alpha=2))   # past the schema: the model checks too
    msg = str(e.value)
    assert "'qkv_proj'" in msg and "'lm_head'" in msg      # lm_head is never a target
    for name in ALL:
        assert name in msg
    assert all(p.requires_grad for p in m.parameters())     # failed call left the model untouched
    assert not lora_modules(m)


def test_zero_b_output_equals_base():
    m = tiny()
    base = copy.deepcopy(m)
    inject_lora(m, LoRAConfig(target_modules=ALL, r=4, alpha=16))
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(m(x), base(x), atol=0, rtol=0)


@pytest.mark.parametrize("tie", [False, True])
def test_merge_equals_unmerged(tie):
    m = tiny(tie=tie)
    base = copy.deepcopy(m)
    inject_lora(m, LoRAConfig(target_modules=["q_proj", "k_proj", "o_proj", "up_proj"], r=4, alpha=12))
    randomise_b(m)
    x = ids()
    with torch.no_grad():
        unmerged = m(x)
        assert not torch.allclose(unmerged, base(x), atol=1e-3)     # the adapter really does something
        merge_lora(m)
        merged = m(x)
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)
    assert not lora_modules(m)
    assert type(m.model.layers[0].self_attn.q_proj) is nn.Linear
    assert set(m.state_dict()) == set(base.state_dict())
    layer = m.model.layers[1].mlp.up_proj
    assert layer.weight.shape == (48, 32) and not layer.weight.requires_grad


def test_merged_weight_formula():
    lin = nn.Linear(6, 5, bias=False)
    lora = LoRALinear(lin, r=3, alpha=6)
    with torch.no_grad():
        lora.lora_B.weight.normal_()
    expected = lin.weight + 2.0 * lora.lora_B.weight @ lora.lora_A.weight
    torch.testing.assert_close(lora.merged_weight(), expected)
    x = torch.randn(4, 6)
    torch.testing.assert_close(lora(x), x @ expected.T, atol=1e-6, rtol=1e-5)


def test_lora_disabled_gives_base_and_restores():
    m = tiny()
    base = copy.deepcopy(m)
    inject_lora(m, LoRAConfig(target_modules=ALL, r=4, alpha=8))
    randomise_b(m)
    x = ids()
    with torch.no_grad():
        adapted = m(x)
        with lora_disabled(m) as same:
            assert same is m
            torch.testing.assert_close(m(x), base(x), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(m(x), adapted, atol=0, rtol=0)
        with pytest.raises(RuntimeError):
            with lora_disabled(m):
                raise RuntimeError("boom")
        assert all(mod.enabled for mod in lora_modules(m).values())
        torch.testing.assert_close(m(x), adapted, atol=0, rtol=0)


def test_state_dict_round_trip():
    m = tiny()
    inject_lora(m, LoRAConfig(target_modules=["q_proj", "gate_proj"], r=3, alpha=6))
    randomise_b(m)
    sd = lora_state_dict(m)
    assert set(sd) == {f"model.layers.{i}.{p}.lora_{ab}.weight" for i in range(2)
                       for p in ("self_attn.q_proj", "mlp.gate_proj") for ab in "AB"}
    assert all(not t.requires_grad for t in sd.values())

    other = tiny(seed=0)        # same base weights, fresh adapter (random A, zero B)
    inject_lora(other, LoRAConfig(target_modules=["q_proj", "gate_proj"], r=3, alpha=6))
    x = ids()
    with torch.no_grad():
        assert not torch.allclose(other(x), m(x))
        load_lora_state_dict(other, sd)
        torch.testing.assert_close(other(x), m(x), atol=0, rtol=0)


def test_load_state_dict_mismatch_names_keys():
    m = tiny()
    inject_lora(m, LoRAConfig(target_modules=["q_proj", "v_proj"], r=2, alpha=2))
    sd = lora_state_dict(m)
    missing = dict(sd)
    del missing["model.layers.1.self_attn.v_proj.lora_B.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.v_proj.lora_B.weight'\]"):
        load_lora_state_dict(m, missing)
    extra = {**sd, "model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(2, 32)}
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.mlp.up_proj.lora_A.weight'\]"):
        load_lora_state_dict(m, extra)
    wrong_shape = {**sd, "model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(5, 32)}
    with pytest.raises(ValueError, match=r"q_proj.lora_A.weight: shape \(5, 32\)"):
        load_lora_state_dict(m, wrong_shape)


def test_modules_to_save_train_in_full_and_travel_with_the_adapter():
    m = tiny()
    inject_lora(m, LoRAConfig(target_modules=["q_proj"], r=2, alpha=2, modules_to_save=["embed_tokens", "lm_head"]))
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == {"model.embed_tokens.weight", "lm_head.weight"} | {
        f"model.layers.{i}.self_attn.q_proj.lora_{ab}.weight" for i in range(2) for ab in "AB"}
    with torch.no_grad():
        m.model.embed_tokens.weight.add_(0.5)
        m.lm_head.weight.mul_(-1)
    sd = lora_state_dict(m, ["embed_tokens", "lm_head"])
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(sd)
    other = tiny()
    inject_lora(other, LoRAConfig(target_modules=["q_proj"], r=2, alpha=2, modules_to_save=["embed_tokens", "lm_head"]))
    with pytest.raises(ValueError, match="unexpected"):     # saved without declaring them: refused
        load_lora_state_dict(tiny_with(["q_proj"]), sd)
    load_lora_state_dict(other, sd, ["embed_tokens", "lm_head"])
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(merge_lora(other)(x), merge_lora(m)(x), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"modules_to_save \['norm_x'\]"):
        inject_lora(tiny(), LoRAConfig.model_construct(target_modules=["q_proj"], r=2, alpha=2, modules_to_save=["norm_x"]))


def tiny_with(targets):
    m = tiny()
    inject_lora(m, LoRAConfig(target_modules=targets, r=2, alpha=2))
    return m


# ---------------------------------------------------------------- every layout: "all-linear", fused gate_up, q/k/v bias

LAYOUT_PROJECTIONS = {
    "llama": ALL, "qwen2": ALL, "qwen3": ALL,
    "glm": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"],
    "glm4": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"],
}


def tiny_arch(arch, seed=0) -> Decoder:
    torch.manual_seed(seed)
    m = Decoder(DecoderConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                              intermediate_size=48, max_seq_len=32, arch=arch)).eval()
    with torch.no_grad():        # biases start at 0: make them matter
        for n, p in m.named_parameters():
            if n.endswith(".bias"):
                p.normal_(std=0.3)
    return m


@pytest.mark.parametrize("arch", list(LAYOUT_PROJECTIONS))
def test_all_linear_wraps_every_projection_of_the_layout(arch):
    m = tiny_arch(arch)
    base = copy.deepcopy(m)
    wrapped = inject_lora(m, LoRAConfig(target_modules="all-linear", r=4, alpha=8))
    assert sorted({w.rsplit(".", 1)[-1] for w in wrapped}) == sorted(LAYOUT_PROJECTIONS[arch])
    assert len(wrapped) == 2 * len(LAYOUT_PROJECTIONS[arch])
    assert not any("lm_head" in w for w in wrapped)
    if arch.startswith("glm"):
        fused = m.model.layers[0].mlp.gate_up_proj
        assert fused.lora_B.weight.shape == (96, 4) and fused.lora_A.weight.shape == (4, 64)
    biased = [n for n, p in m.named_parameters() if n.endswith(".bias")]
    assert bool(biased) is (arch in ("qwen2", "glm", "glm4"))
    assert all(not p.requires_grad for n, p in m.named_parameters() if "lora_" not in n)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(m(x), base(x), atol=0, rtol=0)     # B = 0: the base model, bias included
        randomise_b(m)
        adapted = m(x)
        assert not torch.allclose(adapted, base(x), atol=1e-3)
        with lora_disabled(m):
            torch.testing.assert_close(m(x), base(x), atol=1e-6, rtol=1e-6)
        merge_lora(m)
        torch.testing.assert_close(m(x), adapted, atol=1e-5, rtol=1e-5)
    assert set(m.state_dict()) == set(base.state_dict())          # biases survive the merge


@pytest.mark.parametrize("arch, targets, bad", [("glm4", ["q_proj", "gate_proj"], ["gate_proj"]),
                                                ("glm", ["up_proj", "down_proj"], ["up_proj"]),
                                                ("llama", ["gate_up_proj"], ["gate_up_proj"])])
def test_targets_the_layout_lacks_are_refused_naming_the_supported_set(arch, targets, bad):
    from glm_lora.model.lora import LoRAConfigError
    m = tiny_arch(arch)
    with pytest.raises(LoRAConfigError) as e:
        inject_lora(m, LoRAConfig(target_modules=targets, r=2, alpha=2))
    msg = str(e.value)
    assert f"lora.target_modules {bad} not found in the model ({arch} layout)" in msg
    assert f"supported: {sorted(LAYOUT_PROJECTIONS[arch])} or 'all-linear'" in msg
    assert not lora_modules(m)


def test_lora_linear_keeps_a_frozen_bias():
    lin = nn.Linear(6, 5, bias=True)
    lora = LoRALinear(lin, r=3, alpha=6)
    with torch.no_grad():
        lora.lora_B.weight.normal_()
    x = torch.randn(4, 6)
    expected = x @ lora.merged_weight().T + lin.bias
    torch.testing.assert_close(lora(x), expected, atol=1e-6, rtol=1e-5)
    assert not lora.bias.requires_grad
    lora.enabled = False
    torch.testing.assert_close(lora(x), lin(x))


@pytest.mark.parametrize("arch", list(LAYOUT_PROJECTIONS))
def test_check_lora_knows_each_layout_from_its_config(arch):
    """What preflight can check from a base model's config.json alone (a model of it on the meta device): the
    same refusals inject_lora makes, naming the stage's key."""
    from glm_lora.model.lora import LoRAConfigError, check_lora
    m = tiny_arch(arch)
    check_lora(m.config, LoRAConfig(target_modules="all-linear"), "sft.lora")
    check_lora(m.config, LoRAConfig(target_modules=LAYOUT_PROJECTIONS[arch][:2]), "sft.lora")
    wrong = "gate_proj" if arch.startswith("glm") else "gate_up_proj"
    with pytest.raises(LoRAConfigError, match=rf"sft.lora.target_modules \['{wrong}'\] not found in the model "
                                              rf"\({arch} layout\); supported: "):
        check_lora(m.config, LoRAConfig(target_modules=["q_proj", wrong]), "sft.lora")
    assert not lora_modules(m)                                    # nothing built or wrapped on the real model


@pytest.mark.parametrize("arch", ["glm4", "qwen2"])
def test_fused_kernels_match_reference_on_biased_and_fused_layouts(arch):
    """kernels: triton (the Triton interpreter on CPU) vs reference on a layout with q/k/v bias, and for GLM-4
    a fused gate_up_proj (swiglu on its two halves), sandwich norms and GLM's RoPE (always the reference):
    the LoRA model's logits and every trainable gradient."""
    from glm_lora.kernels import ops as kernels
    results = {}
    for backend in ("reference", "triton"):
        with kernels.using(backend):
            m = tiny_arch(arch)
            inject_lora(m, LoRAConfig(target_modules="all-linear", r=4, alpha=8, modules_to_save=["lm_head"]))
            randomise_b(m, std=0.1)
            m.train()
            logits = m(ids())
            logits.float().pow(2).mean().backward()
            results[backend] = (logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    (ref_logits, ref_grads), (tri_logits, tri_grads) = results["reference"], results["triton"]
    torch.testing.assert_close(tri_logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert ref_grads.keys() == tri_grads.keys() and any("gate_up_proj" in n for n in ref_grads) is (arch == "glm4")
    for n in ref_grads:
        torch.testing.assert_close(tri_grads[n], ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)
