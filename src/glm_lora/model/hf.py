"""The weight-name map between our decoder and transformers' causal LMs of each supported layout,
their config.json both ways, and native checkpoint I/O. Export (our → HF) and base-model import
(HF → our) both use LAYER_WEIGHTS.

Supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, GlmForCausalLM (GLM-4-9B-chat-hf),
Glm4ForCausalLM (GLM-4-0414), Glm4MoeForCausalLM (GLM-4.5/4.6/4.7, mixture of experts),
Glm4MoeLiteForCausalLM (GLM-4.7-Flash: latent attention + experts), GlmMoeDsaForCausalLM (GLM-5/5.1/5.2:
latent attention with DeepSeek sparse attention + experts), and Qwen3.5: Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM
(gated DeltaNet and gated attention layers, dense or Qwen's experts) and, as the checkpoints are published, the
multimodal Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration, whose language model
(`model.language_model.*`, config from text_config) is ours; its vision tower (`model.visual.*`) and MTP module
(`mtp.*`) are carried unchanged, and the export is the same wrapper class with the same config
(`DecoderConfig.hf_source_config` remembers it). `DecoderConfig.arch` is the HF model_type (of the text_config
inside a wrapper). Anything our decoder cannot reproduce exactly (rope scaling, sliding windows, experts outside
the MoE layouts, biases or partial rotary where the layout has none, another activation, a router other than the
layout's) is refused naming the config key.

Routed experts: on disk one 2D weight per expert and projection (`mlp.experts.{e}.gate_proj.weight`, as the
GLM-4.5 checkpoints and transformers' save_pretrained store them — Qwen3.5's too — and as vLLM loads them; import
also takes transformers' fused 3D keys, which export splits); in our decoder (and in transformers' memory)
stacked: `mlp.experts.gate_up_proj` (E, 2I, C) = [gate | up] rows, `mlp.experts.down_proj` (E, C, I).
`EXPERT_WEIGHTS` is that map. GLM's multi-token-prediction layers (`model.layers.{L}.*` for L ≥ num_hidden_layers,
`num_nextn_predict_layers` of them) are not part of our forward: they are carried unchanged from import to export
(`Decoder.carried`) so vLLM's speculative decoding can use them, unless a stage trains the MTP layer
(model/mtp.py), which writes its merged weights back there.

Import and loading go one tensor at a time (model/tensor_files.py), in the dtypes the checkpoint stores: the base
model is never built in memory to import it (`import_hf`), nor loaded whole to train on it (`load_native` with a
stage's `Placement`: docs/base-model.md, "Large bases").

Safetensors only: nothing a user hands in is ever unpickled.
"""
from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch
import torch.nn as nn
from safetensors.torch import save_file

from glm_lora.artifacts.manifest import atomic_write_text
from glm_lora.configs.errors import UserError, quote
from glm_lora.model.model import LAYER_TYPES, LAYOUTS, Decoder, DecoderConfig, shapes_only
from glm_lora.model.quant import NF4Params
from glm_lora.model.tensor_files import MAX_FILE_BYTES, TensorFiles, index_name, remove_tensors, write_tensors


log = logging.getLogger("glm_lora.hf")


class BaseModelError(UserError, ValueError):
    """A base-model directory we cannot import; the message names the file and key."""


# model_type (= our arch) → architecture
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                    "glm4_moe_lite": "Glm4MoeLiteForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM",
                    "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
# Qwen3.5 as published: the multimodal wrapper's model_type → (its architecture, the model_type of its text_config,
# which is our arch). Its language model is ours under `model.language_model.`; the vision tower (`model.visual.*`)
# is carried through, as are the MTP tensors (`mtp.*`) of either form.
HF_WRAPPERS = {"qwen3_5": ("Qwen3_5ForConditionalGeneration", "qwen3_5_text"),
               "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text")}
# Config classes not named after the architecture (Qwen3_5Config is the wrapper's).
_CONFIG_CLASSES = {"qwen3_5_text": "Qwen3_5TextConfig", "qwen3_5_moe_text": "Qwen3_5MoeTextConfig"}
# Our checkpoint: two tensor sets (model/tensor_files.py: `model.safetensors`, or `model-0000i-of-0000N.safetensors`
# with an index; the same for `carried`, where there are carried tensors) and config.json.
NATIVE_WEIGHTS, NATIVE_CARRIED, NATIVE_CONFIG = "model", "carried", "config.json"

# Parameters of one decoder layer (model.layers.N.<name>), as transformers names them in each
# architecture, and so do we: the map is the identity, written out per architecture.
_ATTN = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight")
_QKV_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")   # dropped if attention_bias is off
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
_SWIGLU = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_GLM_MLP = ("mlp.gate_up_proj.weight", "mlp.down_proj.weight")
_QK_NORM = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")                  # dropped if qk_norm is off
# Qwen3.5's layers: gated DeltaNet ("linear_attention") or gated attention (q_proj twice as wide: query and gate).
_GATED_DELTA_NET = tuple(f"linear_attn.{n}" for n in (
    "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight", "dt_bias",
    "A_log", "norm.weight", "out_proj.weight"))
# Qwen's MoE MLP: the softmax router and one shared expert scaled by its own sigmoid gate.
_QWEN_MOE_MLP = ("mlp.gate.weight", "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                 "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight")
LAYER_WEIGHTS = {
    "llama": _NORMS + _ATTN + _SWIGLU,
    "qwen2": _NORMS + _ATTN + _QKV_BIAS + _SWIGLU,
    "qwen3": _NORMS + _ATTN + _QK_NORM + _SWIGLU,
    "glm": _NORMS + _ATTN + _QKV_BIAS + _GLM_MLP,
    "glm4": _NORMS + ("post_self_attn_layernorm.weight", "post_mlp_layernorm.weight") + _ATTN + _QKV_BIAS + _GLM_MLP,
    "glm4_moe": _NORMS + _ATTN + _QKV_BIAS + _QK_NORM + _SWIGLU,            # the first_k_dense_replace dense layers
}
# The MoE layers' MLP: the router, the shared expert (the routed experts: EXPERT_WEIGHTS).
_MOE_MLP = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.shared_experts.gate_proj.weight",
            "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight")
MOE_LAYER_WEIGHTS = _NORMS + _ATTN + _QKV_BIAS + _QK_NORM + _MOE_MLP            # glm4_moe's MoE layers
# Multi-head latent attention (glm4_moe_lite, glm_moe_dsa): the query latent (or one q_proj without it), the key /
# value latent, and, in glm_moe_dsa's "full" layers, the DSA indexer.
_MLA_Q_LATENT = ("self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight")
_MLA_KV = ("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
           "self_attn.o_proj.weight")
