"""model/hf.py: our Decoder and transformers' causal LMs of every supported layout (Llama, Qwen2,
Qwen3, GLM, GLM-4-0414) agree exactly through the weight map, both ways; unsupported layouts are refused
naming the config key."""
import json
import pathlib
import pickle

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from glm_lora.model import Decoder, DecoderConfig
from glm_lora.model.model import LAYOUTS
from glm_lora.model.hf import (HF_ARCHITECTURES, BaseModelError, check_tokenizer_fits, decoder_config_from_hf,
                      hf_config_dict, hf_weight_map, load_hf, load_native, save_hf, save_native)

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

VOCAB = 257
ARCHS = [a for a in HF_ARCHITECTURES if not LAYOUTS[a].moe and not LAYOUTS[a].linear_attention]   # llama, qwen2,
# qwen3, glm, glm4 (MoE: test_moe.py, test_mla.py; Qwen3.5: test_qwen35_hf.py)


def hf_classes(arch):
    name = HF_ARCHITECTURES[arch]
    return getattr(transformers, name.replace("ForCausalLM", "Config")), getattr(transformers, name)


def randomise_norms_and_biases(model, seed=11):
    """Norms start at 1 and biases at 0: randomise them so a wrong mapping would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif n.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def tiny(num_kv_heads=2, tie=False, seed=0, **kw) -> Decoder:
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab_size=VOCAB, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=num_kv_heads,
                        intermediate_size=80, max_seq_len=64, rope_theta=kw.pop("rope_theta", 500.0),
                        rms_norm_eps=1e-4, tie_embeddings=tie, **kw)   # not HF's 1e-6 default: must be exported
    model = Decoder(cfg)
    randomise_norms_and_biases(model, seed + 11)
    return model.eval()


def ids(B=2, T=11, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def hf_from(dir_):
    return AutoModelForCausalLM.from_pretrained(dir_, dtype=torch.float32).eval()


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_kv_heads, tie", [(2, False), (1, True), (4, False)])
def test_logits_match_transformers_after_export(tmp_path, arch, num_kv_heads, tie):
    ours = tiny(num_kv_heads, tie, arch=arch)
    save_hf(ours, tmp_path, bos_id=1, eos_id=2, pad_id=0)
    hf = hf_from(tmp_path)
    assert type(hf).__name__ == HF_ARCHITECTURES[arch]
    assert hf.config.num_key_value_heads == num_kv_heads
    x = ids()
    with torch.no_grad():
        print(f"export {arch} kv{num_kv_heads} tie={tie}: max abs diff {max_diff(ours(x), hf(x).logits):.2e}")
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-5, rtol=1e-5)
        pos = torch.arange(5, 16).expand(2, -1)   # explicit positions reach RoPE the same way
        torch.testing.assert_close(ours(x, pos), hf(x, position_ids=pos).logits, atol=1e-5, rtol=1e-5)
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in keys) is (not tie)
    if tie:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def test_exported_config_is_a_plain_llama(tmp_path):
    save_hf(tiny(), tmp_path, bos_id=1, eos_id=2, pad_id=0, dtype=torch.bfloat16)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 12)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 500.0}
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 0)
    assert (cfg["rms_norm_eps"], cfg["intermediate_size"], cfg["vocab_size"]) == (1e-4, 80, VOCAB)
    assert cfg["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "model.safetensors").values())


def test_qwen3_export_config(tmp_path):
    save_hf(tiny(arch="qwen3"), tmp_path, bos_id=1, eos_id=2, pad_id=0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["use_sliding_window"] is False and cfg["head_dim"] == 12 and cfg["attention_bias"] is False
    assert "model.layers.1.self_attn.k_norm.weight" in load_file(tmp_path / "model.safetensors")


@pytest.mark.parametrize("arch", ["glm", "glm4"])
def test_glm_export_config(tmp_path, arch):
    save_hf(tiny(arch=arch, partial_rotary_factor=0.5), tmp_path, bos_id=None, eos_id=None, pad_id=None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [HF_ARCHITECTURES[arch]] and cfg["model_type"] == arch
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}
    assert cfg["attention_bias"] is True and cfg["head_dim"] == 12 and cfg["hidden_act"] == "silu"
    # GlmConfig fills a missing eos/pad with GLM-4's own ids (151329, ...), which our vocab doesn't have
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (None, None, None)
    keys = load_file(tmp_path / "model.safetensors")
    assert keys["model.layers.0.mlp.gate_up_proj.weight"].shape == (160, 48)
    assert "model.layers.0.self_attn.q_proj.bias" in keys and "model.layers.0.self_attn.o_proj.bias" not in keys
    assert ("model.layers.0.post_mlp_layernorm.weight" in keys) is (arch == "glm4")


def test_qwen2_export_config(tmp_path):
    save_hf(tiny(arch="qwen2"), tmp_path, bos_id=1, eos_id=2, pad_id=0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["use_sliding_window"] is False
    assert "model.layers.0.self_attn.k_proj.bias" in load_file(tmp_path / "model.safetensors")


@pytest.mark.parametrize("arch, tie, bias", [(a, t, None) for a in ARCHS for t in (False, True)]
                         + [("glm", False, False), ("glm4", True, False)])
def test_weight_map_covers_exactly_hf_state_dict(arch, tie, bias):
    ours = tiny(tie=tie, arch=arch, **({} if bias is None else {"attention_bias": bias}))
    config, model = hf_classes(arch)
    hf = model(config(**hf_config_dict(ours.config, bos_id=None, eos_id=None, pad_id=None)))
    hf_names = set(hf.state_dict())
    if tie:
        hf_names.discard("lm_head.weight")   # tied: stored once, as the embedding
    wmap = hf_weight_map(ours.config)
    assert set(wmap.values()) == hf_names
    assert set(wmap) | ({"lm_head.weight"} if tie else set()) == set(ours.state_dict())


@pytest.mark.parametrize("arch, tie", [(a, t) for a in ARCHS for t in (False, True)])
def test_load_hf_round_trip(tmp_path, arch, tie):
    ours = tiny(num_kv_heads=1, tie=tie, seed=3, arch=arch)
    save_hf(ours, tmp_path, bos_id=None, eos_id=None, pad_id=None)
    back = load_hf(tmp_path).eval()
    assert back.config == ours.config
    for k, v in ours.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, atol=0, rtol=0)
    if tie:
        assert back.lm_head.weight is back.model.embed_tokens.weight
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(back(x), ours(x), atol=0, rtol=0)


def _hf_model(arch, **overrides):
    """A tiny transformers model of `arch` at random init (hidden 64, 2 heads of 32), norms/biases randomised."""
    torch.manual_seed(5)
    config, model = hf_classes(arch)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)   # GLM's defaults (151329, ...) are outside this vocab
    if arch != "qwen2":
        kw["head_dim"] = 32
    hf = model(config(**{**kw, **overrides})).eval()
    randomise_norms_and_biases(hf)
    return hf


@pytest.mark.parametrize("arch, overrides", [(a, {}) for a in ARCHS] + [
    ("glm4", {"attention_bias": False, "partial_rotary_factor": 0.25}),
    ("glm", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 1.0}}),
], ids=ARCHS + ["glm4-nobias-rotary0.25", "glm-rotary1"])
def test_load_hf_reads_a_model_saved_by_transformers(tmp_path, arch, overrides):
    hf = _hf_model(arch, **overrides)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    c = ours.config
    assert (c.arch, c.rope_theta, c.rms_norm_eps, c.num_kv_heads, c.head_dim) == (arch, 1000.0, 1e-5, 1, 32)
    assert c.layout.qk_norm is (arch == "qwen3")
    assert c.attention_bias is overrides.get("attention_bias", arch in ("qwen2", "glm", "glm4"))
    assert c.rotary_dim == hf.model.rotary_emb.inv_freq.numel() * 2
    x = ids()
    with torch.no_grad():
        print(f"import {arch} {overrides}: max abs diff {max_diff(ours(x), hf(x).logits):.2e}")
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-5, rtol=1e-5)


def test_checkpoint_configs_from_before_arch_still_load(tmp_path):
    """Native checkpoints written before `arch` said `qk_norm`; they must load as the same layout."""
    old = {"vocab_size": 99, "hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
           "intermediate_size": 96, "max_seq_len": 64, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
           "tie_embeddings": False}
    assert DecoderConfig.from_dict({**old, "qk_norm": True}).arch == "qwen3"
    assert DecoderConfig.from_dict({**old, "qk_norm": False}).arch == "llama"
    assert DecoderConfig.from_dict(old).arch == "llama"
    model = Decoder(DecoderConfig.from_dict({**old, "qk_norm": True}))
    save_native(model, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**old, "qk_norm": True}))
    assert load_native(tmp_path).config == model.config


def test_decoder_config_refuses_what_a_layout_lacks():
    with pytest.raises(ValueError, match=r"attention_bias=True is not part of the llama layout.*supported: glm, glm4"):
        DecoderConfig(vocab_size=9, hidden_size=64, num_heads=2, num_kv_heads=1, attention_bias=True)
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5 is not part of the qwen3 layout"):
        DecoderConfig(vocab_size=9, hidden_size=64, num_heads=2, num_kv_heads=1, arch="qwen3", partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match=r"arch 'mistral' is not supported; supported: llama, qwen2, qwen3, glm, glm4"):
        DecoderConfig(vocab_size=9, arch="mistral")


def test_legacy_top_level_rope_theta_is_read():
    d = hf_config_dict(tiny().config, bos_id=None, eos_id=None, pad_id=None)
    del d["rope_parameters"]
    d["rope_theta"], d["rope_scaling"] = 1234.0, None
    assert decoder_config_from_hf(d).rope_theta == 1234.0


def _write_cfg(tmp_path, arch="llama", **changes):
    save_hf(tiny(arch=arch), tmp_path, bos_id=None, eos_id=None, pad_id=None)
    d = json.loads((tmp_path / "config.json").read_text())
    d.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path


@pytest.mark.parametrize("arch, changes, words", [
    ("llama", {"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
     ["model_type 'mistral'", "MistralForCausalLM", "supported:", "Glm4ForCausalLM (model_type 'glm4')"]),
    ("llama", {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]},
     ["model_type 'qwen3_moe'", "supported:", "Glm4MoeForCausalLM (model_type 'glm4_moe')"]),
    ("glm4", {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"]},     # GLM-4.5 without its experts
     ["n_routed_experts must be a positive integer for model_type 'glm4_moe'"]),
    ("llama", {"attention_bias": True},
     ["attention_bias=true", "model_type 'llama'", "supported: q/k/v bias in qwen2, glm, glm4"]),
    ("qwen3", {"attention_bias": True}, ["attention_bias=true", "model_type 'qwen3'", "supported:"]),
    ("llama", {"mlp_bias": True}, ["mlp_bias=true", "supported:"]),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16},
     ["use_sliding_window=true", "sliding-window", "supported:"]),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]},
     ["layer_types ['full_attention', 'sliding_attention']", "sliding-window"]),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     ["rope_parameters", "'llama3'", "supported: 'default'"]),
    ("llama", {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, ["rope_scaling", "'linear'"]),
    ("glm4", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "partial_rotary_factor": 0.5}},
     ["rope_parameters", "'yarn'"]),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     ["partial_rotary_factor 0.5", "model_type 'llama'", "supported: partial rotary in glm, glm4"]),
    ("qwen2", {"partial_rotary_factor": 0.5}, ["partial_rotary_factor 0.5", "supported: partial rotary in glm, glm4"]),
    ("glm", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}},
     ["partial_rotary_factor 0.3", "even number of rotated dims"]),
    ("glm4", {"num_experts": 8}, ["num_experts=8", "mixture of experts", "supported: experts in glm4_moe"]),
    ("glm4", {"n_routed_experts": 64}, ["n_routed_experts=64", "mixture of experts"]),
    ("qwen3", {"num_local_experts": 4}, ["num_local_experts=4"]),
    ("llama", {"hidden_act": "gelu"}, ["hidden_act 'gelu'", "supported: 'silu'"]),
    ("llama", {"head_dim": 16}, ["head_dim 16", "hidden_size 48"]),
    ("llama", {"num_key_value_heads": 3}, ["num_attention_heads 4", "num_key_value_heads 3"]),
])
def test_load_hf_refuses_unsupported_layouts(tmp_path, arch, changes, words):
    path = _write_cfg(tmp_path, arch, **changes)
    with pytest.raises(BaseModelError) as e:
        load_hf(path)
    msg = str(e.value)
    assert msg.startswith(str(path / "config.json") + ": ")
    for w in words:
        assert w in msg


@pytest.mark.parametrize("arch, mutate, words", [
    # config.json says no attention bias, the weights have them: transformers would silently drop them
    ("glm4", lambda cfg, w: cfg.update(attention_bias=False), ["self_attn.k_proj.bias", "Glm4ForCausalLM"]),
    # Qwen2 weights under a Llama config.json (q/k/v biases with no place)
    ("qwen2", lambda cfg, w: cfg.update(model_type="llama", architectures=["LlamaForCausalLM"]),
     ["self_attn.k_proj.bias", "LlamaForCausalLM"]),
    # a GLM-4 layer's norms under a GLM config.json
    ("glm4", lambda cfg, w: cfg.update(model_type="glm", architectures=["GlmForCausalLM"]), ["post_mlp_layernorm"]),
    # tied in config.json, a different lm_head in the file
    ("llama", lambda cfg, w: (cfg.update(tie_word_embeddings=True),
                              w.__setitem__("lm_head.weight", w["lm_head.weight"] + 1)),
     ["tie_word_embeddings=true", "lm_head.weight", "differs from model.embed_tokens.weight"]),
    ("glm", lambda cfg, w: w.pop("model.layers.1.mlp.gate_up_proj.weight"),
     ["model.layers.1.mlp.gate_up_proj.weight", "missing"]),
])
def test_load_hf_refuses_weights_config_json_does_not_describe(tmp_path, arch, mutate, words):
    save_hf(tiny(arch=arch), tmp_path, bos_id=None, eos_id=None, pad_id=None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    weights = load_file(tmp_path / "model.safetensors")
    mutate(cfg, weights)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(BaseModelError) as e:
        load_hf(tmp_path)
    for w in words:
        assert w in str(e.value)


def test_tied_config_with_an_equal_lm_head_is_fine(tmp_path):
    """transformers' save_pretrained can write the tied lm_head too; equal weights are not a mismatch."""
    ours = tiny(tie=True)
    save_hf(ours, tmp_path, bos_id=None, eos_id=None, pad_id=None)
    weights = load_file(tmp_path / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, tmp_path / "model.safetensors")
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path).eval()(x), ours(x), atol=0, rtol=0)


