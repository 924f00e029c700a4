"""model/hf.py for Qwen3.5: transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM and the published multimodal
wrappers (Qwen3_5(Moe)ForConditionalGeneration) agree with our decoder through the weight map, both ways; the
wrapper's vision tower and MTP tensors are carried byte for byte; what we would not reproduce is refused naming the
file and key."""
import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from glm_lora.model import Decoder, DecoderConfig
from glm_lora.model.hf import (BaseModelError, import_hf, load_hf, load_native, read_hf_config, save_hf,
                               save_native)

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

VOCAB = 131
VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4, temporal_patch_size=2,
              num_position_embeddings=16)
# Shapes that differ in head dims, key/value head ratios, layer_types patterns, rotary share and sequence length.
SHAPES = {
    "dense-a": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                    layer_types=["linear_attention", "full_attention", "linear_attention"], T=13),
    "dense-b": dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=1, head_dim=8,
                    linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=16, linear_value_head_dim=8,
                    linear_conv_kernel_dim=3, layer_types=["full_attention", "linear_attention", "linear_attention",
                                                           "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
                    tie_word_embeddings=True, T=9),
    "moe-c": dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_hidden_layers=4,
                  linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=12, linear_value_head_dim=16,
                  num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                  T=17),       # layer_types left out: Qwen3_5MoeTextConfig's every-4th-layer attention
    "moe-d": dict(hidden_size=40, num_attention_heads=4, num_key_value_heads=1, head_dim=20, linear_num_key_heads=1,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                  layer_types=["full_attention", "linear_attention"], num_experts=4, num_experts_per_tok=1,
                  moe_intermediate_size=16, shared_expert_intermediate_size=12,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.2,
                                   "mrope_section": [1, 1, 0], "mrope_interleaved": True}, T=7),
}


def text_kwargs(shape: str) -> tuple[dict, int]:
    kw = dict(SHAPES[shape])
    T = kw.pop("T")
    kw.setdefault("num_hidden_layers", len(kw.get("layer_types", [])) or 2)
    return kw | dict(vocab_size=VOCAB, rms_norm_eps=1e-5, initializer_range=0.1, max_position_embeddings=256), T


def randomise(model, seed=3):
    """Norm weights start at zero (zero-centred) or one: spread them, so a wrong mapping or a missed +1 shows;
    initializer_range 0.1 keeps the logits well away from zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def hf_text_model(shape: str, seed=0):
    kw, T = text_kwargs(shape)
    torch.manual_seed(seed)
    if "num_experts" in kw:
        return randomise(transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**kw))), T
    return randomise(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kw))), T


def hf_wrapper(shape: str, seed=0):
    kw, T = text_kwargs(shape)
    torch.manual_seed(seed)
    moe = "num_experts" in kw
    config = (transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config)(
        text_config=kw, vision_config=VISION | {"out_hidden_size": kw["hidden_size"]},
        tie_word_embeddings=kw.get("tie_word_embeddings", False))
    cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    return randomise(cls(config)), T


def ids(T, B=2, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def loaded(cls, path):
    """transformers' model from `path`, refusing any missing, unexpected or mis-shaped weight."""
    model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_load_hf_matches_transformers(tmp_path, shape):
    hf, T = hf_text_model(shape)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    assert ours.config.layer_types == tuple(hf.config.layer_types)
    assert ours.config.rotary_dim == int(hf.config.head_dim * hf.config.rope_parameters["partial_rotary_factor"])
    x = ids(T)
    want = logits(hf, x)
    assert want.abs().max() > 1.0          # far from zero: a wrong mapping would show
    print(f"{shape}: max abs diff {(logits(ours, x) - want).abs().max().item():.2e}")
    torch.testing.assert_close(logits(ours, x), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape, fused", [("dense-b", False), ("moe-c", False), ("moe-d", True)])
def test_import_native_export_round_trip(tmp_path, shape, fused):
    """import_hf → our checkpoint → save_hf: transformers loads the export with no missing or unexpected weight and
    gives the same logits; MoE experts come in per expert (save_pretrained's form) or fused 3D, and go out per
    expert."""
    hf, T = hf_text_model(shape)
    hf.save_pretrained(tmp_path / "hf")
    if fused:          # the in-memory stacks as the checkpoint's keys
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "hf" / "model.safetensors")
        assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(tmp_path / "hf" / "model.safetensors")
    import_hf(tmp_path / "hf", tmp_path / "native")
    ours = load_native(tmp_path / "native").eval()
    save_hf(ours, tmp_path / "out", bos_id=1, eos_id=2, pad_id=0)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__] and config["model_type"] == hf.config.model_type
    assert "intermediate_size" not in config or "num_experts" not in config or not fused
    keys = load_file(tmp_path / "out" / "model.safetensors")
    assert ("model.layers.0.mlp.experts.0.gate_proj.weight" in keys) is ("num_experts" in config)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in keys
    back = loaded(type(hf), tmp_path / "out")
    x = ids(T)
    torch.testing.assert_close(logits(back, x), logits(hf, x), atol=1e-5, rtol=0)
    torch.testing.assert_close(logits(ours, x), logits(hf, x), atol=1e-5, rtol=0)


