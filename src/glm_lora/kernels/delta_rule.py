"""Gated DeltaNet's sequence mixing in pure PyTorch (Qwen3.5's linear-attention layers): the gated delta rule, in
chunks (training, prefill) and token by token (decoding), and the short causal depthwise convolution before it.
The references every faster path (flash-linear-attention's kernels on CUDA, kernels/ops.py) is tested against.

Per head, a state S (Dk × Dv) carries the sequence: at token t it decays by exp(g_t), then is corrected toward
v_t along k_t by β_t (the delta rule) and read by q_t:

    S ← exp(g_t) S;   S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ;   o_t = Sᵀ q_t

with q, k L2-normalised and q scaled by Dk^-½. The chunked form does the same in chunks of C tokens: inside a chunk
the corrections are solved at once (a unit lower-triangular system, the WY form), between chunks the state passes.

Packed rows: each document starts from a zero state and a zero convolution window (`documents`), as if it ran alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim, as flash-linear-attention's (and transformers') kernels."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """fp32, heads first (B, H, T, ·), q and k normalised, q scaled."""
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
    return l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k), v, g, beta


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: torch.Tensor | None = None, chunk: int = CHUNK
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule. q, k: (B, T, H, Dk); v: (B, T, H, Dv); g (log decay, ≤ 0), beta: (B, T, H);
    initial_state (B, H, Dk, Dv) or None (zeros). Returns (o (B, T, H, Dv) in v's dtype, final state (B, H, Dk, Dv)
    in fp32). Token t's output reads only tokens ≤ t, so padding after a sequence's end changes none of its outputs."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    pad = -T % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (t.reshape(B, H, n, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    gamma = g.cumsum(-1)                                                      # log decay from the chunk's start
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()   # i ≥ j
    kb = k * beta[..., None]
    # Corrections inside a chunk: (I + L) U = β v and (I + L) W = β k e^γ, L strictly lower: β_i k_i·k_j e^(γi−γj).
    system = (kb @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * gamma.exp()[..., None], upper=False, unitriangular=True)
    scores = q @ k.transpose(-1, -2) * decay                                 # intra-chunk, diagonal included
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    state = (torch.zeros(B, H, Dk, Dv, device=q.device) if initial_state is None else initial_state.float())
    out = []
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ state
        out.append(q_decayed[:, :, c] @ state + scores[:, :, c] @ v_new)
        state = state * gamma[:, :, c, -1, None, None].exp() + k_to_end[:, :, c].transpose(-1, -2) @ v_new
    o = torch.stack(out, 2).reshape(B, H, n * chunk, Dv)[:, :, :T]
    return o.transpose(1, 2).to(dtype), state


def gated_delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule token by token (decoding; the chunked form's test oracle). Same arguments and results."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, T, Dk = k.shape
    state = torch.zeros(B, H, Dk, v.shape[-1], device=q.device) if initial_state is None else initial_state.float()
    out = []
    for t in range(T):
        state = state * g[:, :, t, None, None].exp()
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, 2).transpose(1, 2).to(dtype), state


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                  lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the causal depthwise convolution over time. x: (B, T, D); weight: (D, K); state: the K−1 inputs
    before x (B, D, K−1), zeros if None. Returns (y (B, T, D), the new state: the last K−1 inputs, or with `lengths`
    (B,) the last K−1 of each row's first lengths[b] inputs, for rows right-padded past them)."""
    B, T, D = x.shape
    K = weight.shape[-1]
    xt = x.transpose(1, 2)
    past = xt.new_zeros(B, D, K - 1) if state is None else state.to(xt.dtype)
    full = torch.cat([past, xt], dim=-1)                                       # (B, D, K − 1 + T)
    y = F.conv1d(full.to(weight.dtype), weight[:, None], groups=D)             # (B, D, T)
    end = torch.full((B,), T, device=x.device) if lengths is None else lengths
    at = (end[:, None] + torch.arange(K - 1, device=x.device))[:, None].expand(B, D, K - 1)
    return F.silu(y).transpose(1, 2).to(x.dtype), full.gather(-1, at)


class Documents:
    """Packed rows (B, T) seen as one batch of documents (N, L): each run of equal doc ids within a row is a
    document, padded at its end to the longest. `split` moves a (B, T, ...) tensor there, `join` back."""

    def __init__(self, doc_ids: torch.Tensor):
        B, T = doc_ids.shape
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        flat = starts.flatten()
        self.doc = flat.long().cumsum(0) - 1                                  # each token's document
        first = torch.nonzero(flat).flatten()                                  # each document's first token
        self.offset = torch.arange(B * T, device=doc_ids.device) - first[self.doc]
        self.count, self.length = len(first), int(self.offset.max()) + 1 if B * T else 0
        self.shape = (B, T)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(self.count, self.length, *x.shape[2:])
        out[self.doc, self.offset] = x.reshape(-1, *x.shape[2:])
        return out

    def join(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.doc, self.offset].reshape(*self.shape, *x.shape[2:])
