"""The glm-lora decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, mixture of experts — readable in
one sitting.

One decoder, ten Hugging Face layouts (`DecoderConfig.arch`, see LAYOUTS): Llama, Qwen2 (q/k/v bias),
Qwen3 (q/k RMSNorm), GLM (q/k/v bias, fused gate_up_proj, GLM's interleaved partial RoPE), GLM-4-0414
(GLM plus a norm on each branch's output), GLM-4.5 (glm4_moe: after `first_k_dense_replace` dense layers,
each MLP is a mixture of routed experts plus shared experts; partial RoPE in halves, optional q/k norm),
GLM-4.7-Flash (glm4_moe_lite: GLM-4.5's experts under multi-head latent attention, MLA), GLM-5
(glm_moe_dsa: MLA whose queries each attend only to the keys DeepSeek sparse attention's indexer picks) and
Qwen3.5 (qwen3_5_text, qwen3_5_moe_text: gated DeltaNet linear-attention layers, model/delta_net.py, beside gated
full attention, per `layer_types`; zero-centred norms; the MoE variant routes by softmax beside a gated shared expert).
Module names follow transformers' classes of that layout exactly (model.layers.N.self_attn.q_proj,
...mlp.gate_up_proj, ...mlp.experts.gate_up_proj, ...) so the weight map in model/hf.py is one explicit list
per architecture and PEFT adapter keys line up.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, fields, replace
from typing import Iterator, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from glm_lora.kernels import delta_rule, ops as kernels
from glm_lora.model.delta_net import GatedDeltaNet
@dataclass(frozen=True)
class Layout:
    """What one HF architecture's decoder layer has (names as in its transformers modeling file)."""

    attention_bias: bool = False         # bias on q/k/v (never on o)
    partial_rotary_factor: float = 1.0   # share of each head's dims RoPE rotates; the rest pass through
    variable: tuple[str, ...] = ()       # which of attention_bias, partial_rotary_factor, qk_norm a model may set
    qk_norm: bool = False                # RMSNorm on each head's q and k before RoPE
    fused_gate_up: bool = False          # one mlp.gate_up_proj whose output is [gate | up]
    sandwich_norms: bool = False         # post_self_attn_layernorm / post_mlp_layernorm on each branch's output
    rope_interleaved: bool = False       # RoPE rotates pairs (x0, x1), (x2, x3)… instead of halves
    moe: bool = False                    # layers ≥ first_k_dense_replace: routed + shared experts (MoE below)
    mla: bool = False                    # multi-head latent attention (LatentAttention below)
    dsa: bool = False                    # MLA reads only the keys its indexer selects (Indexer below)
    linear_attention: bool = False       # layer_types: gated DeltaNet (model/delta_net.py) or full attention
    gated_attention: bool = False        # q_proj also gives a per-head output gate: o_proj(y · sigmoid(gate))
    zero_centered_norms: bool = False    # RMSNorm scales by 1 + weight (weights stored around zero)
    router: str = "glm"                  # "glm": Router below; "softmax": SoftmaxRouter, a gated shared_expert


_GLM = dict(attention_bias=True, partial_rotary_factor=0.5, variable=("attention_bias", "partial_rotary_factor"),
            fused_gate_up=True, rope_interleaved=True)   # transformers' GlmConfig/Glm4Config defaults
_QWEN3_5 = dict(qk_norm=True, partial_rotary_factor=0.25, variable=("partial_rotary_factor",), linear_attention=True,
                gated_attention=True, zero_centered_norms=True)