def test_from_scratch_exports_as_the_causal_lm(tmp_path):
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                        intermediate_size=48, arch="qwen3_5_text", layer_types=("linear_attention", "full_attention"),
                        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8, rms_norm_eps=1e-5)
    ours = randomise(Decoder(cfg))
    save_hf(ours, tmp_path, bos_id=1, eos_id=2, pad_id=0)
    hf = loaded(transformers.Qwen3_5ForCausalLM, tmp_path)
    torch.testing.assert_close(logits(hf, ids(5)), logits(ours, ids(5)), atol=1e-5, rtol=0)
    # a native checkpoint from before hf_source_config still reads
    legacy = {k: v for k, v in cfg.to_dict().items() if k != "hf_source_config"}
    assert DecoderConfig.from_dict(legacy).hf_source_config is None


def with_mtp(path, moe: bool) -> dict[str, torch.Tensor]:
    """The published checkpoints' MTP module (mtp.*, which transformers skips), bf16, added to `path`'s weights and
    declared in its text_config; returns those tensors."""
    g = torch.Generator().manual_seed(5)
    mtp = {"mtp.fc.weight": torch.randn(8, 16, generator=g).bfloat16(),
           "mtp.layers.0.input_layernorm.weight": torch.randn(8, generator=g).bfloat16(),
           "mtp.pre_fc_norm_hidden.weight": torch.randn(8, generator=g)}
    if moe:
        mtp["mtp.layers.0.mlp.experts.gate_up_proj"] = torch.randn(4, 6, 8, generator=g).bfloat16()
    weights = load_file(path / "model.safetensors")
    save_file(weights | mtp, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return mtp


@pytest.mark.parametrize("shape", ["dense-a", "moe-d"])
def test_wrapper_round_trip_carries_vision_and_mtp(tmp_path, shape):
    """A published Qwen3.5 (the multimodal wrapper): its language model imported, trained weights changed, exported
    back as the same wrapper class and config; the vision tower and the MTP tensors byte for byte."""
    hf, T = hf_wrapper(shape)
    hf.save_pretrained(tmp_path / "hf")
    mtp = with_mtp(tmp_path / "hf", "num_experts" in SHAPES[shape])
    source = load_file(tmp_path / "hf" / "model.safetensors")
    carried = {k: v for k, v in source.items() if k.startswith(("model.visual.", "mtp."))}
    assert any(k.startswith("model.visual.") for k in carried) and set(mtp) <= set(carried)

    ours = load_hf(tmp_path / "hf").eval()
    x = ids(T)
    torch.testing.assert_close(logits(ours, x), logits(hf, x), atol=1e-5, rtol=0)
    import_hf(tmp_path / "hf", tmp_path / "native")
    ours = load_native(tmp_path / "native").eval()
    with torch.no_grad():       # as a merged LoRA would: the export must carry our weights, not the source's
        ours.model.layers[1].mlp.shared_expert_gate.weight.mul_(-1) if hasattr(ours.model.layers[1].mlp, "gate") \
            else ours.model.layers[0].input_layernorm.weight.add_(0.5)
    save_native(ours, tmp_path / "native2")
    ours = load_native(tmp_path / "native2").eval()
    save_hf(ours, tmp_path / "out", bos_id=1, eos_id=2, pad_id=0, dtype=torch.float32)

    exported = load_file(tmp_path / "out" / "model.safetensors")
    for k, v in carried.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    src_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg["architectures"] == [type(hf).__name__] and out_cfg["model_type"] == src_cfg["model_type"]
    assert out_cfg["vision_config"] == src_cfg["vision_config"]
    assert out_cfg["image_token_id"] == src_cfg["image_token_id"]
    assert out_cfg["text_config"]["mtp_num_hidden_layers"] == 1
    assert out_cfg["text_config"]["rope_parameters"] == src_cfg["text_config"]["rope_parameters"]
    assert (out_cfg["text_config"]["eos_token_id"], out_cfg["text_config"]["pad_token_id"]) == (2, 0)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert type(config).__name__ == type(hf.config).__name__

    back = loaded(type(hf), tmp_path / "out")
    torch.testing.assert_close(logits(back, x), logits(ours, x), atol=1e-5, rtol=0)
    assert (logits(back, x) - logits(hf, x)).abs().max() > 1e-3       # the changed weights went out
    assert torch.equal(back.model.visual.blocks[0].attn.qkv.weight, hf.model.visual.blocks[0].attn.qkv.weight)


def write_config(path, config: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


TEXT = dict(model_type="qwen3_5_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True})
MOE = TEXT | dict(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                  shared_expert_intermediate_size=8)


@pytest.mark.parametrize("base, change, key", [
    (TEXT, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope"),
    (TEXT, {"attention_bias": True}, "attention_bias"),
    (TEXT, {"hidden_act": "gelu"}, "hidden_act"),
    (TEXT, {"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
    (TEXT, {"layer_types": ["linear_attention"]}, "layer_types"),
    (TEXT, {"linear_num_value_heads": 3}, "linear_num_value_heads"),
    (TEXT, {"attn_output_gate": False}, "attn_output_gate"),
    (TEXT, {"num_experts": 8}, "num_experts"),
    (TEXT, {"head_dim": 6}, "partial_rotary_factor"),
    (MOE, {"norm_topk_prob": False}, "norm_topk_prob"),
    (MOE, {"mlp_only_layers": [0]}, "mlp_only_layers"),
    (MOE, {"num_experts": 1}, "num_experts"),
    ({"model_type": "qwen3_5", "text_config": TEXT | {"tie_word_embeddings": True}}, {}, "tie_word_embeddings"),
    ({"model_type": "qwen3_5", "text_config": MOE}, {}, "text_config.model_type"),
])
def test_refusals_name_file_and_key(tmp_path, base, change, key):
    path = write_config(tmp_path / "m", copy.deepcopy(base) | change)
    with pytest.raises(BaseModelError, match=key) as e:
        read_hf_config(path)
    assert str(path / "config.json") in str(e.value)


def test_class_defaults_where_config_json_is_silent(tmp_path):
    """Qwen3_5(Moe)TextConfig's defaults fill what config.json leaves out, as transformers reads it; a wrapper's
    text_config the same."""
    for base, cls in ((TEXT, transformers.Qwen3_5TextConfig), (MOE, transformers.Qwen3_5MoeTextConfig)):
        sparse = {k: base[k] for k in ("model_type", "vocab_size", "num_hidden_layers")}
        ours, theirs = read_hf_config(write_config(tmp_path / base["model_type"], sparse)), cls(**sparse)
        assert (ours.hidden_size, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
            theirs.hidden_size, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim)
        assert ours.layer_types == tuple(theirs.layer_types) and ours.partial_rotary_factor == 0.25
        assert (ours.linear_num_value_heads, ours.linear_value_head_dim, ours.rms_norm_eps) == (
            theirs.linear_num_value_heads, theirs.linear_value_head_dim, theirs.rms_norm_eps)
        if base is MOE:
            assert (ours.n_routed_experts, ours.num_experts_per_tok) == (theirs.num_experts, theirs.num_experts_per_tok)
    wrapped = read_hf_config(write_config(tmp_path / "w", {"model_type": "qwen3_5_moe", "text_config": MOE}))
    assert wrapped.arch == "qwen3_5_moe_text" and wrapped.rope_theta == 1e7 and wrapped.n_routed_experts == 4


@pytest.mark.parametrize("shape, wrapped, targets", [
    ("dense-a", True, "all-linear"),
    ("moe-d", True, "all-linear"),              # routed experts in PEFT's own 3D form (no per-expert conversion)
    ("moe-d", True, ["experts.down_proj", "q_proj"]),
    ("moe-c", False, "all-linear"),             # per-expert keys, which PEFT converts for qwen3_5_moe_text
])
def test_peft_adapter_loads_on_the_hf_model_with_our_logits(tmp_path, shape, wrapped, targets):
    from peft import PeftModel

    from glm_lora.configs.schema import LoRAConfig
    from glm_lora.export.hf_peft import write_peft_adapter
    from glm_lora.model import inject_lora
    from glm_lora.model.adapters import save_adapter

    hf, T = (hf_wrapper if wrapped else hf_text_model)(shape)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "native")
    ours = load_native(tmp_path / "native").eval()
    lora = LoRAConfig(r=2, alpha=6.0, target_modules=targets)
    inject_lora(ours, lora)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():       # stand-in for training: B non-zero, A perturbed
        for n, p in ours.named_parameters():
            if "lora_" in n:
                noise = torch.randn(p.shape, generator=g)
                p.copy_(0.2 * noise) if "lora_B" in n else p.add_(0.1 * noise)
    (tmp_path / "sft").mkdir()
    save_adapter(ours, lora, tmp_path / "sft")
    write_peft_adapter(tmp_path / "sft", tmp_path / "peft", str(tmp_path / "hf"), moe=ours.config.layout.moe,
                       config=ours.config)
    keys = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    prefix = "base_model.model.model.language_model.layers." if wrapped else "base_model.model.model.layers."
    assert all(k.startswith(prefix) for k in keys)
    x = ids(T)
    base = logits(hf, x)
    with _no_missing_adapter_keys():
        peft = PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    got, want = logits(peft, x), logits(ours, x)
    assert (want - base).abs().max() > 1e-2                                 # the adapter changes the model
    print(f"PEFT {shape} {targets}: max abs diff {(got - want).abs().max().item():.2e}")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


class _no_missing_adapter_keys:
    """PEFT only warns where adapter weights found no module: here that fails the test."""

    def __enter__(self):
        import warnings
        self.catcher = warnings.catch_warnings(record=True)
        self.caught = self.catcher.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self.catcher.__exit__(*exc)
        missing = [str(w.message)[:300] for w in self.caught if "missing adapter keys" in str(w.message)]
        assert not missing, missing


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe", "qwen3_5"])
def test_gguf_is_refused_before_training(model_type):
    from glm_lora.model.gguf_support import GGUFError, check
    with pytest.raises(GGUFError, match=f"the {model_type} architecture is not written as GGUF"):
        check(["f16"], model_type)
    check([], model_type)      # nothing asked: nothing refused
