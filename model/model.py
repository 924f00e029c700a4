"""The glm-lora decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU — readable in one sitting.

One decoder, five Hugging Face layouts (`DecoderConfig.arch`, see LAYOUTS): Llama, Qwen2 (q/k/v bias),
Qwen3 (q/k RMSNorm), GLM (q/k/v bias, fused gate_up_proj, GLM's interleaved partial RoPE) and GLM-4-0414
(GLM plus a norm on each branch's output). Module names follow transformers' classes of that layout
exactly (model.layers.N.self_attn.q_proj, ...mlp.gate_up_proj, ...) so the weight map in model/hf.py
is one explicit list per architecture and PEFT adapter keys line up.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.utils.checkpoint

import kernels


@dataclass(frozen=True)
class Layout:
    """What one HF architecture's decoder layer has (names as in its transformers modeling file)."""

    attention_bias: bool = False         # bias on q/k/v (never on o)
    partial_rotary_factor: float = 1.0   # share of each head's dims RoPE rotates; the rest pass through
    variable: tuple[str, ...] = ()       # which of the two above a model of this family may set otherwise
    qk_norm: bool = False                # RMSNorm on each head's q and k before RoPE
    fused_gate_up: bool = False          # one mlp.gate_up_proj whose output is [gate | up]
    sandwich_norms: bool = False         # post_self_attn_layernorm / post_mlp_layernorm on each branch's output
    rope_interleaved: bool = False       # RoPE rotates pairs (x0, x1), (x2, x3)… instead of halves


_GLM = dict(attention_bias=True, partial_rotary_factor=0.5, variable=("attention_bias", "partial_rotary_factor"),
            fused_gate_up=True, rope_interleaved=True)   # transformers' GlmConfig/Glm4Config defaults
LAYOUTS = {
    "llama": Layout(),
    "qwen2": Layout(attention_bias=True),                # Qwen2Attention: q/k/v bias always on
    "qwen3": Layout(qk_norm=True),
    "glm": Layout(**_GLM),                               # GLM-4-9B-chat-hf (GlmForCausalLM)
    "glm4": Layout(**_GLM, sandwich_norms=True),         # GLM-4-0414 (Glm4ForCausalLM)
}


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden_size: int = 192
    num_layers: int = 3
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    arch: str = "llama"                          # a key of LAYOUTS
    attention_bias: bool | None = None           # None: the layout's default
    partial_rotary_factor: float | None = None   # None: the layout's default

    def __post_init__(self):
        if self.arch not in LAYOUTS:
            raise ValueError(f"arch {self.arch!r} is not supported; supported: {', '.join(LAYOUTS)}")
        layout = LAYOUTS[self.arch]
        for key in ("attention_bias", "partial_rotary_factor"):
            if getattr(self, key) is None:
                setattr(self, key, getattr(layout, key))
            elif key not in layout.variable and getattr(self, key) != getattr(layout, key):
                raise ValueError(f"{key}={getattr(self, key)} is not part of the {self.arch} layout "
                                 f"(always {getattr(layout, key)}); supported: "
                                 f"{', '.join(a for a, l in LAYOUTS.items() if key in l.variable)}")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} × head_dim {self.head_dim} must "
                             "give an even number of rotated dims")

    @property
    def layout(self) -> Layout:
        return LAYOUTS[self.arch]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:   # int(), as transformers' default RoPE init does
        return int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        """Tolerant: unknown keys are dropped; checkpoints from before `arch` say `qk_norm` instead."""
        d = dict(d)
        if "arch" not in d:
            d["arch"] = "qwen3" if d.get("qk_norm") else "llama"
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return kernels.rms_norm(x, self.weight, self.eps)


class KVCache:
    """Every layer's keys and values so far, for incremental greedy decoding (engine/evaluate.py).

    Rows may be at different lengths: each forward writes its tokens' keys/values at their own
    `position_ids`, and a new token attends to the slots up to its position. The first forward (the
    prompts, from position 0) attends as without a cache (plain causal); slots past a row's real length
    hold padding's keys until that row's next tokens overwrite them, and are masked until then.
    """

    def __init__(self, slots: int):
        self.slots, self.k, self.v = slots, [], []     # per layer: (B, Hkv, slots, D)
        self.positions, self.prefill = None, True

    def start(self, position_ids: torch.Tensor):
        """Called once per forward: None while prefilling (causal), else the (B, 1, T, slots) bool mask."""
        self.prefill, self.positions = not self.k, position_ids
        if self.prefill:
            return None
        return (torch.arange(self.slots, device=position_ids.device) <= position_ids[..., None])[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, D) at this forward's positions; return what attention sees."""
        if layer == len(self.k):
            self.k.append(k.new_zeros(*k.shape[:2], self.slots, k.shape[-1]))
            self.v.append(torch.zeros_like(self.k[-1]))
        where = self.positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
        self.k[layer].scatter_(2, where, k)
        self.v[layer].scatter_(2, where, v)
        return (k, v) if self.prefill else (self.k[layer], self.v[layer])


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx                  # its slot in a KVCache
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.interleaved = cfg.layout.rope_interleaved
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.layout.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache: KVCache | None = None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)     # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = kernels.apply_rope(q, k, cos, sin, interleaved=self.interleaved)
        if cache is not None:                   # decoding: the keys/values of every position so far
            k, v = cache.update(self.layer_idx, k, v)
        y = kernels.attention(q, k, v, mask)                                            # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))                     # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        if cfg.layout.fused_gate_up:    # GLM: one projection, output [gate | up]
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        else:
            self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
            self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)                       # 2 × (B, T, I)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(kernels.swiglu(gate, up))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)   # (pre-MLP, despite its name)
        self.mlp = MLP(cfg)
        if cfg.layout.sandwich_norms:   # GLM-4-0414: each branch's output is normalised before the residual add
            self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache: KVCache | None = None):
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        if hasattr(self, "post_self_attn_layernorm"):
            h = self.post_self_attn_layernorm(h)
        x = x + h
        h = self.mlp(self.post_attention_layernorm(x))
        if hasattr(self, "post_mlp_layernorm"):
            h = self.post_mlp_layernorm(h)
        return x + h


class Backbone(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


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

    @staticmethod
    def _init_weights(m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)                          # as transformers initialises q/k/v biases

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      doc_ids: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states (B, T, C); the loss heads apply lm_head themselves (fusable).

        With `doc_ids` (packed rows), attention stays inside each document. With a `cache` (decoding,
        no doc_ids) the tokens at `position_ids` attend to the cached positions too (see KVCache).
        """
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        cfg = self.config
        cos, sin = kernels.rope_cos_sin(position_ids, cfg.rotary_dim, cfg.rope_theta,
                                        interleaved=cfg.layout.rope_interleaved)   # (B, T, rotary_dim)
        mask = None if doc_ids is None else kernels.document_causal_mask(doc_ids)
        if cache is not None:
            mask = cache.start(position_ids)
        x = self.model.embed_tokens(input_ids)                                    # (B, T, C)
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.model.layers:
            if checkpointing:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, cache)
        return self.model.norm(x)

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
