"""GLM-4.5's mixture of experts (glm4_moe): our decoder against transformers' own Glm4MoeForCausalLM (random init,
no downloads) in fp32 — import, logits, export round trip, MTP layers carried unchanged, ties in routing — and
the config keys we refuse, named with their file."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM

from glm_lora.model.hf import BaseModelError, load_hf, load_native, read_hf_config, save_hf, save_native

torch.set_num_threads(1)
VOCAB = 96

# Three shapes: GLM-4.5's switches each way (group-limited routing, q/k norm, attention bias, a head_dim that
# is not hidden / heads, several shared experts, no dense layer, scaling, unnormalised weights).
SHAPES = {
    "grouped": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=3,
                    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                    n_shared_experts=1, use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5),
    "wide_heads": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                       n_routed_experts=6, num_experts_per_tok=3, n_group=3, topk_group=2, first_k_dense_replace=0,
                       n_shared_experts=2, use_qk_norm=False, attention_bias=False, norm_topk_prob=False),
    "many_experts": dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=24, num_hidden_layers=2,
                         n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1, first_k_dense_replace=1,
                         n_shared_experts=1, use_qk_norm=True, attention_bias=True, routed_scaling_factor=1.5),
}


def hf_model(shape: str, seed: int = 0, mtp: int = 0) -> Glm4MoeForCausalLM:
    torch.manual_seed(seed)
    cfg = Glm4MoeConfig(vocab_size=VOCAB, intermediate_size=72, moe_intermediate_size=20, max_position_embeddings=128,
                        partial_rotary_factor=0.5, rms_norm_eps=1e-5, tie_word_embeddings=False,
                        num_nextn_predict_layers=mtp, initializer_range=0.1, **SHAPES[shape])
    model = Glm4MoeForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():      # what random init leaves flat: norms at 1, biases and the routing bias at 0
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif n.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5, generator=g)                        # decisive routing
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.2 * torch.randn(cfg.n_routed_experts, generator=g))
    return model


def ids(B=2, T=13, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def mtp_tensors(model: Glm4MoeForCausalLM, seed: int = 5) -> dict[str, torch.Tensor]:
    """What a GLM-4.5 checkpoint holds for its MTP layer model.layers.{L}: eh_proj, enorm, hnorm, shared_head
    and a decoder layer (here: a copy of the last layer's keys, random values)."""
    L, g = model.config.num_hidden_layers, torch.Generator().manual_seed(seed)
    sd = load_file_like(model)
    out = {f"model.layers.{L}.{k.split('.', 3)[3]}": torch.randn(v.shape, generator=g)
           for k, v in sd.items() if k.startswith(f"model.layers.{L - 1}.")}
    C = model.config.hidden_size
    out |= {f"model.layers.{L}.eh_proj.weight": torch.randn(C, 2 * C, generator=g),
            f"model.layers.{L}.enorm.weight": torch.randn(C, generator=g),
            f"model.layers.{L}.hnorm.weight": torch.randn(C, generator=g),
            f"model.layers.{L}.shared_head.norm.weight": torch.randn(C, generator=g)}
    return out


def load_file_like(model) -> dict[str, torch.Tensor]:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return load_file(f"{d}/model.safetensors")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_imported_moe_logits_equal_transformers(tmp_path, shape):
    hf = hf_model(shape)
    hf.save_pretrained(tmp_path)                          # per-expert 2D keys, as GLM-4.5 checkpoints hold them
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in load_file(tmp_path / "model.safetensors"))
    ours = load_hf(tmp_path).eval()
    x = ids()
    with torch.no_grad():
        diff = (ours(x) - hf(x).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_ties_in_routing_scores_choose_as_transformers(tmp_path):
    """Experts with equal router rows score equally for every token: the top-k must break the tie the same way."""
    hf = hf_model("many_experts", seed=3)
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                w = layer.mlp.gate.weight
                w[1].copy_(w[0]), w[5].copy_(w[0]), w[9].copy_(w[2])
                layer.mlp.gate.e_score_correction_bias.zero_()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    x = ids(B=3, T=17, seed=4)
    with torch.no_grad():
        diff = (ours(x) - hf(x).logits).abs().max().item()
    assert diff <= 1e-5, diff


def round_trip_with_mtp(hf, tmp_path):
    """A checkpoint of `hf` with an MTP layer's tensors added → our import → our native checkpoint → our export: the
    MTP tensors arrive unchanged, the export holds the checkpoint's keys and declares the MTP layer. Returns our
    model read back and transformers' model loaded from the export."""
    hf.save_pretrained(tmp_path / "hub")
    state = load_file(tmp_path / "hub" / "model.safetensors")
    mtp = mtp_tensors(hf)
    save_file({**state, **mtp}, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
    ours = load_hf(tmp_path / "hub").eval()
    assert set(ours.carried) == set(mtp)
    save_native(ours, tmp_path / "native")                  # through the pipeline's own checkpoint
    back = load_native(tmp_path / "native").eval()
    save_hf(back, tmp_path / "export", bos_id=None, eos_id=None, pad_id=None)
    exported = load_file(tmp_path / "export" / "model.safetensors")
    for k, v in mtp.items():
        assert torch.equal(exported[k], v), k
    assert set(exported) == set(state) | set(mtp)            # the same keys as the checkpoint it came from
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__] and config["num_nextn_predict_layers"] == 1
    return back, AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()


def test_export_round_trip_and_mtp_layers_carried_unchanged(tmp_path):
    hf = hf_model("grouped", mtp=1)
    back, reloaded = round_trip_with_mtp(hf, tmp_path)
    x = ids()
    with torch.no_grad():
        assert (reloaded(x).logits - back(x)).abs().max().item() <= 1e-5
        assert (reloaded(x).logits - hf(x).logits).abs().max().item() <= 1e-5


def _write_config(d, **changes):
    hf = hf_model("grouped")
    hf.save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d / "config.json"


@pytest.mark.parametrize("changes, message", [
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported for model_type 'glm4_moe'"),
    ({"n_group": 3}, "n_group 3 must divide n_routed_experts 8"),
    ({"topk_group": 5}, "topk_group 5 must be in 1..n_group (2)"),
    ({"first_k_dense_replace": 9}, "first_k_dense_replace 9 must be in 0..num_hidden_layers (3)"),
    ({"moe_intermediate_size": None, "n_routed_experts": 0}, "n_routed_experts must be a positive integer"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_moe_keys_we_cannot_reproduce_are_refused_naming_key_and_file(tmp_path, changes, message):
    path = _write_config(tmp_path, **changes)
    with pytest.raises(BaseModelError) as e:
        read_hf_config(tmp_path)
    assert message in str(e.value) and str(path) in str(e.value)


def test_experts_in_another_family_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 8, "num_experts": 4}))
    with pytest.raises(BaseModelError, match="num_experts=4 .* not supported for model_type 'qwen3'"):
        read_hf_config(tmp_path)


def test_mtp_layers_without_their_config_key_are_refused(tmp_path):
    hf = hf_model("grouped")
    hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    save_file({**state, **mtp_tensors(hf)}, tmp_path / "model.safetensors")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BaseModelError, match="past num_hidden_layers 3, and config.json declares no num_nextn"):
        load_hf(tmp_path)


def test_a_missing_expert_weight_is_named(tmp_path):
    hf_model("grouped").save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(BaseModelError, match=r"'model.layers.2.mlp.experts.5.up_proj.weight' missing"):
        load_hf(tmp_path)
