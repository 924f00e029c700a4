"""The glm-lora decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU — readable in one sitting.

Module names follow transformers' LlamaForCausalLM exactly (model.layers.N.self_attn.q_proj, ...)
so the weight map in model/hf.py is explicit and trivial, and PEFT adapter keys line up.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.utils.checkpoint

import kernels


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
    qk_norm: bool = False       # RMSNorm on each head's q and k (Qwen3/OLMo2): bounds attention logits

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)     # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = kernels.apply_rope(q, k, cos, sin)
        y = kernels.attention(q, k, v, mask)                                            # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))                     # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
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

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states (B, T, C); the loss heads apply lm_head themselves (fusable).

        With `doc_ids` (packed rows), attention stays inside each document.
        """
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin = kernels.rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        mask = None if doc_ids is None else kernels.document_causal_mask(doc_ids)
        x = self.model.embed_tokens(input_ids)                                    # (B, T, C)
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.model.layers:
            if checkpointing:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask)
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