LAYOUTS = {
    "llama": Layout(),
    "qwen2": Layout(attention_bias=True),                # Qwen2Attention: q/k/v bias always on
    "qwen3": Layout(qk_norm=True),
    "glm": Layout(**_GLM),                               # GLM-4-9B-chat-hf (GlmForCausalLM)
    "glm4": Layout(**_GLM, sandwich_norms=True),         # GLM-4-0414 (Glm4ForCausalLM)
    "glm4_moe": Layout(partial_rotary_factor=0.5, moe=True,   # GLM-4.5/4.6/4.7 (Glm4MoeForCausalLM)
                       variable=("attention_bias", "partial_rotary_factor", "qk_norm")),
    "glm4_moe_lite": Layout(moe=True, mla=True, rope_interleaved=True, variable=("attention_bias",)),  # GLM-4.7-Flash
    "glm_moe_dsa": Layout(moe=True, mla=True, dsa=True, rope_interleaved=True,                        # GLM-5 / 5.1 / 5.2
                          variable=("attention_bias",)),
    "qwen3_5_text": Layout(**_QWEN3_5),                                   # Qwen3.5 dense (Qwen3_5ForCausalLM)
    "qwen3_5_moe_text": Layout(**_QWEN3_5, moe=True, router="softmax"),   # Qwen3.5 MoE (Qwen3_5MoeForCausalLM)
}
LAYER_TYPES = ("linear_attention", "full_attention")      # a hybrid layout's layers: gated DeltaNet or attention
INDEXER_TYPES = ("full", "shared")      # a DSA layer runs its indexer, or reuses the previous full layer's choice


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden_size: int = 192
    num_layers: int = 3
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 0                            # 0: hidden_size / num_heads (GLM-4.5 sets its own)
    intermediate_size: int = 512
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    arch: str = "llama"                          # a key of LAYOUTS
    attention_bias: bool | None = None           # None: the layout's default
    partial_rotary_factor: float | None = None   # None: the layout's default
    qk_norm: bool | None = None                  # None: the layout's default
    # Mixture of experts (layout.moe; transformers' Glm4MoeConfig names): from layer first_k_dense_replace on,
    # each token goes to num_experts_per_tok of n_routed_experts experts (chosen in the best topk_group of
    # n_group groups), plus n_shared_experts' worth of an always-on expert.
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0            # GLM's MTP layers: `Decoder.carried`, run as MTPLayer (model/mtp.py)
    # Multi-head latent attention (layout.mla; transformers' DeepSeek-V3 names): queries from a q_lora_rank latent
    # (0: one q_proj), keys and values from one kv_lora_rank latent plus a qk_rope_head_dim key shared by the heads;
    # each head's key is [nope | rope], its value v_head_dim wide. head_dim is the rotated qk_rope_head_dim.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek sparse attention (layout.dsa): each query attends to the index_topk keys its indexer scores highest
    # (index_n_heads heads of index_head_dim); per layer, indexer_types says "full" (own indexer) or "shared".
    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    indexer_types: tuple[str, ...] = ()
    # Hybrid linear attention (layout.linear_attention; transformers' Qwen3_5TextConfig names): per layer,
    # layer_types says gated DeltaNet ("linear_attention": linear_num_key/value_heads of linear_key/value_head_dim,
    # a causal convolution of linear_conv_kernel_dim taps) or gated full attention. The MoE variant's shared expert
    # is shared_expert_intermediate_size wide.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    shared_expert_intermediate_size: int = 0
    # The config.json a Qwen3.5 model was imported from (model/hf.py), whole: a multimodal wrapper's with its
    # text_config. Export writes back what our fields do not hold (vision_config, token ids, M-RoPE sections, MTP
    # settings) and the wrapper class around the language model; None: exported from our fields alone.
    hf_source_config: dict | None = None

    def __post_init__(self):
        if self.arch not in LAYOUTS:
            raise ValueError(f"arch {self.arch!r} is not supported; supported: {', '.join(LAYOUTS)}")
        layout = LAYOUTS[self.arch]
        if layout.mla:
            self._check_mla(layout)
        if layout.linear_attention:
            self._check_linear_attention()
        self.head_dim = self.head_dim or self.hidden_size // self.num_heads
        for key in ("attention_bias", "partial_rotary_factor", "qk_norm"):
            if getattr(self, key) is None:
                setattr(self, key, getattr(layout, key))
            elif key not in layout.variable and getattr(self, key) != getattr(layout, key):
                raise ValueError(f"{key}={getattr(self, key)} is not part of the {self.arch} layout "
                                 f"(always {getattr(layout, key)}); supported: "
                                 f"{', '.join(a for a, l in LAYOUTS.items() if key in l.variable)}")
        if self.layout.moe and self.first_k_dense_replace < self.num_layers and not (
                self.n_routed_experts >= 2 and 1 <= self.num_experts_per_tok <= self.n_routed_experts
                and self.moe_intermediate_size >= 1 and self.n_routed_experts % self.n_group == 0):
            raise ValueError(f"arch {self.arch} needs n_routed_experts ≥ 2 (a multiple of n_group), num_experts_per_tok "
                             "in 1..n_routed_experts and moe_intermediate_size ≥ 1 for its MoE layers")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} × head_dim {self.head_dim} must "
                             "give an even number of rotated dims")

    def _check_mla(self, layout: Layout) -> None:
        self.head_dim, self.num_kv_heads = self.qk_rope_head_dim, self.num_heads   # keys: one per head, from the latent
        dims = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if any(getattr(self, k) < 1 for k in dims) or self.q_lora_rank < 0:
            raise ValueError(f"arch {self.arch} needs {', '.join(dims)} ≥ 1 (q_lora_rank ≥ 0)")
        if not layout.dsa:
            return
        self.indexer_types = tuple(self.indexer_types) or ("full",) * self.num_layers
        if (len(self.indexer_types) != self.num_layers or set(self.indexer_types) - set(INDEXER_TYPES)
                or self.indexer_types[0] != "full"):
            raise ValueError(f"indexer_types needs one of {INDEXER_TYPES} per layer ({self.num_layers}), the first "
                             f"'full' (a shared layer reuses an earlier full layer's choice); got {self.indexer_types}")
        if min(self.index_topk, self.index_head_dim, self.index_n_heads, self.q_lora_rank) < 1 or (
                self.index_head_dim < self.qk_rope_head_dim):
            raise ValueError(f"arch {self.arch} needs index_topk, index_n_heads, q_lora_rank ≥ 1 and index_head_dim ≥ "
                             "qk_rope_head_dim (the indexer reads the query latent and rotates its first dims)")

    def _check_linear_attention(self) -> None:
        self.layer_types = tuple(self.layer_types) or tuple(
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(self.num_layers))
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types needs one of {LAYER_TYPES} per layer ({self.num_layers}); "
                             f"got {self.layer_types}")
        heads = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")
        if min(getattr(self, k) for k in heads) < 1 or self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"arch {self.arch} needs {', '.join(heads)} ≥ 1, value heads a multiple of key heads")

    def is_linear_attention_layer(self, i: int) -> bool:
        return self.layout.linear_attention and self.layer_types[i] == "linear_attention"

    @property
    def layout(self) -> Layout:
        return LAYOUTS[self.arch]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.layout.mla else self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.layout.moe and i >= self.first_k_dense_replace

    @property
    def rotary_dim(self) -> int:   # int(), as transformers' default RoPE init does
        return int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict:
        return asdict(self) | {"indexer_types": list(self.indexer_types),
                               "layer_types": list(self.layer_types)}                # as JSON holds it

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        """Tolerant: unknown keys are dropped; checkpoints from before `arch` say `qk_norm` instead."""
        d = dict(d)
        d["indexer_types"] = tuple(d.get("indexer_types") or ())
        d["layer_types"] = tuple(d.get("layer_types") or ())
        if "arch" not in d:
            d["arch"] = "qwen3" if d.get("qk_norm") else "llama"
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


