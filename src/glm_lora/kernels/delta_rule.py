"""Gated DeltaNet's sequence mixing in pure PyTorch (Qwen3.5's linear-attention layers): the gated delta rule, in
chunks (training, prefill) and token by token (decoding), and the short causal depthwise convolution before it.
The references every faster path (flash-linear-attention's kernels on CUDA, kernels/ops.py) is tested against.

Per head, a state S (Dk × Dv) carries the sequence: at token t it decays by exp(g_t), then is corrected toward
v_t along k_t by β_t (the delta rule) and read by q_t:

    S ← exp(g_t) S;   S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ;   o_t = Sᵀ q_t

with q, k L2-normalised and q scaled by Dk^-½. The chunked form does the same in chunks of C tokens: inside a chunk
the corrections are solved at once (a unit lower-triangular system, the WY form), between chunks the state passes.

Packed rows (`PackedRows`): each document starts from a zero state (`ChunkAligned`) and a zero convolution window
(`causal_conv1d_packed`), as if it ran alone — or an answer from its shared prompt's.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim, as flash-linear-attention's (and transformers') kernels."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """fp32, heads first (B, H, T, ·), q and k normalised, q scaled; each of q's and k's heads repeated for the value
    heads that share it (fewer key heads than value heads, as flash-linear-attention takes them)."""
    share = v.shape[2] // q.shape[2]
    if share > 1:
        q, k = (t.repeat_interleave(share, dim=2) for t in (q, k))
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
    return l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k), v, g, beta


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: torch.Tensor | None = None, chunk: int = CHUNK, resets: torch.Tensor | None = None,
                     carry: "Carry | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule. q, k: (B, T, Hk, Dk); v: (B, T, H, Dv), H a multiple of Hk; g (log decay, ≤ 0),
    beta: (B, T, H);
    initial_state (B, H, Dk, Dv) or None (zeros); resets (B, ⌈T / chunk⌉) bool: the state restarts from zero at those
    chunks (documents laid out chunk-aligned, `ChunkAligned`); `carry`: where a document starts from another's final
    state instead (an answer from its shared prompt's). Returns (o (B, T, H, Dv) in v's dtype, final state
    (B, H, Dk, Dv) in fp32). Token t's output reads only tokens ≤ t, so padding after a sequence's end changes none
    of its outputs."""
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
    keep = None if resets is None else (~resets).to(state.dtype)[:, :, None, None, None]       # (B, n, 1, 1, 1)
    saved = None if carry is None else state.new_zeros(B, carry.slots, H, Dk, Dv)
    for c in range(n):
        if keep is not None:
            state = state * keep[:, c]
        if carry is not None:           # an answer's first chunk: its prompt's final state
            load = carry.load[:, c]
            state = torch.where((load >= 0)[:, None, None, None], saved[torch.arange(B), load.clamp(min=0)], state)
        v_new = u[:, :, c] - w[:, :, c] @ state
        out.append(q_decayed[:, :, c] @ state + scores[:, :, c] @ v_new)
        state = state * gamma[:, :, c, -1, None, None].exp() + k_to_end[:, :, c].transpose(-1, -2) @ v_new
        if carry is not None:           # a prompt's last chunk: keep its final state for its answers
            into = (carry.save[:, c, None] == torch.arange(carry.slots, device=q.device))[..., None, None, None]
            saved = torch.where(into, state[:, None], saved)
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


def causal_conv1d_packed(x: torch.Tensor, weight: torch.Tensor, rows: "PackedRows") -> torch.Tensor:
    """`causal_conv1d` over packed rows, each document's window starting from zeros: tap j reads only what
    `rows.taps` allows — t − j of t's own document, or, for an answer after a shared prompt, the prompt's last inputs
    (as if the prompt ran right before it). K gathered, masked products."""
    B, T, D = x.shape
    flat = x.reshape(B * T, D)
    y = x * weight[:, -1].to(x.dtype)
    for j, (src, valid) in enumerate(rows.taps(weight.shape[-1]), start=1):
        y = y + flat[src] * valid[..., None] * weight[:, -1 - j].to(x.dtype)
    return F.silu(y.float()).to(x.dtype)


