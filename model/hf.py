"""The one weight-name map between our decoder and transformers' LlamaForCausalLM (or
Qwen3ForCausalLM: the same layout plus per-head q/k RMSNorm, our `qk_norm`), plus native
checkpoint I/O. Export (our → HF) and base-model import (HF → our) both use it.

Safetensors only: nothing a user hands in is ever unpickled.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from configs.errors import UserError, quote
from model.model import Decoder, DecoderConfig


class BaseModelError(UserError, ValueError):
    """A base-model directory we cannot import; the message names the file and key."""

# model_type → architecture; qk_norm picks Qwen3 (Llama has no q/k norm), else Llama.
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
NATIVE_WEIGHTS, NATIVE_CONFIG = "model.safetensors", "config.json"


def hf_weight_map(cfg: DecoderConfig) -> dict[str, str]:
    """our parameter name → HF parameter name (identical by construction)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        names += [f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"]
        if cfg.qk_norm:
            names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        names += [f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return {n: n for n in names}


def hf_config_dict(cfg: DecoderConfig, *, bos_id: int | None, eos_id: int | None, pad_id: int | None,
                   dtype: str = "float32") -> dict:
    from transformers import LlamaConfig, Qwen3Config  # lazily: only export needs transformers

    model_type = hf_model_type(cfg)
    extra = {"use_sliding_window": False} if model_type == "qwen3" else {"mlp_bias": False}
    hf = {"llama": LlamaConfig, "qwen3": Qwen3Config}[model_type](
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, dtype=dtype, **extra,
    )
    d = hf.to_dict()
    d["architectures"] = [HF_ARCHITECTURES[model_type]]
    return d


def hf_model_type(cfg: DecoderConfig) -> str:
    return "qwen3" if cfg.qk_norm else "llama"


def decoder_config_from_hf(hf: dict, source: str = "config.json") -> DecoderConfig:
    """Read a Llama (or Qwen3) HF config; refuse layouts our decoder cannot represent exactly."""
    arch = (hf.get("architectures") or ["?"])[0]
    model_type = hf.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        supported = ", ".join(f"{a} (model_type '{t}')" for t, a in HF_ARCHITECTURES.items())
        raise BaseModelError(f"{source}: model_type {quote(model_type)} / {quote(arch)} is not supported; "
                             f"base_model must be one of: {supported}")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if not isinstance(hf.get(k), int) or isinstance(hf.get(k), bool)]
    if missing:
        raise BaseModelError(f"{source}: required key {missing[0]!r} is missing or not an integer "
                             f"(got {quote(hf.get(missing[0]))})")
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if hf.get(key):
            raise BaseModelError(f"{source}: {key}=true is not supported by the glm-lora decoder")
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(rope_key) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))   # legacy configs spell it `type`
    if rope_type != "default":
        raise BaseModelError(f"{source}: {rope_key} rope type {quote(rope_type)} is not supported (only 'default')")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        raise BaseModelError(f"{source}: head_dim {head_dim} × heads {heads} != hidden_size {hf['hidden_size']}")
    return DecoderConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        intermediate_size=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
    )


def read_hf_config(path: Path) -> DecoderConfig:
    """A base model directory's config.json → our DecoderConfig, or a BaseModelError naming the file and key."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise BaseModelError(f"base_model {path}: no config.json (expected a local Hugging Face model directory)")
    try:
        hf = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise BaseModelError(f"{cfg_file}: not readable JSON ({e})") from None
    if not isinstance(hf, dict):
        raise BaseModelError(f"{cfg_file}: expected a JSON object")
    return decoder_config_from_hf(hf, str(cfg_file))


def check_weights(path: Path) -> list[Path]:
    """The *.safetensors files of a model directory; refuses a directory with only pickled weights."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in Path(path).glob("*.bin")) + sorted(p.name for p in Path(path).glob("*.pt"))
        raise BaseModelError(f"base_model {path}: no *.safetensors weights"
                             + (f" (only pickled {', '.join(pickled[:3])}, which are never loaded: convert them with "
                                "`model.save_pretrained(dir, safe_serialization=True)`)" if pickled else ""))
    return files


def _load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    files = check_weights(path)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_hf(path: Path) -> Decoder:
    """A local HF Llama (or Qwen3) directory → our Decoder (fp32), via the weight map."""
    path = Path(path)
    cfg = read_hf_config(path)
    state = _load_safetensors_dir(path)
    model = Decoder(cfg)
    ours = {}
    for our_name, hf_name in hf_weight_map(cfg).items():
        if hf_name not in state:
            raise BaseModelError(f"{path}: weight {hf_name!r} missing from the safetensors files")
        ours[our_name] = state[hf_name].float()
    model.load_state_dict(ours, strict=not cfg.tie_embeddings)
    return model


def save_hf(model: Decoder, out_dir: Path, *, bos_id, eos_id, pad_id, dtype: torch.dtype = torch.float32) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sd = model.state_dict()
    tensors = {hf: sd[ours].detach().to(dtype).contiguous() for ours, hf in hf_weight_map(model.config).items()}
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    cfg = hf_config_dict(model.config, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, dtype=dtype_name)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def save_native(model: Decoder, out_dir: Path) -> None:
    """Our own checkpoint: full weights + the decoder config (readable with `cat`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, out_dir / NATIVE_WEIGHTS)
    (out_dir / NATIVE_CONFIG).write_text(json.dumps(model.config.to_dict(), indent=2))


def load_native(path: Path, device: str | torch.device = "cpu") -> Decoder:
    path = Path(path)
    cfg = DecoderConfig.from_dict(json.loads((path / NATIVE_CONFIG).read_text()))
    model = Decoder(cfg)
    model.load_state_dict(load_file(path / NATIVE_WEIGHTS), strict=not cfg.tie_embeddings)
    return model.to(device)