class RMSNorm(nn.Module):
    """`zero_centered` (Qwen3.5): the weight is stored around zero and the norm scales by 1 + weight, in fp32."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps, self.zero_centered = eps, zero_centered

    def scale(self) -> torch.Tensor:
        return self.weight.float() + 1 if self.zero_centered else self.weight

    def forward(self, x, out_dtype: torch.dtype | None = None):
        return kernels.rms_norm(x, self.scale(), self.eps, out_dtype)

    def add(self, x, residual, out_dtype: torch.dtype | None = None):
        """(x + residual, the norm of it), the residual stream's add fused into the norm; residual None: (x, norm)."""
        if residual is None:
            return x, self(x, out_dtype)
        return kernels.add_rms_norm(x, residual, self.scale(), self.eps, out_dtype)


def layout_norm(cfg: "DecoderConfig", dim: int) -> RMSNorm:
    """The layout's RMSNorm over `dim` (zero-centred in Qwen3.5)."""
    return RMSNorm(dim, cfg.rms_norm_eps, cfg.layout.zero_centered_norms)


def _matmul_input_dtype(x: torch.Tensor, read_once: bool) -> torch.dtype | None:
    """The dtype to write the norm of `x` in: autocast's where one matrix product reads it (`read_once`), which
    would cast it to that anyway — the same numbers without an fp32 copy and a cast, and its one gradient arrives as
    before; None without autocast or with several readers (their gradients are summed in fp32, as transformers')."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if read_once and torch.is_autocast_enabled(dev) else None


def _attention_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype attention computes `t` in: under CUDA autocast SDPA casts to the autocast dtype; on the CPU
    attention runs in fp32 under autocast (kernels/reference.attention), so a tensor keeps its own."""
    if t.is_cuda and torch.is_autocast_enabled("cuda") and t.is_floating_point():
        return torch.get_autocast_dtype("cuda")
    return t.dtype