class PackedRows:
    """One forward's packed rows as the linear-attention kernels read them: `doc_ids` (B, T) and, with DPO's shared
    prompts, `prefix_docs` (the prompt each answer continues; -1: none). Built once per forward and shared by every
    layer (its checkpointed recompute included): the layouts below are worked out once, each costing host syncs."""

    def __init__(self, doc_ids: torch.Tensor, prefix_docs: torch.Tensor | None = None):
        self.doc_ids, self.prefix_docs = doc_ids, prefix_docs
        self._taps: dict[int, list] = {}

    @functools.cached_property
    def aligned(self) -> "ChunkAligned":
        return ChunkAligned(self.doc_ids, prefix_docs=self.prefix_docs)

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """Where each document starts in the rows flattened to one, and the end (int32: flash-linear-attention's)."""
        _, _, starts = _token_documents(self.doc_ids)
        first = torch.nonzero(starts.flatten()).flatten()
        return torch.cat([first, first.new_tensor([self.doc_ids.numel()])]).to(torch.int32)

    def taps(self, K: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For taps j = 1 … K − 1 of a causal convolution: (flat index each token reads, whether it may)."""
        if K not in self._taps:
            at, start, _ = _token_documents(self.doc_ids)
            offset = at - start                                                # position within its document
            if self.prefix_docs is not None:
                first, length = _document_table(self.doc_ids)
                prompt = self.prefix_docs.clamp(min=0)
                prompt_end, prompt_length = first[prompt] + length[prompt], length[prompt]
            taps = []
            for j in range(1, K):
                own = offset >= j
                src, valid = at - j, own
                if self.prefix_docs is not None:
                    back = j - offset                                          # taps before the answer's start
                    from_prompt = ~own & (self.prefix_docs >= 0) & (back <= prompt_length)
                    src, valid = torch.where(own, src, prompt_end - back), own | from_prompt
                taps.append((src.clamp(min=0), valid))
            self._taps[K] = taps
        return self._taps[K]


def _token_documents(doc_ids: torch.Tensor):
    """Flat index of each token (B, T), of its document's first token, and whether it starts one."""
    B, T = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    at = torch.arange(B * T, device=doc_ids.device).view(B, T)
    return at, torch.where(starts, at, 0).cummax(1).values, starts


def _document_table(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per document id (ids are unique within a batch, data.packing): its first token's flat index and its length."""
    flat = doc_ids.flatten()
    n = int(flat.max()) + 1
    first = flat.new_full((n,), flat.numel()).scatter_reduce(0, flat, torch.arange(flat.numel(), device=flat.device),
                                                             "amin")
    return first, torch.zeros(n, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


class Carry(NamedTuple):
    """Shared prompts in chunk-aligned rows: after chunk c, save the state as slot save[b, c] (-1: none); at chunk c
    start from slot load[b, c] (-1: as resets say). `slots`: how many a row may hold."""
    load: torch.Tensor
    save: torch.Tensor
    slots: int


class ChunkAligned:
    """Packed rows (B, T) laid out so that each document starts a chunk: a document's tokens keep their row and their
    order, moved right to the next multiple of `chunk`. The chunked rule then runs on the rows as they are, the state
    reset at each document's first chunk (`resets`), and no chunk mixes two documents. `split` moves a (B, T, ...)
    tensor there (zeros in the gaps), `join` back."""

    def __init__(self, doc_ids: torch.Tensor, chunk: int = CHUNK, prefix_docs: torch.Tensor | None = None):
        B, T = doc_ids.shape
        dev = doc_ids.device
        at, start, starts = _token_documents(doc_ids)
        rank = starts.long().cumsum(1) - 1                                       # each token's document in its row
        offset = at - start                                                      # position within its document
        lengths = torch.zeros(B, T, dtype=torch.long, device=dev).scatter_add_(1, rank, torch.ones_like(rank))
        padded = (lengths + chunk - 1) // chunk * chunk
        first = padded.cumsum(1) - padded                                        # each document's aligned start
        self.position = first.gather(1, rank) + offset                           # (B, T) in the aligned rows
        self.length = int(padded.sum(1).max())
        self.rows = torch.arange(B, device=dev)[:, None].expand(B, T)
        self.resets = torch.zeros(B, self.length // chunk, dtype=torch.bool, device=dev)
        real = lengths > 0                                                       # document slots in use
        self.resets[self.rows[real], first[real] // chunk] = True
        self.carry = None if prefix_docs is None else self._carry(doc_ids, prefix_docs, rank, first, padded, chunk)

    def _carry(self, doc_ids, prefix_docs, rank, first, padded, chunk) -> Carry:
        """Each answer's first chunk loads its prompt's final state, saved after the prompt's last chunk."""
        B, T = doc_ids.shape
        rank_of = torch.zeros(int(doc_ids.max()) + 1, dtype=torch.long, device=doc_ids.device)
        rank_of[doc_ids.flatten()] = rank.flatten()                            # a document id's slot in its row
        prompt_rank = torch.full((B, T), -1, dtype=torch.long, device=doc_ids.device)
        answers = prefix_docs >= 0
        prompt_rank[self.rows[answers], rank[answers]] = rank_of[prefix_docs[answers]]   # per slot: its prompt's
        is_prompt = torch.zeros(B, T, dtype=torch.bool, device=doc_ids.device)
        is_prompt[self.rows[answers], rank_of[prefix_docs[answers]]] = True
        slot = is_prompt.long().cumsum(1) - 1                                  # a prompt's place among its row's
        n = self.length // chunk
        load = torch.full((B, n), -1, dtype=torch.long, device=doc_ids.device)
        save = torch.full((B, n), -1, dtype=torch.long, device=doc_ids.device)
        has = prompt_rank >= 0
        load[self.rows[has], first[has] // chunk] = slot.gather(1, prompt_rank.clamp(min=0))[has]
        save[self.rows[is_prompt], (first + padded)[is_prompt] // chunk - 1] = slot[is_prompt]
        return Carry(load, save, max(int(is_prompt.sum(1).max()), 1))

    def split(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(x.shape[0], self.length, *x.shape[2:])
        out[self.rows, self.position] = x
        return out

    def join(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.rows, self.position]