def test_tokenizer_larger_than_vocab_is_refused_naming_both(tmp_path):
    save_hf(tiny(arch="glm4"), tmp_path, bos_id=None, eos_id=None, pad_id=None)
    (tmp_path / "tokenizer.json").write_text("{}")
    check_tokenizer_fits(tmp_path, VOCAB)          # equal: fine
    check_tokenizer_fits(tmp_path, VOCAB - 40)     # fewer (padded embedding): fine
    with pytest.raises(BaseModelError) as e:
        check_tokenizer_fits(tmp_path, VOCAB + 3)
    msg = str(e.value)
    for w in (str(tmp_path / "config.json"), f"vocab_size {VOCAB}", f"{VOCAB + 3} tokens", "tokenizer.json", "supported:"):
        assert w in msg


def test_load_hf_needs_config_json(tmp_path):
    with pytest.raises(BaseModelError, match="no config.json"):
        load_hf(tmp_path)


class _Tripwire:
    """Unpickling this touches a marker file: proof that nobody unpickled it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_refuses_bin_only_dir_without_unpickling(tmp_path, monkeypatch):
    path = _write_cfg(tmp_path)
    (path / "model.safetensors").unlink()
    marker = tmp_path / "UNPICKLED"
    (path / "pytorch_model.bin").write_bytes(pickle.dumps(_Tripwire(marker)))

    def no_torch_load(*a, **k):
        raise AssertionError("torch.load must never be called on user weights")
    monkeypatch.setattr(torch, "load", no_torch_load)
    with pytest.raises(BaseModelError) as e:
        load_hf(path)
    assert "no *.safetensors" in str(e.value) and ".bin" in str(e.value)
    assert not marker.exists()


def test_missing_weight_is_named(tmp_path):
    path = _write_cfg(tmp_path)
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(BaseModelError, match="model.layers.1.mlp.up_proj.weight"):
        load_hf(path)


@pytest.mark.parametrize("tie", [False, True])
def test_native_round_trip(tmp_path, tie):
    ours = tiny(tie=tie, seed=7)
    save_native(ours, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == ours.config.to_dict()
    assert ("lm_head.weight" in load_file(tmp_path / "model.safetensors")) is (not tie)
    back = load_native(tmp_path).eval()
    assert back.config == ours.config
    if tie:
        assert back.lm_head.weight is back.model.embed_tokens.weight
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(back(x), ours(x), atol=0, rtol=0)
