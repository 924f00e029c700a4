"""Qwen3.5's linear-attention layer, gated DeltaNet (transformers' Qwen3_5GatedDeltaNet names), for model/model.py.

x → in_proj_qkv → a short causal depthwise convolution (conv1d, SiLU) → q, k, v; per value head a decay
g = −exp(A_log)·softplus(in_proj_a x + dt_bias) and a write strength β = sigmoid(in_proj_b x); the gated delta rule
(kernels/delta_rule.py) mixes the sequence; each head's output is RMS-normalised and gated by SiLU(in_proj_z x)
(`norm`), then out_proj. Key heads are shared by num_v_heads / num_k_heads value heads. Packed rows reset the
convolution window and the state at each document (an answer continues its shared prompt's); decoding keeps both
per sequence (model.KVCache).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from glm_lora.kernels import ops as kernels
from glm_lora.kernels.delta_rule import PackedRows


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, times SiLU of its gate, in fp32 (Qwen3_5RMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, gate):
        return (kernels.rms_norm(x, self.weight, self.eps) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_k, self.n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        C, key_dim, value_dim = cfg.hidden_size, self.n_k * self.dk, self.n_v * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.linear_conv_kernel_dim, groups=self.conv_dim,
                                padding=cfg.linear_conv_kernel_dim - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.empty(self.n_v).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, C, bias=False)
        self.in_proj_qkv = nn.Linear(C, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(C, value_dim, bias=False)
        self.in_proj_b = nn.Linear(C, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(C, self.n_v, bias=False)

    def siblings(self) -> tuple[nn.Module, ...]:
        """The projections of x, one op where they `stacks`."""
        return self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def reads_input_once(self, x) -> bool:
        from glm_lora.model.model import stacks     # at call time: model.py imports this module
        return stacks(x, *self.siblings())

    def forward(self, x, rows: PackedRows | None = None, cache=None):
        """x (B, T, C); rows: packed rows' documents and shared prompts (None: one sequence per row); cache: decoding
        (model.KVCache), which holds each sequence's convolution window and state between forwards."""
        from glm_lora.model.model import project
        B, T, _ = x.shape
        qkv, z, b, a = project(x, *self.siblings())
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)       # (B, T, Hv), ≤ 0
        weight = self.conv1d.weight[:, 0]                                           # (D, K)
        if cache is None:
            qkv = kernels.causal_conv1d(qkv, weight, rows)
            o = kernels.gated_delta_rule(*self._heads(qkv), g, beta, rows)
        else:
            o = cache.delta_net(self.layer_idx, qkv, weight, g, beta, self._heads)
        o = self.norm(o.reshape(B, T, self.n_v, self.dv), z.reshape(B, T, self.n_v, self.dv))
        return self.out_proj(o.reshape(B, T, -1))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolved (B, T, D) split into q, k (B, T, Hk, Dk) and v (B, T, Hv, Dv); the kernels share each key
        head among its Hv / Hk value heads."""
        B, T, _ = qkv.shape
        q, k, v = qkv.split([self.n_k * self.dk, self.n_k * self.dk, self.n_v * self.dv], dim=-1)
        return q.reshape(B, T, self.n_k, self.dk), k.reshape(B, T, self.n_k, self.dk), v.reshape(B, T, self.n_v, self.dv)
