"""model/hf.py: our Decoder and transformers' LlamaForCausalLM (Qwen3ForCausalLM with qk_norm)
agree exactly through the weight map."""
import json
import pathlib
import pickle

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from model import Decoder, DecoderConfig
from model.hf import (BaseModelError, decoder_config_from_hf, hf_config_dict, hf_weight_map, load_hf, load_native,
                      save_hf, save_native)

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

VOCAB = 257


def tiny(num_kv_heads=2, tie=False, seed=0, **kw) -> Decoder:
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab_size=VOCAB, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=num_kv_heads,
                        intermediate_size=80, max_seq_len=64, rope_theta=kw.pop("rope_theta", 500.0),
                        rms_norm_eps=1e-4, tie_embeddings=tie, **kw)   # not HF's 1e-6 default: must be exported
    model = Decoder(cfg)
    with torch.no_grad():   # norms start at 1: randomise so a wrong norm mapping would show
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model.eval()


def ids(B=2, T=11, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def hf_from(dir_):
    return AutoModelForCausalLM.from_pretrained(dir_, dtype=torch.float32).eval()


@pytest.mark.parametrize("num_kv_heads, tie, qk_norm", [(2, False, False), (2, True, False), (4, False, False),
                                                        (1, True, False), (2, False, True), (1, True, True)])
def test_logits_match_transformers_after_export(tmp_path, num_kv_heads, tie, qk_norm):
    ours = tiny(num_kv_heads, tie, qk_norm=qk_norm)
    save_hf(ours, tmp_path, bos_id=1, eos_id=2, pad_id=0)
    hf = hf_from(tmp_path)
    assert isinstance(hf, Qwen3ForCausalLM if qk_norm else LlamaForCausalLM)
    assert hf.config.num_key_value_heads == num_kv_heads
    x = ids()
    with torch.no_grad():
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


def test_qk_norm_exports_as_qwen3(tmp_path):
    save_hf(tiny(qk_norm=True), tmp_path, bos_id=1, eos_id=2, pad_id=0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["use_sliding_window"] is False and cfg["head_dim"] == 12
    assert "model.layers.1.self_attn.k_norm.weight" in load_file(tmp_path / "model.safetensors")


@pytest.mark.parametrize("tie, qk_norm", [(False, False), (True, False), (False, True)])
def test_weight_map_covers_exactly_hf_state_dict(tie, qk_norm):
    ours = tiny(tie=tie, qk_norm=qk_norm)
    config, model = (Qwen3Config, Qwen3ForCausalLM) if qk_norm else (LlamaConfig, LlamaForCausalLM)
    hf = model(config(**hf_config_dict(ours.config, bos_id=None, eos_id=None, pad_id=None)))
    hf_names = set(hf.state_dict())
    if tie:
        hf_names.discard("lm_head.weight")   # tied: stored once, as the embedding
    wmap = hf_weight_map(ours.config)
    assert set(wmap.values()) == hf_names
    assert set(wmap) | ({"lm_head.weight"} if tie else set()) == set(ours.state_dict())


@pytest.mark.parametrize("tie, qk_norm", [(False, False), (True, False), (True, True)])
def test_load_hf_round_trip(tmp_path, tie, qk_norm):
    ours = tiny(num_kv_heads=1, tie=tie, seed=3, qk_norm=qk_norm)
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


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_load_hf_reads_a_model_saved_by_transformers(tmp_path, arch):
    torch.manual_seed(5)
    config, model = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    hf_cfg = config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, head_dim=8,
                    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    hf = model(hf_cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    assert (ours.config.rope_theta, ours.config.rms_norm_eps, ours.config.num_kv_heads) == (1000.0, 1e-5, 2)
    assert ours.config.qk_norm is (arch == "qwen3")
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-5, rtol=1e-5)


def test_legacy_top_level_rope_theta_is_read():
    d = hf_config_dict(tiny().config, bos_id=None, eos_id=None, pad_id=None)
    del d["rope_parameters"]
    d["rope_theta"], d["rope_scaling"] = 1234.0, None
    assert decoder_config_from_hf(d).rope_theta == 1234.0


def _write_cfg(tmp_path, **changes):
    save_hf(tiny(), tmp_path, bos_id=None, eos_id=None, pad_id=None)
    d = json.loads((tmp_path / "config.json").read_text())
    d.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path


@pytest.mark.parametrize("changes, words", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, ["model_type 'mistral'", "MistralForCausalLM"]),
    ({"attention_bias": True}, ["attention_bias=true"]),
    ({"mlp_bias": True}, ["mlp_bias=true"]),
    ({"model_type": "qwen3", "use_sliding_window": True}, ["use_sliding_window=true"]),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, ["rope_parameters", "'llama3'"]),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, ["rope_scaling", "'linear'"]),
    ({"head_dim": 16}, ["head_dim 16", "hidden_size 48"]),
])
def test_load_hf_refuses_unsupported_layouts(tmp_path, changes, words):
    path = _write_cfg(tmp_path, **changes)
    with pytest.raises(ValueError) as e:
        load_hf(path)
    msg = str(e.value)
    assert str(path / "config.json") in msg
    for w in words:
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
    from safetensors.torch import save_file
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