_MLA_BIAS = ("self_attn.q_a_proj.bias", "self_attn.kv_a_proj_with_mqa.bias", "self_attn.o_proj.bias")
_INDEXER = ("self_attn.indexer.wq_b.weight", "self_attn.indexer.wk.weight", "self_attn.indexer.k_norm.weight",
            "self_attn.indexer.k_norm.bias", "self_attn.indexer.weights_proj.weight")
# our stacked expert weight → (HF per-expert name with {e}, the rows of it each expert's weight is): gate_up_proj
# holds [gate | up], so gate is its first half of rows and up the second.
EXPERT_WEIGHTS = {"mlp.experts.gate_up_proj": (("mlp.experts.{e}.gate_proj.weight", 0),
                                               ("mlp.experts.{e}.up_proj.weight", 1)),
                  "mlp.experts.down_proj": (("mlp.experts.{e}.down_proj.weight", None),)}
# Weights in a checkpoint that transformers itself never loads (old Llama exports kept RoPE's buffer).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# MoE config keys across families: any of them set means experts our dense MLP cannot hold (outside glm4_moe).
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
             "num_experts_per_tok")
# glm4_moe's keys, read into DecoderConfig fields of the same names (Glm4MoeConfig's defaults where absent).
MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
            "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")
_GLM4_MOE_DEFAULTS = {"n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                      "norm_topk_prob": True, "routed_scaling_factor": 1.0, "num_nextn_predict_layers": 0}
# What transformers' config classes default to where config.json leaves a key out, per MoE model_type.
MOE_DEFAULTS = {
    "glm4_moe": _GLM4_MOE_DEFAULTS,
    "glm4_moe_lite": {**_GLM4_MOE_DEFAULTS, "routed_scaling_factor": 1.8, "n_routed_experts": 64,
                      "num_experts_per_tok": 4, "moe_intermediate_size": 1536},
    "glm_moe_dsa": {**_GLM4_MOE_DEFAULTS, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
                    "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048},
}
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
DSA_KEYS = ("index_topk", "index_head_dim", "index_n_heads")
_MLA_DEFAULTS = {"q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
                 "v_head_dim": 256}
_CLASS_DEFAULTS = {"glm4_moe_lite": _MLA_DEFAULTS,
                   "glm_moe_dsa": {**_MLA_DEFAULTS, "q_lora_rank": 2048, "index_topk": 2048, "index_head_dim": 128,
                                   "index_n_heads": 32}}
# Qwen3_5TextConfig's / Qwen3_5MoeTextConfig's defaults (transformers 5.19) where config.json leaves a key out.
_QWEN3_5_DEFAULTS = {"vocab_size": 248320, "num_attention_heads": 16, "head_dim": 256, "linear_conv_kernel_dim": 4,
                     "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                     "linear_num_value_heads": 32, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}
QWEN3_5_DEFAULTS = {
    "qwen3_5_text": {**_QWEN3_5_DEFAULTS, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
                     "num_key_value_heads": 4},
    "qwen3_5_moe_text": {**_QWEN3_5_DEFAULTS, "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2,
                         "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                         "shared_expert_intermediate_size": 512},
}
LINEAR_ATTENTION_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel_dim")
# Qwen3.5's expert settings: our DecoderConfig field → its config.json key.
QWEN_MOE_KEYS = {"n_routed_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
                 "moe_intermediate_size": "moe_intermediate_size",
                 "shared_expert_intermediate_size": "shared_expert_intermediate_size"}
# Router settings of the DeepSeek-V3 family that GLM-4.5's router (sigmoid, group-limited, bias-corrected)
# does not take: a value other than the one named means a router we would not reproduce.
_GLM4_MOE_ROUTER = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def hf_weight_map(cfg: DecoderConfig) -> dict[str, str]:
    """our parameter name → HF parameter name (identical by construction, but for a Qwen3.5 wrapper's
    `model.language_model.` prefix; the stacked routed experts are `expert_weight_names`)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        if cfg.layout.mla:
            layer = _NORMS + _latent_attention_weights(cfg, i) + (_MOE_MLP if cfg.is_moe_layer(i) else _SWIGLU)
        elif cfg.layout.linear_attention:
            mixer = _GATED_DELTA_NET if cfg.is_linear_attention_layer(i) else _ATTN + _QK_NORM
            layer = _NORMS + mixer + (_QWEN_MOE_MLP if cfg.is_moe_layer(i) else _SWIGLU)
        else:
            layer = MOE_LAYER_WEIGHTS if cfg.is_moe_layer(i) else LAYER_WEIGHTS[cfg.arch]
        names += [f"model.layers.{i}.{n}" for n in layer
                  if (cfg.attention_bias or n not in _QKV_BIAS) and (cfg.qk_norm or n not in _QK_NORM)]
    return {n: hf_name(cfg, n) for n in names}


def wrapper_architecture(cfg: DecoderConfig) -> str | None:
    """The multimodal wrapper class a Qwen3.5 model was imported from (None: a causal LM of its own)."""
    source = cfg.hf_source_config or {}
    return HF_WRAPPERS[source["model_type"]][0] if "text_config" in source else None


def hf_architecture(cfg: DecoderConfig) -> str:
    """The HF class an export of `cfg` is: the wrapper it came in, else its layout's causal LM."""
    return wrapper_architecture(cfg) or HF_ARCHITECTURES[cfg.arch]


def hf_name(cfg: DecoderConfig, ours: str) -> str:
    """Our name of a weight → its HF name: the same, but inside a Qwen3.5 wrapper, whose language model is
    `model.language_model` (its `lm_head` stays at the top)."""
    if wrapper_architecture(cfg) and ours.startswith("model."):
        return "model.language_model." + ours.removeprefix("model.")
    return ours


def _latent_attention_weights(cfg: DecoderConfig, i: int) -> tuple[str, ...]:
    names = (_MLA_Q_LATENT if cfg.q_lora_rank else ("self_attn.q_proj.weight",)) + _MLA_KV
    if cfg.attention_bias:
        names += tuple(n for n in _MLA_BIAS if cfg.q_lora_rank or "q_a_proj" not in n)
    if cfg.layout.dsa and cfg.indexer_types[i] == "full":
        names += _INDEXER
    return names


def expert_weight_names(cfg: DecoderConfig) -> dict[str, list[tuple[str, int | None]]]:
    """our stacked expert weight → [(HF name of expert e's weight, which half of its rows: 0, 1 or None = all)]
    for every MoE layer, expert by expert (EXPERT_WEIGHTS written out)."""
    return {f"model.layers.{i}.{ours}": [(hf_name(cfg, f"model.layers.{i}.{hf.format(e=e)}"), half)
                                          for e in range(cfg.n_routed_experts) for hf, half in parts]
            for i in range(cfg.num_layers) if cfg.is_moe_layer(i) for ours, parts in EXPERT_WEIGHTS.items()}


def split_experts(name: str, stacked: torch.Tensor, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """One stacked expert weight of ours → its per-expert HF tensors."""
    out = {}
    for (hf, half), e in zip(expert_weight_names(cfg)[name], _expert_index(cfg, name)):
        w = stacked[e]
        out[hf] = (w if half is None else w.chunk(2, dim=0)[half]).contiguous()
    return out


def stack_experts(name: str, state: dict[str, torch.Tensor], cfg: DecoderConfig, source: Path) -> torch.Tensor:
    """The per-expert HF tensors of one stacked expert weight of ours, popped from `state` and stacked (transformers'
    fused 3D key is taken as it is); BaseModelError naming the first missing weight."""
    require_expert_weights(name, state, cfg, source)
    return read_stacked_experts(name, cfg, state, state.pop)


def require_expert_weights(name: str, present, cfg: DecoderConfig, source: Path) -> None:
    """BaseModelError naming the first per-expert HF weight of our stacked `name` that `present` lacks (none
    needed where it holds the fused key)."""
    missing = None if hf_name(cfg, name) in present else next(
        (hf for hf, _ in expert_weight_names(cfg)[name] if hf not in present), None)
    if missing:
        raise BaseModelError(f"{source}: weight {missing!r} missing from the safetensors files (config.json describes "
                             f"{cfg.n_routed_experts} routed experts in layer {name.split('.')[2]})")


def read_stacked_experts(name: str, cfg: DecoderConfig, present, read) -> torch.Tensor:
    """Our stacked `name` (E, rows, cols) from `read(HF name)`, each expert's tensor copied into the stack as it is
    read (the stack is never built twice), in the dtype they are stored in (promoted where experts differ); the fused
    3D key where `present` holds it, as it is."""
    if hf_name(cfg, name) in present:
        return read(hf_name(cfg, name))
    parts = expert_weight_names(cfg)[name]
    out = None
    for (hf, half), e in zip(parts, _expert_index(cfg, name)):
        w = read(hf)
        if out is None:
            out = w.new_empty(cfg.n_routed_experts, w.shape[0] * (1 if half is None else 2), *w.shape[1:])
        elif w.dtype != out.dtype:
            out = out.to(torch.promote_types(out.dtype, w.dtype))
        rows = slice(None) if half is None else slice(half * w.shape[0], (half + 1) * w.shape[0])
        out[e, rows] = w
    return out


def _expert_index(cfg: DecoderConfig, name: str) -> list[int]:
    per_expert = len(EXPERT_WEIGHTS[name.split(".", 3)[3]])
    return [e for e in range(cfg.n_routed_experts) for _ in range(per_expert)]


def hf_config_dict(cfg: DecoderConfig, *, bos_id: int | None, eos_id: int | None, pad_id: int | None,
                   dtype: str = "float32") -> dict:
    """config.json of the HF class of `cfg.arch` (written through transformers' own config class)."""
    import transformers  # lazily: only export needs transformers

    arch = cfg.arch
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    extra: dict = {"head_dim": cfg.head_dim}
    if arch == "llama":
        extra |= {"mlp_bias": False, "attention_bias": False}
    elif arch in ("qwen2", "qwen3"):
        extra |= {"use_sliding_window": False} | ({"attention_bias": False} if arch == "qwen3" else {})
        if arch == "qwen2":
            del extra["head_dim"]   # Qwen2Config has none: hidden_size / heads
    else:   # glm, glm4, glm4_moe
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
        extra |= {"attention_bias": cfg.attention_bias, "partial_rotary_factor": cfg.partial_rotary_factor}
    if arch == "glm4_moe":
        extra |= {k: getattr(cfg, k) for k in MOE_KEYS} | {"use_qk_norm": cfg.qk_norm,
                                                           "num_nextn_predict_layers": cfg.num_nextn_predict_layers}
    if cfg.layout.linear_attention:
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
        extra |= {"attention_bias": False, "layer_types": list(cfg.layer_types)} | {
            k: getattr(cfg, k) for k in LINEAR_ATTENTION_KEYS}
        if cfg.layout.moe:
            extra |= {hf_key: getattr(cfg, ours) for ours, hf_key in QWEN_MOE_KEYS.items()}
    if cfg.layout.mla:
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        extra = {k: getattr(cfg, k) for k in MOE_KEYS + MLA_KEYS} | {
            "q_lora_rank": cfg.q_lora_rank or None, "attention_bias": cfg.attention_bias,
            "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
            "mlp_layer_types": ["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.num_layers)]}
        extra |= {k: getattr(cfg, k) for k in DSA_KEYS} | {"indexer_types": list(cfg.indexer_types)} if (
            cfg.layout.dsa) else {"rope_interleave": True}
    config_class = getattr(transformers, _CONFIG_CLASSES.get(arch) or HF_ARCHITECTURES[arch].replace("ForCausalLM",
                                                                                                   "Config"))
    hf = config_class(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps, hidden_act="silu",
        rope_parameters=rope, tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, dtype=dtype, **extra,
    )
    d = hf.to_dict()
    # GlmConfig/Glm4Config replace a missing eos/pad with GLM-4's own ids: keep ours (None included).
    d["bos_token_id"], d["eos_token_id"], d["pad_token_id"] = bos_id, eos_id, pad_id
    d["architectures"] = [HF_ARCHITECTURES[arch]]
    if cfg.layout.linear_attention and cfg.layout.moe:
        del d["intermediate_size"]      # not a Qwen3_5MoeTextConfig key: every layer is experts
    return _as_imported(cfg, d) if cfg.hf_source_config else d


def _as_imported(cfg: DecoderConfig, ours: dict) -> dict:
    """A Qwen3.5 export's config.json: `ours` over the config.json it was imported from, whose other keys (the M-RoPE
    sections of its rope_parameters, its MTP settings, ...) vLLM may read; inside the wrapper it came in, its
    vision_config and token ids as they were."""
    source = cfg.hf_source_config
    text = dict(source.get("text_config", source))
    for legacy in ("rope_scaling", "rope_theta", "full_attention_interval"):   # ours: rope_parameters, layer_types
        text.pop(legacy, None)
    text = text | ours | {"rope_parameters": (text.get("rope_parameters") or {}) | ours["rope_parameters"]}
    wrapper = wrapper_architecture(cfg)
    if wrapper is None:
        return text
    for key in ("architectures", "transformers_version"):      # the wrapper's own, not its text_config's
        text.pop(key, None)
    return source | {"text_config": text, "tie_word_embeddings": cfg.tie_embeddings, "dtype": ours["dtype"],
                     "architectures": [wrapper]}


def _supported(key: str) -> str:
    return ", ".join(a for a, layout in LAYOUTS.items() if key in layout.variable)


def decoder_config_from_hf(hf: dict, source: str = "config.json") -> DecoderConfig:
    """Read a supported HF config; refuse, naming the key, what our decoder cannot reproduce exactly."""
    if hf.get("model_type") in HF_WRAPPERS:
        return _wrapper_config(hf, source)
    arch = _arch(hf, source)
    layout = LAYOUTS[arch]
    if layout.linear_attention:
        return _hybrid_config(hf, arch, source, hf)
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if not isinstance(hf.get(k), int) or isinstance(hf.get(k), bool)]
    if missing:
        raise BaseModelError(f"{source}: required key {missing[0]!r} is missing or not an integer "
                             f"(got {quote(hf.get(missing[0]))})")
    if hf.get("mlp_bias"):
        raise BaseModelError(f"{source}: mlp_bias=true is not supported; supported: MLPs without bias (every layout)")
    _check_attention_and_activation(hf, arch, source)
    partial = _partial_rotary(hf, arch, source)
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if layout.mla:
        return _latent_attention_config(hf, arch, source)
    if head_dim * heads != hf["hidden_size"] and not layout.moe:      # GLM-4.5: 96 heads × 128 over hidden 5120
        raise BaseModelError(f"{source}: head_dim {head_dim} × heads {heads} != hidden_size {hf['hidden_size']}; "
                             "supported: head_dim = hidden_size / num_attention_heads (any head_dim in glm4_moe)")
    _check_heads_and_rotary(heads, kv_heads, head_dim, partial, source)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return DecoderConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_norm_eps=hf.get("rms_norm_eps", 1.5625e-07 if arch in ("glm", "glm4") else 1e-6),   # class defaults
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        arch=arch, attention_bias=_attention_bias(hf, arch, source), partial_rotary_factor=float(partial),
        qk_norm=bool(hf.get("use_qk_norm", False)) if "qk_norm" in layout.variable else None,
        **(_moe_fields(hf, source) if layout.moe else {}),
    )


def _check_heads_and_rotary(heads: int, kv_heads: int, head_dim: int, partial, source: str) -> None:
    if heads % kv_heads:
        raise BaseModelError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    rotary = int(head_dim * partial) if isinstance(partial, (int, float)) and not isinstance(partial, bool) else None
    if rotary is None or not 0 < rotary <= head_dim or rotary % 2:
        raise BaseModelError(f"{source}: partial_rotary_factor {quote(partial)} × head_dim {head_dim} must give an "
                             "even number of rotated dims in (0, head_dim]")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _latent_attention_config(hf: dict, arch: str, source: str) -> DecoderConfig:
    """GLM-4.7-Flash (glm4_moe_lite) and GLM-5 (glm_moe_dsa): multi-head latent attention, experts, and in
    glm_moe_dsa the DSA indexer; refused, naming the key, where our decoder would not reproduce them exactly."""
    defaults = _CLASS_DEFAULTS[arch]
    mla = {k: hf.get(k, defaults[k]) for k in MLA_KEYS}
    if mla["q_lora_rank"] is None and arch == "glm4_moe_lite":
        mla["q_lora_rank"] = 0                                  # one q_proj, no query latent
    for key, value in mla.items():
        if not (_positive_int(value) or (key == "q_lora_rank" and value == 0)):
            need = "a positive integer" + (" (the DSA indexer reads the query latent)" if key == "q_lora_rank" else "")
            raise BaseModelError(f"{source}: {key} {quote(value)} is not supported for model_type {quote(arch)}; "
                                 f"supported: {need}")
    heads = hf["num_attention_heads"]
    if hf.get("num_key_value_heads", heads) != heads:
        raise BaseModelError(f"{source}: num_key_value_heads {quote(hf['num_key_value_heads'])} != num_attention_heads "
                             f"{heads}; supported: equal (latent attention expands one key / value per head)")
    if arch == "glm4_moe_lite" and hf.get("rope_interleave", True) is not True:
        raise BaseModelError(f"{source}: rope_interleave {quote(hf['rope_interleave'])} is not supported; supported: "
                             "true (GLM-4.7-Flash's checkpoints rotate interleaved pairs)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}      # its type and partial rotary: checked
    moe = _moe_fields(hf, source, arch)
    dsa = {}
    if arch == "glm_moe_dsa":
        dsa = {k: hf.get(k, defaults[k]) for k in DSA_KEYS}
        for key, value in dsa.items():
            if not _positive_int(value):
                raise BaseModelError(f"{source}: {key} {quote(value)} must be a positive integer for model_type "
                                     "'glm_moe_dsa'")
        dsa["indexer_types"] = _indexer_types(hf, source)
    return DecoderConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=heads, intermediate_size=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        arch=arch, attention_bias=_attention_bias(hf, arch, source), partial_rotary_factor=1.0,
        **mla, **moe, **dsa)


def _wrapper_config(hf: dict, source: str) -> DecoderConfig:
    """A Qwen3.5 checkpoint as published (the multimodal wrapper): the language model of its text_config, which
    remembers the whole config.json (export writes the wrapper back)."""
    model_type = hf["model_type"]
    text_type = HF_WRAPPERS[model_type][1]
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise BaseModelError(f"{source}: text_config {quote(text)} is not supported; supported: the language model's "
                             f"config (a JSON object) inside a {model_type!r} config")
    if text.get("model_type", text_type) != text_type:
        raise BaseModelError(f"{source}: text_config.model_type {quote(text['model_type'])} is not supported inside a "
                             f"{model_type!r} config; supported: {text_type!r}")
    tie = hf.get("tie_word_embeddings", False)      # what the wrapper class ties by (Qwen3_5Config's default: false)
    if bool(text.get("tie_word_embeddings", tie)) != bool(tie):
        raise BaseModelError(f"{source}: text_config.tie_word_embeddings {quote(text['tie_word_embeddings'])} differs "
                             f"from tie_word_embeddings {quote(tie)}; supported: equal (transformers ties by the outer "
                             "one, the language model alone by the inner)")
    return _hybrid_config(text | {"tie_word_embeddings": tie}, text_type, f"{source} text_config", hf)


def _hybrid_config(hf: dict, arch: str, source: str, whole: dict) -> DecoderConfig:
    """Qwen3.5 (qwen3_5_text, qwen3_5_moe_text): gated DeltaNet and gated attention layers (layer_types), a SwiGLU
    MLP or Qwen's experts in every layer; Qwen3_5(Moe)TextConfig's defaults where config.json leaves a key out.
    Refused, naming the key, where our decoder would not reproduce it exactly; `whole` (the file's config, a
    wrapper's included) is remembered for export."""
    moe = LAYOUTS[arch].moe
    defaults = QWEN3_5_DEFAULTS[arch]
    get = lambda key: hf.get(key, defaults.get(key))      # noqa: E731
    ints = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", *LINEAR_ATTENTION_KEYS, *(QWEN_MOE_KEYS.values() if moe else ("intermediate_size",)))
    for key in ints:
        if not _positive_int(get(key)):
            raise BaseModelError(f"{source}: {key} {quote(get(key))} is not supported; supported: a positive integer")
    if not moe:
        for key in _MOE_KEYS:
            if hf.get(key):
                raise BaseModelError(f"{source}: {key}={quote(hf[key])} (mixture of experts) is not supported for "
                                     f"model_type {arch!r}; supported: experts in qwen3_5_moe_text")
    # Keys transformers' Qwen3.5 ignores but another runtime (vLLM) may honour: only the form it computes is taken.
    for key, want in {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attn_output_gate": True,
                      **({"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []} if moe else {}),
                      }.items():
        if hf.get(key, want) != want and not (want == [] and hf[key] is None):
            raise BaseModelError(f"{source}: {key} {quote(hf[key])} is not supported for model_type {arch!r}; "
                                 f"supported: {want!r}")
    layers, heads, kv_heads = get("num_hidden_layers"), get("num_attention_heads"), get("num_key_value_heads")
    types = hf.get("layer_types")
    if types is None:       # Qwen3_5TextConfig's: every full_attention_interval-th layer is attention
        interval = hf.get("full_attention_interval", 4)
        types = ["full_attention" if _positive_int(interval) and (i + 1) % interval == 0 else "linear_attention"
                 for i in range(layers)] if _positive_int(interval) else None
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        key = "layer_types" if "layer_types" in hf else "full_attention_interval"
        raise BaseModelError(f"{source}: {key} {quote(hf.get(key))} is not supported; supported: one of "
                             f"{list(LAYER_TYPES)} for each of the {layers} layers")
    if get("linear_num_value_heads") % get("linear_num_key_heads"):
        raise BaseModelError(f"{source}: linear_num_value_heads {get('linear_num_value_heads')} is not a multiple of "
                             f"linear_num_key_heads {get('linear_num_key_heads')}; supported: each key head shared by "
                             "a whole number of value heads")
    # rope_parameters' mrope_section / mrope_interleaved (M-RoPE) are taken as they are: they pick which of three
    # position rows (time, height, width) turns each frequency, and for text all three rows are the token's position.
    partial, head_dim = _partial_rotary(hf, arch, source), get("head_dim")
    _check_heads_and_rotary(heads, kv_heads, head_dim, partial, source)
    experts = {ours: get(key) for ours, key in QWEN_MOE_KEYS.items()} if moe else {}
    if moe and not (experts["n_routed_experts"] >= 2 and experts["num_experts_per_tok"] <= experts["n_routed_experts"]):
        raise BaseModelError(f"{source}: num_experts {experts['n_routed_experts']} / num_experts_per_tok "
                             f"{experts['num_experts_per_tok']} are not supported; supported: at least 2 experts, "
                             "each token choosing at most all of them")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return DecoderConfig(
        vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, max_seq_len=get("max_position_embeddings"),
        # unused where every layer is experts (Qwen3_5MoeTextConfig has no intermediate_size)
        intermediate_size=experts["shared_expert_intermediate_size"] if moe else get("intermediate_size"),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), rms_norm_eps=get("rms_norm_eps"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), arch=arch, partial_rotary_factor=float(partial),
        layer_types=tuple(types), **{k: get(k) for k in LINEAR_ATTENTION_KEYS}, **experts, hf_source_config=whole)


def _indexer_types(hf: dict, source: str) -> tuple[str, ...]:
    """glm_moe_dsa's per-layer indexer_types, or the schedule GlmMoeDsaConfig derives it from (index_topk_pattern,
    else index_topk_freq / index_skip_topk_offset)."""
    layers = hf["num_hidden_layers"]
    types = hf.get("indexer_types")
    if types is None and hf.get("index_topk_pattern") is not None:
        pattern = hf["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if (not isinstance(types, list) or len(types) != layers or any(t not in ("full", "shared") for t in types)
            or types[0] != "full"):
        raise BaseModelError(f"{source}: indexer_types {quote(types)} is not supported; supported: 'full' or 'shared' "
                             f"for each of the {layers} layers, the first 'full'")
    return tuple(types)


def _arch(hf: dict, source: str) -> str:
    arch_name = (hf.get("architectures") or ["?"])[0]
    arch = hf.get("model_type")
    if arch not in HF_ARCHITECTURES:
        classes = {**HF_ARCHITECTURES, **{t: wrapper for t, (wrapper, _) in HF_WRAPPERS.items()}}
        supported = ", ".join(f"{a} (model_type '{t}')" for t, a in classes.items())
        raise BaseModelError(f"{source}: model_type {quote(arch)} / {quote(arch_name)} is not supported; "
                             f"supported: {supported}")
    return arch


def _attention_bias(hf: dict, arch: str, source: str) -> bool:
    """Llama/Qwen3's attention_bias also puts a bias on o_proj; Qwen2 has q/k/v bias without a key; GLM's is q/k/v only."""
    layout = LAYOUTS[arch]
    if "attention_bias" in layout.variable:
        return bool(hf.get("attention_bias", layout.attention_bias))
    if hf.get("attention_bias") and arch != "qwen2":
        raise BaseModelError(f"{source}: attention_bias=true is not supported for model_type {quote(arch)} (its "
                             f"layout has no attention bias); supported: q/k/v bias in qwen2, {_supported('attention_bias')}")
    return layout.attention_bias


def _check_attention_and_activation(hf: dict, arch: str, source: str) -> None:
    if not LAYOUTS[arch].moe:
        for key in _MOE_KEYS:
            if hf.get(key):
                raise BaseModelError(f"{source}: {key}={quote(hf[key])} (mixture of experts) is not supported for "
                                     f"model_type {quote(arch)}; supported: experts in glm4_moe (Glm4MoeForCausalLM)")
    own = "indexed_attention" if LAYOUTS[arch].dsa else "full_attention"
    if hf.get("use_sliding_window") or any(t != own for t in hf.get("layer_types") or []):
        what = "use_sliding_window=true" if hf.get("use_sliding_window") else f"layer_types {quote(hf['layer_types'])}"
        raise BaseModelError(f"{source}: {what} (sliding-window attention) is not supported; "
                             "supported: full attention in every layer")
    if hf.get("hidden_act", "silu") != "silu":
        raise BaseModelError(f"{source}: hidden_act {quote(hf['hidden_act'])} is not supported; supported: 'silu'")
    if hf.get("use_qk_norm") and "qk_norm" not in LAYOUTS[arch].variable and not LAYOUTS[arch].qk_norm:
        raise BaseModelError(f"{source}: use_qk_norm=true is not supported for model_type {quote(arch)}; "
                             f"supported: {_supported('qk_norm')} (qwen3 always normalises q/k)")


def _partial_rotary(hf: dict, arch: str, source: str):
    layout = LAYOUTS[arch]
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(rope_key) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))   # legacy configs spell it `type`
    if rope_type != "default":
        raise BaseModelError(f"{source}: {rope_key} rope type {quote(rope_type)} is not supported; supported: 'default'")
    partial = rope.get("partial_rotary_factor")
    partial = hf.get("partial_rotary_factor") if partial is None else partial
    partial = layout.partial_rotary_factor if partial is None else partial     # absent: the class default
    if partial != layout.partial_rotary_factor and "partial_rotary_factor" not in layout.variable:
        raise BaseModelError(f"{source}: partial_rotary_factor {quote(partial)} is not supported for model_type "
                             f"{quote(arch)} (it rotates whole heads); supported: partial rotary in "
                             f"{_supported('partial_rotary_factor')}")
    return partial


def _moe_fields(hf: dict, source: str, arch: str = "glm4_moe") -> dict:
    """The expert settings of a GLM MoE model_type, refused (naming the key) where GLM-4.5's router and experts
    (the same in GLM-4.7-Flash and GLM-5) would not be reproduced exactly."""
    for key, want in _GLM4_MOE_ROUTER.items():
        if key in hf and hf[key] != want:
            raise BaseModelError(f"{source}: {key} {quote(hf[key])} is not supported for model_type {quote(arch)}; "
                                 f"supported: {want!r} (GLM-4.5's router)")
    defaults = MOE_DEFAULTS[arch]        # glm4_moe has none for the expert counts: config.json must hold them
    out = {k: hf.get(k, defaults.get(k)) for k in (*MOE_KEYS, "num_nextn_predict_layers")}
    if LAYOUTS[arch].mla:
        out["first_k_dense_replace"] = _dense_layers(hf, source, arch, defaults)
    for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not isinstance(out[key], int) or isinstance(out[key], bool) or out[key] < 1:
            raise BaseModelError(f"{source}: {key} must be a positive integer for model_type {quote(arch)} "
                                 f"(got {quote(out[key])})")
    experts, groups, k = out["n_routed_experts"], out["n_group"], out["num_experts_per_tok"]
    if groups < 1 or experts % groups or experts // groups < 2:
        raise BaseModelError(f"{source}: n_group {quote(groups)} must divide n_routed_experts {experts} into groups of "
                             "at least 2 experts (a group scores the sum of its two best)")
    if not 1 <= out["topk_group"] <= groups or k > out["topk_group"] * experts // groups:
        raise BaseModelError(f"{source}: topk_group {quote(out['topk_group'])} must be in 1..n_group ({groups}) and leave "
                             f"at least num_experts_per_tok ({k}) experts to choose from")
    if not 0 <= out["first_k_dense_replace"] <= hf["num_hidden_layers"]:
        raise BaseModelError(f"{source}: first_k_dense_replace {quote(out['first_k_dense_replace'])} must be in "
                             f"0..num_hidden_layers ({hf['num_hidden_layers']})")
    return out


def _dense_layers(hf: dict, source: str, arch: str, defaults: dict) -> int:
    """How many leading layers keep a dense MLP, from mlp_layer_types (glm4_moe_lite's default: the first;
    glm_moe_dsa's: first_k_dense_replace); a pattern other than dense-then-experts is refused."""
    layers = hf["num_hidden_layers"]
    types = hf.get("mlp_layer_types")
    if types is None:
        k = 1 if arch == "glm4_moe_lite" else hf.get("first_k_dense_replace", defaults["first_k_dense_replace"])
        k = min(k, layers) if isinstance(k, int) else k
        types = ["dense"] * k + ["sparse"] * (layers - k) if isinstance(k, int) else None
    k = types.count("dense") if isinstance(types, list) else -1
    if not isinstance(types, list) or len(types) != layers or types != ["dense"] * k + ["sparse"] * (layers - k):
        raise BaseModelError(f"{source}: mlp_layer_types {quote(hf.get('mlp_layer_types'))} is not supported; "
                             f"supported: 'dense' layers, then 'sparse' (experts) ones, {layers} in all")
    return k


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


class HFCheckpoint:
    """A local HF model directory's weights under our names, checked against config.json by their names and shapes
    before any is read: a missing weight, one the layout has no place for (e.g. a bias config.json does not declare),
    a shape config.json does not describe, or a separate lm_head beside tie_word_embeddings=true that differs from the
    embedding is refused naming the weight — transformers would drop or re-tie it. `weights()` then reads them one at
    a time (the routed experts stacked as each stack is reached), in the dtype they are stored in, and `carried()`
    GLM's MTP layers as they are. A context manager: the files stay open until it exits."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.cfg = read_hf_config(self.path)
        try:
            self.files = TensorFiles(check_weights(self.path))
        except ValueError as e:         # one weight in two files: which one transformers would load is not ours to pick
            raise BaseModelError(f"{e}; supported: each weight in one *.safetensors file of {self.path}") from None
        try:
            with shapes_only():
                self.model = Decoder(self.cfg)      # on the meta device: the names and shapes to expect
            self.carried_names = self._check()
        except BaseException:
            self.files.close()
            raise

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.files.close()

    def _check(self) -> list[str]:
        """Everything that can be refused, from the files' headers (and the lm_head of a tied model); returns the
        names of the MTP layers' tensors."""
        path, cfg, files = self.path, self.cfg, self.files
        experts, wmap = expert_weight_names(cfg), hf_weight_map(cfg)
        for name in experts:
            require_expert_weights(name, files, cfg, path)
        for weight in wmap.values():
            if weight not in files:
                raise BaseModelError(f"{path}: weight {weight!r} missing from the safetensors files "
                                     f"(config.json describes a {hf_architecture(cfg)})")
        used = set(wmap.values())
        shapes = dict(self.model.state_dict().items())
        expected = {hf: tuple(shapes[ours].shape) for ours, hf in wmap.items()}
        for name, parts in experts.items():
            E, rows, cols = shapes[name].shape
            if hf_name(cfg, name) in files:
                expected[hf_name(cfg, name)] = (E, rows, cols)
            else:
                expected |= {hf: (rows if half is None else rows // 2, cols) for hf, half in parts}
        for weight, want in expected.items():
            if files.shape(weight) != want:
                raise BaseModelError(f"{path}: weight {weight!r} has shape {files.shape(weight)}, config.json "
                                     f"describes {want}")
        used |= set(expected)
        if cfg.tie_embeddings and "lm_head.weight" in files:
            head, embed = files.get("lm_head.weight"), files.get(hf_name(cfg, "model.embed_tokens.weight"))
            dtype = torch.promote_types(head.dtype, embed.dtype)       # no copy where they share one
            if head.shape != embed.shape or not torch.equal(head.to(dtype), embed.to(dtype)):
                raise BaseModelError(f"{path / 'config.json'}: tie_word_embeddings=true, but the safetensors files hold "
                                     "an lm_head.weight that differs from model.embed_tokens.weight; supported: "
                                     "tie_word_embeddings=false with both weights, or true with equal (or no) "
                                     "lm_head.weight")
            used.add("lm_head.weight")
        if cfg.layout.linear_attention:     # Qwen3.5: the MTP tensors, and a wrapper's vision tower
            carried = [k for k in files if k.startswith(QWEN3_5_CARRIED if wrapper_architecture(cfg) else "mtp.")]
        else:
            carried = [k for k in files if k.startswith("model.layers.") and int(k.split(".")[2]) >= cfg.num_layers]
        if carried and not cfg.num_nextn_predict_layers and not cfg.layout.linear_attention:
            raise BaseModelError(f"{path}: weight {min(carried)!r} belongs to layer {min(carried).split('.')[2]}, past "
                                 f"num_hidden_layers {cfg.num_layers}, and config.json declares no "
                                 "num_nextn_predict_layers (MTP layers) it could be")
        used |= set(carried)
        extra = sorted(k for k in files if k not in used and not k.endswith(_IGNORED_SUFFIXES))
        if extra:
            raise BaseModelError(f"{path}: weight {extra[0]!r} ({len(extra)} unexpected in all) has no place in the "
                                 f"{hf_architecture(cfg)} layout config.json describes (check attention_bias, "
                                 "model_type and the layer count)")
        return carried

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(our name, tensor as stored) for each weight of our checkpoint (`native_weight_names`), one at a time."""
        wmap, experts = hf_weight_map(self.cfg), expert_weight_names(self.cfg)
        for name in native_weight_names(self.model):
            if name in experts:
                yield name, read_stacked_experts(name, self.cfg, self.files, self.files.get)
            else:
                yield name, self.files.get(wmap[name])

    def carried(self) -> Iterator[tuple[str, torch.Tensor]]:
        """GLM-4.5's MTP layers (model.layers.L.* for L ≥ num_layers), or Qwen3.5's MTP (mtp.*) and its wrapper's
        vision tower (model.visual.*), as they are on disk."""
        for name in self.carried_names:
            yield name, self.files.get(name)


def load_hf(path: Path) -> Decoder:
    """A local HF directory of a supported architecture → our Decoder in fp32 on the CPU (references and tests;
    the pipeline imports with `import_hf`, which never builds the model). Refused as HFCheckpoint says; GLM-4.5's MTP
    layers are carried (model.carried), not loaded into the forward."""
    with HFCheckpoint(path) as ckpt:
        assign_weights(ckpt.model, ((n, t.float()) for n, t in ckpt.weights()), ckpt.path)
        ckpt.model.carried = dict(ckpt.carried())
        return ckpt.model


def import_hf(path: Path, out_dir: Path, max_file_bytes: int = MAX_FILE_BYTES) -> int:
    """A local HF directory → our native checkpoint in `out_dir`, tensor by tensor in the dtypes stored (HFCheckpoint
    checks it first): never more in memory than one output file's tensors (tensor_files.MAX_FILE_BYTES) and the one
    being read. Returns the parameter count."""
    with HFCheckpoint(path) as ckpt:
        write_native(ckpt.cfg, ckpt.weights(), ckpt.carried(), out_dir, max_file_bytes)
        return ckpt.model.num_params()


def check_tokenizer_fits(path: Path, tokenizer_size: int) -> None:
    """Refuse a base model whose tokenizer has more tokens (len(tokenizer), added tokens included) than
    its config.json `vocab_size`: their ids would index past the embedding. Fewer is fine (GLM-4 and
    Qwen pad vocab_size to a multiple of 64/128)."""
    path = Path(path)
    vocab = read_hf_config(path).vocab_size
    if tokenizer_size > vocab:
        files = [f for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json") if (path / f).is_file()]
        raise BaseModelError(f"{path / 'config.json'}: vocab_size {vocab} is smaller than the tokenizer's "
                             f"{tokenizer_size} tokens ({', '.join(files) or 'tokenizer files'} in {path}); "
                             "supported: a tokenizer of at most vocab_size tokens")


def save_hf(model: Decoder, out_dir: Path, *, bos_id, eos_id, pad_id, dtype: torch.dtype = torch.float32) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sd = model.state_dict()
    tensors = {hf: sd[ours].detach().to(dtype).contiguous() for ours, hf in hf_weight_map(model.config).items()}
    for ours in expert_weight_names(model.config):
        tensors |= split_experts(ours, sd[ours].detach().to(dtype), model.config)
    tensors |= {k: v.contiguous() for k, v in exported_carried(model).items()}   # MTP layers: as carried, dtype too
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    cfg = hf_config_dict(model.config, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, dtype=dtype_name)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


# The HF classes that hold MTP layers (num_nextn_predict_layers in their config; vLLM's MTP speculative decoding).
MTP_ARCHS = ("glm4_moe", "glm4_moe_lite", "glm_moe_dsa")
# What Qwen3.5's checkpoints hold beside the language model, carried from import to export unchanged: the MTP
# module (mtp.*: transformers skips it, vLLM drafts with it) and the wrapper's vision tower.
QWEN3_5_CARRIED = ("mtp.", "model.visual.")


def exported_carried(model: Decoder) -> dict[str, torch.Tensor]:
    """The carried tensors an HF export holds: all of them where the layout's HF class has MTP layers, Qwen3.5's
    own (QWEN3_5_CARRIED, as imported); none elsewhere (a from-scratch model.mtp_layers: 1 of a llama/qwen/glm
    layout, whose transformers and vLLM classes have no place for them: they stay in our native checkpoints),
    logged."""
    cfg = model.config
    keep = {k: v for k, v in model.carried.items()
            if cfg.arch in MTP_ARCHS or (cfg.layout.linear_attention and k.startswith(QWEN3_5_CARRIED))}
    if len(keep) < len(model.carried):
        log.info("export: %d MTP tensors are left out: %s has no place for them in transformers or vLLM "
                 "(they stay in the native checkpoints; MTP exports with %s)", len(model.carried) - len(keep),
                 hf_architecture(cfg), ", ".join(MTP_ARCHS))
    return keep


def native_weight_names(model: Decoder) -> list[str]:
    """What our checkpoint holds of `model`, in order: its state dict without the lm_head tied to the embedding and
    without an attached MTP layer (stored into the carried tensors instead)."""
    return [k for k in model.state_dict() if not k.startswith("mtp.")
            and not (model.config.tie_embeddings and k == "lm_head.weight")]


def write_native(cfg: DecoderConfig, weights: Iterable[tuple[str, torch.Tensor]],
                 carried: Iterable[tuple[str, torch.Tensor]], out_dir: Path, max_file_bytes: int = MAX_FILE_BYTES) -> None:
    """Our checkpoint from (name, tensor) pairs as they come: the weights (`model`), the carried tensors (`carried`,
    none: no file) — each one file or several of at most `max_file_bytes` (model/tensor_files.py) — and the decoder
    config (readable with `cat`), written last: a directory without it is no checkpoint."""
    out_dir = Path(out_dir)
    write_tensors(out_dir, NATIVE_WEIGHTS, weights, max_file_bytes)
    carried = iter(carried)
    first = next(carried, None)
    if first is not None:
        write_tensors(out_dir, NATIVE_CARRIED, itertools.chain([first], carried), max_file_bytes)
    else:
        remove_tensors(out_dir, NATIVE_CARRIED)         # none now: none left from an earlier save either
    atomic_write_text(out_dir / NATIVE_CONFIG, json.dumps(cfg.to_dict(), indent=2))


def save_native(model: Decoder, out_dir: Path, max_file_bytes: int = MAX_FILE_BYTES) -> None:
    """Our own checkpoint of `model` (see `write_native`), one tensor at a time to the CPU; an attached MTP layer
    (model/mtp.py) is stored into the carried tensors first."""
    from glm_lora.model import mtp      # model/mtp.py builds on this module
    if mtp.attached(model) is not None:
        mtp.store(model)
    state = model.state_dict()
    write_native(model.config, ((k, state[k].detach().cpu()) for k in native_weight_names(model)),
                 model.carried.items(), out_dir, max_file_bytes)


@dataclass(frozen=True)
class Placement:
    """Where `load_native` puts each weight and in which dtype: `dtypes` by name (absent: fp32; None: as stored) and
    `nf4`, the routed-experts stacks it quantises to 4 bits (model/quant.py NF4Params) expert by expert on `device`,
    so that no full-precision stack is ever built. A LoRA stage's: model/lora.py `base_placement`."""

    device: torch.device = torch.device("cpu")
    dtypes: Mapping[str, torch.dtype | None] = field(default_factory=dict)
    nf4: frozenset[str] = frozenset()

    def read(self, files: TensorFiles, name: str) -> tuple[str, torch.Tensor | NF4Params]:
        if name in self.nf4:
            experts = files.shape(name)[0]
            return name, NF4Params.stacked((files.row(name, e).to(self.device) for e in range(experts)), experts)
        return name, files.get(name).to(device=self.device, dtype=self.dtypes.get(name, torch.float32))


def load_native(path: Path, device: str | torch.device = "cpu",
                place: Callable[[DecoderConfig], Placement] | None = None) -> Decoder:
    """Our checkpoint (either layout, model/tensor_files.py) → Decoder, built on the meta device and filled one
    weight at a time straight onto its device, so no second copy of the model is ever made: fp32 on `device`, or as
    `place(config)` says (a LoRA stage's frozen weights in the compute dtype, its routed experts quantised as they
    arrive). The carried tensors stay on the CPU as stored."""
    path = Path(path)
    cfg = DecoderConfig.from_dict(json.loads((path / NATIVE_CONFIG).read_text()))
    placement = place(cfg) if place else Placement(torch.device(device))
    with shapes_only():
        model = Decoder(cfg)
    names = native_weight_names(model)
    with TensorFiles.of(path, NATIVE_WEIGHTS) as files:
        if not len(files):
            raise FileNotFoundError(f"{path}: no {NATIVE_WEIGHTS}.safetensors nor {index_name(NATIVE_WEIGHTS)}")
        missing, extra = [n for n in names if n not in files], sorted(set(files) - set(names))
        if missing or extra:
            raise ValueError(f"{path}: weight {(missing or extra)[0]!r} {'missing from' if missing else 'unexpected in'}"
                             f" the checkpoint ({len(missing)} missing, {len(extra)} unexpected; config.json "
                             f"describes a {cfg.arch} of {cfg.num_layers} layers)")
        assign_weights(model, (placement.read(files, n) for n in names), path)
    with TensorFiles.of(path, NATIVE_CARRIED) as files:
        model.carried = {k: files.get(k) for k in files}
    return model


def assign_weights(model: Decoder, weights: Iterable[tuple[str, torch.Tensor | nn.Module]], source: Path) -> None:
    """Each (name, tensor) put into the shapes-only `model` in place of its meta tensor, as it comes (a routed-experts
    stack may come as its 4-bit module); lm_head tied to the embedding where the config says so. A shape other than
    the model's, or a weight left unassigned, is refused naming it."""
    for name, value in weights:
        owner, attr = name.rsplit(".", 1)
        module = model.get_submodule(owner)
        old = getattr(module, attr)
        if tuple(value.shape) != tuple(old.shape):
            raise ValueError(f"{source}: weight {name!r} has shape {tuple(value.shape)}, the model's is "
                             f"{tuple(old.shape)}")
        if isinstance(value, nn.Module):
            delattr(module, attr)
            setattr(module, attr, value)
        elif attr in module._parameters:
            module._parameters[attr] = nn.Parameter(value, requires_grad=old.requires_grad)
        else:
            module._buffers[attr] = value
    if model.config.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    left = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"{source}: weight {left[0]!r} ({len(left)} in all) was never loaded")
