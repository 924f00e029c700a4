"""Pure-PyTorch reference ops. The fused Triton kernels must match these (forward and backward)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Normalise in fp32 like transformers' LlamaRMSNorm, then cast back. `out_dtype`: the result rounded to it
    (what autocast would do to it before a matrix product); None keeps the promoted dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(x.dtype)
    return y if out_dtype is None else y.to(out_dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's add and the RMSNorm that reads it: (x + residual, rms_norm(x + residual))."""
    s = x + residual
    return s, rms_norm(s, weight, eps, out_dtype)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float,
                 interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (B, T, rotary_dim) for `positions` (B, T), frequencies as transformers' default RoPE.

    rotary_dim is the head dim, or fewer for partial rotary (GLM: head_dim × partial_rotary_factor).
    Layout: rotate-half (Llama/Qwen: [f0 … fn, f0 … fn]) or interleaved (GLM: [f0, f0, f1, f1, …],
    what transformers' modeling_glm4.apply_rotary_pos_emb builds with repeat_interleave).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.float32) / rotary_dim))
    freqs = positions.float()[..., None] * inv_freq          # (B, T, rotary_dim/2)
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()                              # (B, T, rotary_dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GLM's rotate_half: each pair (x0, x1) → (-x1, x0)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: (B, H, T, D); cos, sin: (B, T, R) with R ≤ D: the first R dims of each head rotate, the
    rest pass through unchanged (partial rotary, GLM). `interleaved`: rotate pairs, not halves."""
    cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
    rotate = _rotate_pairs if interleaved else _rotate_half
    R = cos.shape[-1]

    def rope(x):
        if R == x.shape[-1]:
            return x * cos + rotate(x) * sin
        x_rot, x_pass = x[..., :R], x[..., R:]
        return torch.cat((x_rot * cos + rotate(x_rot) * sin, x_pass), dim=-1)
    return rope(q), rope(k)


def document_causal_mask(doc_ids: torch.Tensor, prefix_docs: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) document ids → (B, 1, T, T) bool mask: attend to earlier tokens of the same document, and
    to every token of the document `prefix_docs` names (a shared prompt placed before it; -1: none).

    Padding (id 0) attends to earlier padding only, so no row of the mask is empty (no NaNs).
    """
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    mask = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal
    if prefix_docs is not None:
        mask |= prefix_docs[:, :, None] == doc_ids[:, None, :]
    return mask[:, None]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Causal attention, optionally confined to documents. q (B, H, T, D); k, v (B, Hkv, T, D).

    Under autocast on the CPU it runs in fp32 (output in q's dtype): the bf16 CPU flash-attention
    backward took ~4.5x the fp32 one's time at the tiny default's shapes (bench/RESULTS.md, "Two cores:
    bf16"), while the matmuls around it gain from bf16 (AMX)."""
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return attention_in_fp32(q, k, v, mask)
    return _attention(q, k, v, mask)


def attention_in_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    with torch.autocast(q.device.type, enabled=False):
        return _attention(q.float(), k.float(), v.float(), mask).to(q.dtype)


# Whether SDPA gets grouped k/v heads in place together with a mask: SDPA's fused CUDA kernels take a mask or GQA,
# not both (else: the slow math path), so CUDA repeats k/v; the CPU flash kernel takes both, and reading the shared
# heads in place is 1.06-1.09x the tiny default's whole SFT step (bench/RESULTS.md "Two cores: grouped k/v heads").
GQA_WITH_MASK = {"cpu": True}


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if gqa and not GQA_WITH_MASK.get(q.device.type, False):
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_halves(gate_up: torch.Tensor) -> torch.Tensor:
    """swiglu of gate_up = [gate | up] on the last dim (one GEMM's stacked output)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu(gate, up)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                scale: float, dropout: float = 0.0, training: bool = False) -> torch.Tensor:
    """y = x Wᵀ + scale · dropout(x) Aᵀ Bᵀ, with W (out, in), A (r, in), B (out, r)."""
    lora_in = F.dropout(x, dropout, training) if dropout > 0 else x
    return F.linear(x, weight) + scale * F.linear(F.linear(lora_in, lora_a), lora_b)


def lora_linear_group(x: torch.Tensor, weights: list[torch.Tensor], lora_as: list[torch.Tensor],
                      lora_bs: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Sibling LoRA linears over one input (q/k/v, gate/up): each `lora_linear(x, W_i, A_i, B_i, scale)`, side by
    side on the last dim."""
    return torch.cat([lora_linear(x, w, a, b, scale) for w, a, b in zip(weights, lora_as, lora_bs)], dim=-1)


def scaled_mm(m1: torch.Tensor, m2: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha · m1 m2 in one GEMM (alpha applied in the epilogue, one rounding): the fused LoRA paths' building block."""
    out = torch.empty(m1.shape[0], m2.shape[1], dtype=m1.dtype, device=m1.device)
    return out.addmm_(m1, m2, beta=0, alpha=alpha)


def lora_gemm(a: torch.Tensor, b: torch.Tensor, p: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
    """a·b + scale·(p·q) in fp32, rounded once to a's dtype (kernels/triton_lora_gemm.py's specification)."""
    return (a.float() @ b.float() + scale * (p.float() @ q.float())).to(a.dtype)


def check_grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, values: bool = True) -> None:
    """The grouped ops' argument rules (ValueError naming the broken one): x (M, K), w (G, N, K) of x's dtype
    and device, offsets (G,) int32 on x's device. `values`: also the offsets' values — non-decreasing, ≥ 0,
    offsets[-1] == M — which reads them on the host (a sync on CUDA: the Triton op skips it there)."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped mm: x must be (M, K) and w (G, N, K), got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"grouped mm: x and w differ in dtype/device ({x.dtype}/{x.device} vs {w.dtype}/{w.device})")
    if offsets.dim() != 1 or offsets.dtype != torch.int32 or offsets.numel() != w.shape[0] or w.shape[0] == 0:
        raise ValueError(f"grouped mm: offsets must be (G,) = ({w.shape[0]},) int32 (cumulative end rows), "
                         f"got {tuple(offsets.shape)} {offsets.dtype}")
    if offsets.device != x.device:
        raise ValueError(f"grouped mm: offsets on {offsets.device}, x on {x.device}")
    if values:
        ends = offsets.tolist()
        if any(e < s for s, e in zip([0] + ends, ends)) or ends[-1] != x.shape[0]:
            raise ValueError(f"grouped mm: offsets must be non-decreasing from 0 and end at M = {x.shape[0]}, "
                             f"got {ends[:8]}{' …' if len(ends) > 8 else ''}")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y[rows_g] = x[rows_g] · w[g]ᵀ per group g, the rows of group g being offsets[g-1]:offsets[g]
    (torch._grouped_mm's `offs`: cumulative end rows). x (M, K) sorted by group, w (G, N, K) → y (M, N).

    A Python loop over the groups, one F.linear each (the per-expert loop a MoE layer runs without a grouped
    GEMM); differentiable by autograd, dw only when w requires grad. Reads the offsets on the host. Its
    backward is slow by construction: each group's slice and weight index adds a full-size gradient. Under
    autocast both operands go to the autocast dtype first, as F.linear's would (and the Triton op's do)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    check_grouped(x, w, offsets)
    ends = offsets.tolist()
    parts = [F.linear(x[s:e], w[g]) for g, (s, e) in enumerate(zip([0] + ends[:-1], ends)) if e > s]
    return torch.cat(parts) if parts else x.new_empty(0, w.shape[1])


def grouped_lora_mm(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                    offsets: torch.Tensor) -> torch.Tensor:
    """grouped_mm(x, w) + scale · grouped_mm(grouped_mm(x, a), b): per-group LoRA, a (G, r, K), b (G, N, r)."""
    return grouped_mm(x, w, offsets) + scale * grouped_mm(grouped_mm(x, a, offsets), b, offsets)

NF4_BLOCK, NESTED_BLOCK = 64, 256      # weights per absmax; absmaxes per nested (fp32) absmax


def dequantize_nf4(packed: torch.Tensor, absmax_codes: torch.Tensor, nested_absmax: torch.Tensor,
                   offset: torch.Tensor, code: torch.Tensor, nested_code: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """bitsandbytes' NF4 with double-quantised scales (QLoRA, arXiv:2305.14314) → the flat weight in `dtype`.

    packed (n/2,) uint8: two 4-bit indices into `code` (16 NF4 values) per byte, the first element in the
    high nibble. Each block of NF4_BLOCK weights has a scale absmax = nested_code[absmax_codes[b]] ·
    nested_absmax[b // NESTED_BLOCK] + offset (fp32: the multiply and the add rounded apart, as bnb's
    dequantize_blockwise then `absmax += offset`); a weight is code[index] · absmax, rounded once to `dtype`.
    """
    absmax = nested_code[absmax_codes.long()] * nested_absmax.repeat_interleave(NESTED_BLOCK)[:absmax_codes.numel()]
    absmax = absmax + offset
    indices = torch.stack((packed >> 4, packed & 0xF), dim=-1).view(-1, NF4_BLOCK).long()
    return (code[indices] * absmax[:, None]).view(-1).to(dtype)


class NF4Stack(NamedTuple):
    """Stacked frozen weights (G, N, K), each group (a routed expert) quantised alone in bitsandbytes' NF4 layout
    (what `dequantize_nf4` reads, one row per group): packed (G, N·K/2) uint8, absmax_codes (G, N·K/64) uint8,
    nested_absmax (G, ⌈N·K/64/256⌉) fp32, offset (G,) fp32, the tables code (16,) and nested_code (256,) fp32."""

    packed: torch.Tensor
    absmax_codes: torch.Tensor
    nested_absmax: torch.Tensor
    offset: torch.Tensor
    code: torch.Tensor
    nested_code: torch.Tensor
    shape: tuple[int, int, int]


def dequantize_nf4_stack(w: NF4Stack, dtype: torch.dtype) -> torch.Tensor:
    """The (G, N, K) weight in `dtype`: `dequantize_nf4` per group, each with its own offset (same float ops)."""
    G, n_blocks = w.absmax_codes.shape
    nested = w.nested_absmax.repeat_interleave(NESTED_BLOCK, dim=1)[:, :n_blocks]
    absmax = w.nested_code[w.absmax_codes.long()] * nested
    absmax = absmax + w.offset[:, None]
    indices = torch.stack((w.packed >> 4, w.packed & 0xF), dim=-1).view(G, -1, NF4_BLOCK).long()
    return (w.code[indices] * absmax[:, :, None]).to(dtype).view(w.shape)


def grouped_nf4_mm(x: torch.Tensor, w: NF4Stack, offsets: torch.Tensor, a: torch.Tensor | None = None,
                   b: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """`grouped_mm` (with a, b: `grouped_lora_mm`) over the 4-bit stack: dequantised into x's (autocast) dtype,
    then the per-group loop. Gradients to x, a, b."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    weight = dequantize_nf4_stack(w, dtype)
    return grouped_mm(x, weight, offsets) if a is None else grouped_lora_mm(x, weight, a, b, scale, offsets)


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """Half-precision logits are upcast to fp32 for the softmax; fp32/fp64 stay as they are."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token NLL over labelled positions and their count. hidden (N, C), labels (N,)."""
    logits = _upcast(F.linear(hidden, weight))
    loss_sum = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    return loss_sum, (labels != ignore_index).sum()


def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          ignore_index: int = -100) -> torch.Tensor:
    """log p(label) per position (0 where label == ignore_index). hidden (B, T, C), labels (B, T)."""
    logits = _upcast(F.linear(hidden, weight))
    mask = labels != ignore_index
    safe = labels.masked_fill(~mask, 0)
    logp = torch.gather(logits.log_softmax(-1), -1, safe[..., None]).squeeze(-1)
    return logp * mask


# --- DeepSeek sparse attention (DSA, GLM-5): the indexer's top-k keys and attention over them -------------------

def sparse_index_mask(index: torch.Tensor, num_keys: int) -> torch.Tensor:
    """index (B, T, K) key positions per query (-1: none) → (B, 1, T, num_keys) bool mask, True at the listed keys.

    The dense form transformers builds from the indexer's top-k (GlmMoeDsaAttention: a scatter into a T × T mask);
    O(T²) memory, for the reference and the tests only."""
    B, T, _ = index.shape
    valid = index >= 0
    # -1 entries scatter into a spare last column, dropped after: one scatter, no per-entry branching
    slots = torch.where(valid, index, num_keys).long()
    mask = torch.zeros(B, T, num_keys + 1, dtype=torch.bool, device=index.device)
    mask.scatter_(-1, slots, True)
    return mask[:, None, :, :num_keys]


def check_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> None:
    """The sparse attention ops' argument rules (ValueError naming the broken one)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or index.dim() != 3:
        raise ValueError(f"sparse_attention: q, k, v must be (B, H, T, D) and index (B, T, K), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(index.shape)}")
    (B, Hq, T, Dk), Hkv = q.shape, k.shape[1]
    if k.shape != (B, Hkv, T, Dk) or v.shape[:3] != (B, Hkv, T) or Hq % Hkv:
        raise ValueError(f"sparse_attention: k (B, Hkv, T, Dk) and v (B, Hkv, T, Dv) must match q {tuple(q.shape)} "
                         f"with Hq a multiple of Hkv, got {tuple(k.shape)}, {tuple(v.shape)}")
    if index.shape[:2] != (B, T) or index.dtype.is_floating_point or index.dtype == torch.bool:
        raise ValueError(f"sparse_attention: index must be (B, T, K) = ({B}, {T}, K) integers, "
                         f"got {tuple(index.shape)} {index.dtype}")


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(scale · q kᵀ over the keys each query lists) · v: DSA's attention, as transformers' masked dense form.

    q (B, Hq, T, Dk); k (B, Hkv, T, Dk), v (B, Hkv, T, Dv), Hq a multiple of Hkv (query head h reads kv head
    h // (Hq / Hkv); Hkv = 1 is absorbed MLA's one shared latent key); index (B, T, K) key positions per query,
    shared by all heads, distinct, -1 = none, at least one valid per query → (B, Hq, T, Dv) in q's dtype.

    The dense bool mask scattered from `index` and masked attention over all T keys, in fp32 (float64 stays
    float64): O(T²) memory, the semantics `kernels.triton_sparse_attention` must match. Autograd gives the
    gradients. `sparse_attention_gathered` is the same math in O(T·K) memory."""
    check_sparse_attention(q, k, v, index)
    (B, Hq, T, Dk), Hkv = q.shape, k.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    # (B, Hkv, G, T, D) query heads grouped under their kv head: k, v broadcast over the group, no repeat
    qg = q.to(dtype).view(B, Hkv, Hq // Hkv, T, Dk)
    scores = qg @ k.to(dtype)[:, :, None].transpose(-1, -2) * scale
    scores = scores.masked_fill(~sparse_index_mask(index, T)[:, :, None], float("-inf"))
    out = scores.softmax(-1) @ v.to(dtype)[:, :, None]
    return out.view(B, Hq, T, -1).to(q.dtype)


def sparse_attention_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """`sparse_attention` computed over the gathered keys, (B, Hkv, T, K, D) rows: O(T·K) memory, no T × T
    mask; the same fp32 math (each query's softmax over its K listed keys), differentiable by autograd."""
    check_sparse_attention(q, k, v, index)
    (B, Hq, T, Dk), Hkv, K = q.shape, k.shape[1], index.shape[-1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    valid = index >= 0
    rows = index.clamp(min=0).long().view(B, 1, T * K, 1)

    def gather(x):                                   # (B, Hkv, T, D) → (B, Hkv, T, K, D), each query's listed rows
        return x.to(dtype).gather(2, rows.expand(B, Hkv, T * K, x.shape[-1])).view(B, Hkv, T, K, x.shape[-1])
    qg = q.to(dtype).view(B, Hkv, Hq // Hkv, T, 1, Dk)
    scores = (qg @ gather(k)[:, :, None].transpose(-1, -2)).squeeze(-2) * scale        # (B, Hkv, G, T, K)
    scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
    out = (scores.softmax(-1)[..., None, :] @ gather(v)[:, :, None]).squeeze(-2)
    return out.view(B, Hq, T, -1).to(q.dtype)


INDEX_CHUNK_BYTES = 1 << 30      # the default chunk keeps index_topk's fp32 (B, chunk, H, T) scores under 1 GiB


@torch.no_grad()
def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """DSA's lightning indexer scores in fp32: score[b, t, s] = Σ_h weights[b, t, h] · relu(scale · q[b, t, h]·k[b, s]);
    q (B, T, H, D), k (B, S, D), weights (B, T, H) → (B, T, S), transformers' GlmMoeDsaIndexer.forward op for op."""
    scores = F.relu(torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * scale)   # (B, T, H, S)
    return torch.matmul(weights.float().unsqueeze(-2), scores).squeeze(-2)


def index_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, doc_ids: torch.Tensor | None, topk: int,
               scale: float, chunk: int | None = None, prefix_docs: torch.Tensor | None = None) -> torch.Tensor:
    """DSA's lightning indexer: each query's `topk` highest-scoring earlier keys of its own document (and of the
    shared prompt `prefix_docs` names, placed before it: data.packing).

    q (B, T, H, D) indexer queries, k (B, T, D) the one shared indexer key per position, weights (B, T, H) per-head
    weights (transformers folds H^-0.5 into them). The score of key s for query t is
    Σ_h weights[b,t,h] · relu(scale · q[b,t,h]·k[b,s]) in fp32 — transformers' GlmMoeDsaIndexer.forward, op for op
    (matmul, scale, relu, then weights @ scores) — kept where s ≤ t and doc_ids[b,s] == doc_ids[b,t]
    (doc_ids None: one document per row), -inf elsewhere. Returns (B, T, min(topk, T)) int64 key positions in
    torch.topk's order (scores descending), -1 where the score is -inf (a query at document offset i has i + 1
    valid keys). Ties among equal finite scores (common: relu makes whole rows of zeros) are broken by
    torch.topk's choice, which is unspecified and may differ from a dense call's.

    Queries go `chunk` rows at a time (None: as many as keep the (B, chunk, H, keys) fp32 scores under
    INDEX_CHUNK_BYTES), each against the keys up to its last row only: O(chunk·T) memory, never T × T."""
    B, T, H, _ = q.shape
    n = min(topk, T)
    if chunk is None:
        chunk = max(1, INDEX_CHUNK_BYTES // (4 * B * H * T))
    out = torch.full((B, T, n), -1, dtype=torch.long, device=q.device)
    pos = torch.arange(T, device=q.device)
    for c0 in range(0, T, chunk):
        c1 = min(c0 + chunk, T)
        scores = indexer_scores(q[:, c0:c1], k[:, :c1], weights[:, c0:c1], scale)    # (B, c, c1)
        allowed = (pos[:c1] <= pos[c0:c1, None])[None]
        if doc_ids is not None:
            allowed = allowed & (doc_ids[:, c0:c1, None] == doc_ids[:, None, :c1])
        if prefix_docs is not None:
            allowed = allowed | (prefix_docs[:, c0:c1, None] == doc_ids[:, None, :c1])
        scores = scores.masked_fill(~allowed, float("-inf"))
        m = min(n, c1)                       # later keys of this chunk's rows are all in the future: -1 there
        values, idx = scores.topk(m, dim=-1)
        out[:, c0:c1, :m] = idx.masked_fill(values == float("-inf"), -1)
    return out