class KVCache:
    """Every layer's keys and values so far, for incremental greedy decoding (evaluation/decode.py).

    Rows may be at different lengths: each forward writes its tokens' keys/values at their own
    `position_ids`, and a new token attends to the slots up to its position. The first forward (the
    prompts, from position 0) attends as without a cache (plain causal); slots past a row's real length
    hold padding's keys until that row's next tokens overwrite them, and are masked until then.
    Linear-attention layers (gated DeltaNet) keep each row's convolution window and state instead, which only
    its real tokens advance: `lengths` (B,) says where each right-padded prompt ends (None: no padding).
    """

    def __init__(self, slots: int, lengths: torch.Tensor | None = None):
        self.slots, self.k, self.v = slots, {}, {}     # per attention layer: (B, Hkv, slots, D)
        self.positions, self.prefill, self.started = None, True, False
        self.lengths = lengths
        self.linear: dict[int, tuple] = {}              # per linear-attention layer: (window, state)
        self.index_keys: dict[int, torch.Tensor] = {}  # DSA: per full layer, its indexer's keys (B, slots, D)
        self.chosen: dict[int, torch.Tensor] = {}      # DSA: per full layer, this forward's key choice (B, 1, T, S)

    def start(self, position_ids: torch.Tensor):
        """Called once per forward: None while prefilling (causal), else the (B, 1, T, slots) bool mask."""
        self.prefill, self.started, self.positions = not self.started, True, position_ids
        self.chosen = {}
        if self.prefill:
            return None
        return (torch.arange(self.slots, device=position_ids.device) <= position_ids[..., None])[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, D) at this forward's positions; return what attention sees."""
        if layer not in self.k:     # each in the dtype attention reads it in: under autocast, q/k-normed keys (qwen3)
            # come out of the fp32 RMSNorm, values in bf16; CUDA attention casts both to bf16 (the CPU's stays fp32)
            self.k[layer] = k.new_zeros(*k.shape[:2], self.slots, k.shape[-1], dtype=_attention_dtype(k))
            self.v[layer] = v.new_zeros(*v.shape[:2], self.slots, v.shape[-1], dtype=_attention_dtype(v))
        at = self.positions[:, None, :, None]
        self.k[layer].scatter_(2, at.expand(-1, k.shape[1], -1, k.shape[-1]), k.to(self.k[layer].dtype))
        self.v[layer].scatter_(2, at.expand(-1, v.shape[1], -1, v.shape[-1]), v.to(self.v[layer].dtype))
        return (k, v) if self.prefill else (self.k[layer], self.v[layer])

    def update_index(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Store a DSA indexer's keys k (B, T, D) at this forward's positions; return what its queries score."""
        if layer not in self.index_keys:
            self.index_keys[layer] = k.new_zeros(k.shape[0], self.slots, k.shape[-1])
        self.index_keys[layer].scatter_(1, self.positions[..., None].expand(-1, -1, k.shape[-1]), k)
        return k if self.prefill else self.index_keys[layer]

    def delta_net(self, layer: int, qkv, weight, g, beta, heads) -> torch.Tensor:
        """A gated DeltaNet layer's sequence mixing (model/delta_net.py) from its saved window and state, which it
        advances: the prompts' padding leaves both as the row's last real token left them (no decay, no write)."""
        window, state = self.linear.get(layer, (None, None))
        lengths = self.lengths if self.prefill else None
        if lengths is not None:
            real = (self.positions < lengths[:, None])[..., None]
            g, beta = g * real, beta * real
        y, window = delta_rule.causal_conv1d(qkv, weight, window, lengths)
        rule = delta_rule.gated_delta_rule if qkv.shape[1] > 1 else delta_rule.gated_delta_rule_recurrent
        o, state = rule(*heads(y), g, beta, state)
        self.linear[layer] = (window, state)
        return o


def stacks(x: torch.Tensor, *linears: nn.Module) -> bool:
    """Whether sibling projections of one input (q/k/v, gate/up) run as one op (`stacked`): where the kernels stack
    siblings and the modules can share one (plain linears, or their class's `groupable`, e.g. LoRA's)."""
    if not kernels.stacks_siblings(x):
        return False
    groupable = getattr(type(linears[0]), "groupable", None)
    if groupable is not None:
        return groupable(linears)
    return all(type(m) is nn.Linear for m in linears) and len({m.bias is None for m in linears}) == 1


def stacked(x: torch.Tensor, *linears: nn.Module) -> torch.Tensor | None:
    """The siblings' outputs side by side on the last dim from one op where they `stacks`; None otherwise."""
    if not stacks(x, *linears):
        return None
    group = getattr(type(linears[0]), "project_group", None)
    if group is not None:
        return group(x, linears)
    return kernels.stacked_linear(x, [m.weight for m in linears], [m.bias for m in linears])


def project(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """The projections of one input, each output on its own: views of one stacked op's output, or one by one."""
    out = stacked(x, *linears)
    if out is None:
        return tuple(m(x) for m in linears)
    return out.split([m.out_features for m in linears], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx                  # its slot in a KVCache
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.interleaved = cfg.layout.rope_interleaved
        self.gated = cfg.layout.gated_attention      # Qwen3.5: q_proj gives each head [query | gate]
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim * (2 if self.gated else 1), bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = layout_norm(cfg, cfg.head_dim)
            self.k_norm = layout_norm(cfg, cfg.head_dim)

    def siblings(self) -> tuple[nn.Module, ...]:
        """The projections of x, one op where they `stacks` (model.lora lays their frozen weights out for it)."""
        return self.q_proj, self.k_proj, self.v_proj

    def reads_input_once(self, x) -> bool:
        return stacks(x, *self.siblings())

    def forward(self, x, cos, sin, mask, cache: KVCache | None = None):
        B, T, _ = x.shape
        q, k, v = project(x, *self.siblings())
        gate = None
        if self.gated:
            q, gate = q.view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(B, T, -1)
        q = q.reshape(B, T, self.n_heads, self.head_dim).transpose(1, 2)             # (B, H, T, D)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)                   # (B, Hkv, T, D)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = kernels.apply_rope(q, k, cos, sin, interleaved=self.interleaved)
        if cache is not None:                   # decoding: the keys/values of every position so far
            k, v = cache.update(self.layer_idx, k, v)
        y = kernels.attention(q, k, v, mask).transpose(1, 2).reshape(B, T, -1)         # (B, T, H·D)
        if gate is not None:
            y = y * torch.sigmoid(gate)
        return self.o_proj(y)                                                        # (B, T, C)


class HybridMask(NamedTuple):
    """What the layers of a hybrid layout (layer_types) read besides their input: the attention layers' mask, and the
    packed rows (None: one sequence per row) at whose document boundaries the linear-attention layers reset — or
    continue a shared prompt (data.packing's prefix_docs)."""
    attention: object
    rows: delta_rule.PackedRows | None


def longest_document(doc_ids: torch.Tensor) -> int:
    """The most tokens any one document (a run of equal ids in a row) has in packed rows (B, T); one host sync."""
    B, T = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    begin = torch.nonzero(starts.flatten()).flatten()
    ends = torch.cat([begin[1:], begin.new_tensor([B * T])])
    row_ends = (begin // T + 1) * T               # a run stops at its row's end too
    return int(torch.minimum(ends, row_ends).sub(begin).max())


class KeySelection:
    """One forward's DeepSeek sparse attention state: the packed rows' documents (None: one per row) and each full
    indexer layer's choice of keys (B, T, K), which the shared layers after it reuse. Passed to the layers in place
    of the attention mask when some document is longer than index_topk (else the dense mask is exact)."""

    def __init__(self, doc_ids: torch.Tensor | None, prefix_docs: torch.Tensor | None = None):
        self.doc_ids, self.prefix_docs = doc_ids, prefix_docs      # prefix_docs: the shared prompt each token reads
        self.chosen: dict[int, torch.Tensor] = {}


class Indexer(nn.Module):
    """GLM-5's DSA indexer (transformers' GlmMoeDsaIndexer): queries from the attention's query latent (wq_b), one
    shared LayerNorm'd key (wk, k_norm), per-head weights from the hidden state (weights_proj), the first
    qk_rope_head_dim dims rotated (interleaved). Frozen under LoRA, as every peer trains GLM-5: it runs without
    gradients and only chooses keys."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, cfg.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)

    @torch.no_grad()
    def queries_and_keys(self, x, q_latent, cos, sin):
        """q (B, T, H, D), k (B, T, D), weights (B, T, H)."""
        B, T, _ = x.shape
        q = self.wq_b(q_latent).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.wk(x))[:, None].to(q.dtype)        # LayerNorm gives fp32 under autocast
        q, k = kernels.apply_rope(q, k, cos, sin, interleaved=True)     # the first qk_rope_head_dim dims
        weights = self.weights_proj(x).float() * self.n_heads ** -0.5
        return q.transpose(1, 2), k[:, 0], weights

    @torch.no_grad()
    def choose(self, x, q_latent, cos, sin, selection: "KeySelection") -> torch.Tensor:
        """Each query's top-k keys (B, T, min(index_topk, T)) among the earlier ones of its document (and its shared
        prompt's), -1 past the allowed ones; scored in query tiles (kernels.index_topk), never a T × T matrix."""
        q, k, weights = self.queries_and_keys(x, q_latent, cos, sin)
        return kernels.index_topk(q, k, weights, selection.doc_ids, self.topk, self.head_dim ** -0.5,
                                  prefix_docs=selection.prefix_docs)

    @torch.no_grad()
    def choose_cached(self, x, q_latent, cos, sin, cache: KVCache, layer: int, mask) -> torch.Tensor:
        """Decoding: the new tokens' choice among every cached position, as a bool mask (B, 1, T, S) within `mask`
        (the cache's; None while prefilling: causal)."""
        q, k, weights = self.queries_and_keys(x, q_latent, cos, sin)
        keys = cache.update_index(layer, k)
        scores = kernels.indexer_scores(q, keys, weights, self.head_dim ** -0.5)    # (B, T, S)
        if mask is None:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=x.device).tril()[None, None]
        scores = scores.masked_fill(~mask[:, 0], float("-inf"))
        top = scores.topk(min(self.topk, scores.shape[-1]), dim=-1)
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
        return chosen[:, None]


# The sparse path in absorbed form (DeepSeek's MLA inference trick, as FlashMLA's sparse kernels run it): kv_b_proj is
# folded into the queries and the output, so every head reads one shared latent key per chosen position (one gather
# for all heads) instead of its own expanded key and value. Which form is faster is measured (bench/dsa_gpu.py).
ABSORBED_SPARSE = {"cuda": True, "cpu": False}


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3; GLM-4.7-Flash, GLM-5; transformers' DeepseekV3Attention names).

    Queries: q_a_proj → q_a_layernorm → q_b_proj (or one q_proj without a query latent). Keys and values:
    kv_a_proj_with_mqa gives a kv_lora_rank latent and one rotated key slice every head shares; kv_a_layernorm →
    kv_b_proj expands the latent into each head's [k_nope | v]. A head's key is [k_nope | k_rope] (qk_head_dim),
    its value v_head_dim wide; RoPE (interleaved pairs) turns the rope slices; softmax scale qk_head_dim^-½.
    With DSA (glm_moe_dsa) each query attends only to the keys the layer's indexer chose (a "shared" layer takes the
    previous full layer's choice): `mask` is then a KeySelection and attention is kernels.sparse_attention."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.kv_rank = cfg.num_heads, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        C, H, bias = cfg.hidden_size, cfg.num_heads, cfg.attention_bias
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(C, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)           # transformers' default eps, not the config's
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(C, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(C, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, C, bias=bias)
        self.scale = cfg.qk_head_dim ** -0.5
        self.dsa = cfg.layout.dsa
        if self.dsa and cfg.indexer_types[layer_idx] == "full":
            self.indexer = Indexer(cfg)
        # the full layer whose choice this one takes (itself if full)
        self.chooser = max(i for i in range(layer_idx + 1) if cfg.indexer_types[i] == "full") if self.dsa else None

    def siblings(self) -> tuple[nn.Module, ...]:
        """The projections of x: the query (latent) and the key/value latent, one op where they `stacks`."""
        return (self.q_a_proj if hasattr(self, "q_a_proj") else self.q_proj), self.kv_a_proj_with_mqa

    def reads_input_once(self, x) -> bool:
        return not hasattr(self, "indexer") and stacks(x, *self.siblings())   # the indexer reads x as well

    def forward(self, x, cos, sin, mask, cache: KVCache | None = None):
        B, T, _ = x.shape
        H = self.n_heads
        q, kv_a = project(x, *self.siblings())
        q_latent = None
        if hasattr(self, "q_a_proj"):
            q_latent = self.q_a_layernorm(q)
            q = self.q_b_proj(q_latent)
        q_nope, q_rope = q.view(B, T, H, self.nope + self.rope).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        latent, k_rope = kv_a.split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope, k_rope = kernels.apply_rope(q_rope, k_rope.view(B, T, 1, self.rope).transpose(1, 2), cos, sin,
                                            interleaved=True)
        if isinstance(mask, KeySelection):          # DSA's sparse path: the full layers choose, shared ones reuse
            if hasattr(self, "indexer"):
                mask.chosen[self.layer_idx] = self.indexer.choose(x, q_latent, cos, sin, mask)
            chosen = mask.chosen[self.chooser]
            if ABSORBED_SPARSE.get(x.device.type, False) and kernels.sparse_kernel_pays(q, T):
                return self.o_proj(self._absorbed_sparse(q_nope, q_rope, latent, k_rope, chosen).transpose(1, 2)
                                   .reshape(B, T, H * self.v_dim))
        kv = self.kv_b_proj(latent).view(B, T, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)                                   # (B, H, T, qk_head_dim)
        k = torch.cat((k_nope, k_rope.expand(B, H, T, self.rope)), dim=-1)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
            if self.dsa:
                if hasattr(self, "indexer"):
                    cache.chosen[self.layer_idx] = self.indexer.choose_cached(x, q_latent, cos, sin, cache,
                                                                              self.layer_idx, mask)
                mask = cache.chosen[self.chooser]
        if isinstance(mask, KeySelection):
            y = kernels.sparse_attention(q, k, v, mask.chosen[self.chooser], self.scale)
        else:
            y = kernels.attention(q, k, v, mask)                                   # (B, H, T, v_head_dim)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * self.v_dim))

    def _absorbed_sparse(self, q_nope, q_rope, latent, k_rope, chosen):
        """Sparse attention over the latent: score = q_nope·W_UK c + q_rope·k_rope = (W_UKᵀ q_nope)·c + q_rope·k_rope,
        output = W_UV (Σ p c); the same numbers as the expanded form, with kv_b_proj's weight (its LoRA included)
        split into W_UK (H, nope, r) and W_UV (H, v, r)."""
        B, H, T, _ = q_nope.shape
        w = getattr(self.kv_b_proj, "effective_weight", lambda: self.kv_b_proj.weight)()
        w = w.view(H, self.nope + self.v_dim, self.kv_rank)
        q = torch.cat((torch.einsum("bhtn,hnr->bhtr", q_nope, w[:, :self.nope]), q_rope.to(q_nope.dtype)), dim=-1)
        k = torch.cat((latent, k_rope[:, 0].to(latent.dtype)), dim=-1)[:, None]        # (B, 1, T, r + rope)
        if torch.is_autocast_enabled(q.device.type):
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k = q.to(dtype), k.to(dtype)
        out = kernels.sparse_attention(q, k, k[..., :self.kv_rank], chosen, self.scale)   # (B, H, T, r)
        return torch.einsum("bhtr,hvr->bhtv", out, w[:, self.nope:].to(out.dtype))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        if cfg.layout.fused_gate_up:    # GLM: one projection, output [gate | up]
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        else:
            self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
            self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def siblings(self) -> tuple[nn.Module, ...]:
        """gate and up, one op where they `stacks`; none where the layout fuses them (gate_up_proj)."""
        return () if hasattr(self, "gate_up_proj") else (self.gate_proj, self.up_proj)

    def reads_input_once(self, x) -> bool:
        siblings = self.siblings()
        return len(siblings) > 0 and stacks(x, *siblings)     # not bool(tuple): a graph break in torch 2.11's dynamo

    def forward(self, x):
        if hasattr(self, "gate_up_proj"):
            gate_up = self.gate_up_proj(x)                                          # (B, T, 2I): [gate | up]
        else:
            gate_up = stacked(x, *self.siblings())
            if gate_up is None:
                return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(kernels.swiglu_halves(gate_up))


class Router(nn.Module):
    """GLM-4.5's router (DeepSeek-V3's): sigmoid scores per expert; the choice adds a load-balancing bias
    (e_score_correction_bias, set by the model's trainers, frozen here) and keeps the experts of the best
    `topk_group` of `n_group` groups (a group scores the sum of its two best); the weights are the chosen plain
    scores, renormalised (norm_topk_prob) and scaled (routed_scaling_factor). In fp32, as transformers'."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))
        self.stats: dict | None = None           # the last training forward's routing (engine/router_stats.py)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        N, E = x.shape[0], self.weight.shape[0]                                   # x: (N, C)
        scores = F.linear(x.float(), self.weight.float()).sigmoid()                # (N, E)
        choice = scores + self.e_score_correction_bias
        group_scores = choice.view(N, self.n_group, -1).topk(2, dim=-1)[0].sum(-1)   # (N, n_group)
        best_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, best_groups, 1).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(E // self.n_group, dim=1), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1, sorted=False)[1]                 # (N, k)
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.training:
            self.stats = {"experts": experts.detach(), "scores": scores}
        return experts, weights * self.scaling


class Experts(nn.Module):
    """The routed experts as stacked weights (transformers 5's in-memory layout): gate_up_proj (E, 2I, C)
    with [gate | up] rows, down_proj (E, C, I). Each token's chosen experts run as grouped GEMMs
    (kernels.moe_experts); LoRA on them is model/lora.py's LoRAExperts. Under QLoRA each stack is a frozen 4-bit
    module instead of a parameter (model/quant.py NF4Params); `operands()` gives what the kernels read either way."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        E, C, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, C))
        self.down_proj = nn.Parameter(torch.empty(E, C, I))

    def operands(self) -> tuple:
        """(gate_up, down): each the stacked weight, or its 4-bit module's kernels.reference.NF4Stack."""
        return tuple(w if isinstance(w, torch.Tensor) else w.stack() for w in (self.gate_up_proj, self.down_proj))

    def forward(self, x, experts, weights):
        return kernels.moe_experts(x, experts, weights, *self.operands())


class SoftmaxRouter(nn.Module):
    """Qwen's router (Qwen3_5MoeTopKRouter): softmax over the experts in fp32, the top-k chosen, their probabilities
    renormalised to sum to one."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.stats: dict | None = None           # as Router's

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x, self.weight).float().softmax(-1)                       # (N, E)
        weights, experts = scores.topk(self.top_k, dim=-1)
        if self.training:
            self.stats = {"experts": experts.detach(), "scores": scores}
        return experts, weights / weights.sum(-1, keepdim=True)


ROUTERS = (Router, SoftmaxRouter)


class MoE(nn.Module):
    """Routed experts (each token's top-k, weighted) plus the shared expert every token goes through."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def reads_input_once(self, x) -> bool:
        return False        # the router, the experts and the shared expert; the router scores in fp32, as transformers'

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(B * T, C)                                                 # (N, C)
        experts, weights = self.gate(flat)                                         # (N, k) each
        return self.experts(flat, experts, weights).view(B, T, C) + self.shared_experts(x)


class GatedSharedMoE(nn.Module):
    """Qwen's mixture (Qwen3_5MoeSparseMoeBlock): SoftmaxRouter's routed experts plus one shared_expert whose output
    is scaled by sigmoid(shared_expert_gate(x)), a learned per-token gate."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate = SoftmaxRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def reads_input_once(self, x) -> bool:
        return False        # the router, the experts, the shared expert and its gate

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        experts, weights = self.gate(flat)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(flat, experts, weights).view(B, T, C) + shared


# Compiled (engine/compile.py) on CUDA, each block is cut into two graphs before its MLP: inductor's single graph over
# the whole stack ran the 125M pretraining step 1.15x slower (H100, torch 2.11: 43.1 vs 37.4 ms a step, bench/RESULTS.md
# "One graph or two per block"). The CPU's compiled LoRA step was measured as one graph and stays one.
COMPILE_SPLITS_BLOCKS = {"cuda": True, "cpu": False}


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = layout_norm(cfg, cfg.hidden_size)
        if cfg.is_linear_attention_layer(layer_idx):
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = LatentAttention(cfg, layer_idx) if cfg.layout.mla else Attention(cfg, layer_idx)
        self.post_attention_layernorm = layout_norm(cfg, cfg.hidden_size)   # (pre-MLP, despite its name)
        moe = GatedSharedMoE if cfg.layout.router == "softmax" else MoE
        self.mlp = moe(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg)
        if cfg.layout.sandwich_norms:   # GLM-4-0414: each branch's output is normalised before the residual add
            self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, h, cos, sin, mask, cache: KVCache | None = None):
        """x: the residual stream; h: the previous block's output, not yet added to it (None before the first).
        Returns the same pair: each residual add runs inside the RMSNorm that reads the sum (kernels.add_rms_norm)."""
        linear = hasattr(self, "linear_attn")
        mixer = self.linear_attn if linear else self.self_attn
        x, n = self.input_layernorm.add(x, h, _matmul_input_dtype(x, mixer.reads_input_once(x)))
        if linear:
            h = self.linear_attn(n, mask.rows, cache)
        else:           # a hybrid layout's attention layers read their part of the mask (HybridMask)
            h = self.self_attn(n, cos, sin, mask.attention if isinstance(mask, HybridMask) else mask, cache)
        if hasattr(self, "post_self_attn_layernorm"):
            h = self.post_self_attn_layernorm(h)
        if COMPILE_SPLITS_BLOCKS.get(x.device.type, False) and torch.compiler.is_compiling():
            torch._dynamo.graph_break()
        x, n = self.post_attention_layernorm.add(x, h, _matmul_input_dtype(x, self.mlp.reads_input_once(x)))
        h = self.mlp(n)
        if hasattr(self, "post_mlp_layernorm"):
            h = self.post_mlp_layernorm(h)
        return x, h


def mtp_config(cfg: DecoderConfig) -> DecoderConfig:
    """The config an MTP layer's block is built from: the model's, its layer index L = num_layers one past the last
    (MoE or dense as `is_moe_layer(L)` says); under DSA the block has its own indexer, as vLLM's GLM-5 MTP."""
    types = cfg.indexer_types + ("full",) if cfg.layout.dsa else cfg.indexer_types
    return replace(cfg, num_layers=cfg.num_layers + 1, indexer_types=types)


class SharedHead(nn.Module):
    """An MTP layer's output norm, and its own output head where its checkpoint has one (else the model's lm_head)."""

    def __init__(self, cfg: DecoderConfig, own_head: bool):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if own_head:
            self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class MTPLayer(Block):
    """GLM's (DeepSeek-V3's) multi-token prediction layer, as vLLM runs it (Glm4MoeMultiTokenPredictorLayer): slot t
    reads token t+1's embedding e (zero at position 0) and the model's final normed hidden state h_t;
    x = eh_proj([enorm(e) | hnorm(h)]) goes through one decoder block of the model's own layout (built from
    `mtp_config`, layer index L), and shared_head.norm of the block's output (residual + branch) gives the
    logits of token t+2 through shared_head.head (or the model's lm_head). It is a Block, so its names are the
    checkpoint's model.layers.{L}.* exactly: enorm, hnorm, eh_proj, shared_head.{norm,head}, embed_tokens and the
    block's own. `own_embed` / `own_head`: the checkpoint's layer has its own embedding / output head."""

    def __init__(self, cfg: DecoderConfig, own_embed: bool = False, own_head: bool = False):
        super().__init__(cfg, cfg.num_layers - 1)
        C = cfg.hidden_size
        self.enorm = RMSNorm(C, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(C, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * C, C, bias=False)
        self.shared_head = SharedHead(cfg, own_head)
        if own_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, C)

    def forward(self, embeds, hidden, positions, cos, sin, mask, cache: KVCache | None = None):
        """embeds (B, T, C): the next tokens' embeddings; hidden (B, T, C): the model's final normed hidden states at
        `positions` (B, T). Returns shared_head.norm of the block's output (B, T, C), the head's input."""
        embeds = embeds.masked_fill((positions == 0)[..., None], 0)     # vLLM: position 0's input is not needed
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x, h = super().forward(x, None, cos, sin, mask, cache)
        return self.shared_head.norm(x + h)


class Backbone(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = layout_norm(cfg, cfg.hidden_size)


_INITIALISERS = ("normal_", "uniform_", "zeros_", "ones_", "constant_", "kaiming_uniform_", "kaiming_normal_",
                 "xavier_uniform_", "xavier_normal_", "trunc_normal_")


def _skipping_meta(init):
    def skip(tensor, *args, **kwargs):
        return tensor if tensor.is_meta else init(tensor, *args, **kwargs)
    return skip


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Modules built inside live on the meta device (shapes, no memory) and skip torch.nn.init: random init of a
    meta tensor runs torch's Python decompositions, whose first use imports torch._dynamo (~1 s of every config
    check, engine/preflight.py). Only meta tensors skip it: a model another thread builds meanwhile is initialised."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    try:
        for name in _INITIALISERS:
            setattr(nn.init, name, _skipping_meta(saved[name]))
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init_weights)
        self.gradient_checkpointing = False     # recompute each block in backward: less memory, ~1/3 more compute
        # Weights a checkpoint holds that this forward does not run (GLM's MTP layers, HF names): carried from import
        # to export byte for byte (model/hf.py) unless a stage trains the MTP layer, which model/mtp.py builds from
        # them as an MTPLayer (`self.mtp`) and writes back. Plain tensors: no parameter, no state dict entry.
        self.carried: dict[str, torch.Tensor] = {}
        self.attention_paths: dict[str, int] = {}   # DSA: forwards per path ("dense", "sparse"), see hidden_states

    @staticmethod
    def _init_weights(m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding) + ROUTERS):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)                          # as transformers initialises q/k/v biases
        if isinstance(m, Experts):
            nn.init.normal_(m.gate_up_proj, mean=0.0, std=0.02)
            nn.init.normal_(m.down_proj, mean=0.0, std=0.02)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      doc_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                      prefix_docs: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states (B, T, C); the loss heads apply lm_head themselves (fusable).

        With `doc_ids` (packed rows), attention stays inside each document, and with `prefix_docs` also
        reaches the shared prompt each token names (data.packing). With a `cache` (decoding, no doc_ids)
        the tokens at `position_ids` attend to the cached positions too (see KVCache).
        """
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin, mask = self.attention_inputs(position_ids, doc_ids, prefix_docs, cache)
        x, h = self.model.embed_tokens(input_ids), None                           # (B, T, C); h: see Block
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.model.layers:
            if checkpointing:
                x, h = torch.utils.checkpoint.checkpoint(layer, x, h, cos, sin, mask, use_reentrant=False)
            else:
                x, h = layer(x, h, cos, sin, mask, cache)
        return self.model.norm.add(x, h)[1]

    def attention_inputs(self, position_ids, doc_ids=None, prefix_docs=None, cache: KVCache | None = None):
        """What every layer of a forward reads besides its input: the RoPE tables (B, T, rotary_dim) at `position_ids`,
        and the mask — the packed rows' document mask, the cache's while decoding, or a KeySelection where DSA takes
        its sparse path (see `sparse_attention_pays`)."""
        cfg = self.config
        cos, sin = kernels.rope_cos_sin(position_ids, cfg.rotary_dim, cfg.rope_theta,
                                        interleaved=cfg.layout.rope_interleaved)
        if cfg.layout.linear_attention:
            mask = cache.start(position_ids) if cache is not None else (
                None if doc_ids is None else kernels.document_causal_mask(doc_ids, prefix_docs))
            rows = None if doc_ids is None or cache is not None else delta_rule.PackedRows(doc_ids, prefix_docs)
            return cos, sin, HybridMask(mask, rows)
        if cache is not None:
            return cos, sin, cache.start(position_ids)
        if cfg.layout.dsa and self.sparse_attention_pays(position_ids.shape[1], doc_ids, prefix_docs):
            return cos, sin, KeySelection(doc_ids, prefix_docs)
        return cos, sin, None if doc_ids is None else kernels.document_causal_mask(doc_ids, prefix_docs)

    def sparse_attention_pays(self, T: int, doc_ids, prefix_docs) -> bool:
        """DSA: whether a forward over rows of T tokens takes the sparse path (each query its index_topk chosen keys)
        or the dense one, which is exact while no document is longer than index_topk (every earlier key is then
        chosen). Counted in `attention_paths` for the stage metrics. Past index_topk, packed rows cost one host sync
        (`longest_document`); a shared prompt's answers read it as well, so there the row's length decides."""
        topk = self.config.index_topk
        sparse = T > topk and (doc_ids is None or prefix_docs is not None or longest_document(doc_ids) > topk)
        path = "sparse" if sparse else "dense"
        self.attention_paths[path] = self.attention_paths.get(path, 0) + 1
        return sparse

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids, position_ids, doc_ids))  # (B, T, V)

    def num_params(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None = None) -> list[int]:
        """Greedy decoding without a KV cache: fine for the tiny model and for parity checks."""
        ids = torch.tensor([prompt_ids], device=self.lm_head.weight.device)
        out: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(self(ids[:, -self.config.max_seq_len:])[0, -1].argmax())
            out.append(nxt)
            if nxt == eos_id:
                break
            ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
        return out
