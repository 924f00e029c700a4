"""Ops the model and the losses ask for by name; each has a pure-torch reference in `kernels.reference`.

Backends (config key `kernels`):
  auto       the fused Triton op on CUDA wherever it measured faster than the eager reference
             (bench/RESULTS.md, "Fused kernels"; torch.compile of the reference beats us only on
             the linear-loss heads, by ≤ 1.26×, keeping 3× our memory), the reference elsewhere (CPU)
  reference  the torch path everywhere
  triton     every fused Triton op (tests use it on CPU under TRITON_INTERPRET=1)

Exceptions "auto" makes, from those measurements (H200, bf16, 16k tokens):
  compiled     inside a torch.compile'd region every op takes the reference, for inductor to fuse (see `_impl`)
  rms_norm     with a trainable weight and rows < 1024 wide the Triton backward's dweight reduction
               lost to eager (1.29×); frozen weights (LoRA) or wide rows: Triton wins (0.39–0.48×)
  lora_linear  with dropout the Triton RNG kernel lost to torch dropout + cuBLAS (1.9× slower); the
               fused cuBLAS-accumulating path without dropout is 1.2–1.4× the frozen GEMM, PEFT 1.5–2×;
               the rank-r product folded into a Triton GEMM's epilogue (kernels/triton_lora_gemm.py)
               lost to it, 1.31–1.90× the frozen GEMM (its GEMM is 1.27–1.78× cuBLAS's): not taken

dequantize_nf4 (QLoRA's 4-bit base): Triton on CUDA, 1.35–1.7× faster than torch.compile of the reference
and 11–17× than eager (1.3–3.1 TB/s from 2048² to 11008×4096 weights; bench/results/kernels_nf4_*.json).
The LoRA linear over it (nf4_lora_linear, kernels/qlora.py) is cuBLAS around that dequantisation, once in
forward and once in backward: forward + backward take 1.01–1.10× the bf16 lora_linear's time at 2048×5632
and 5632×2048, 1.25–1.65× at 2048² (two runs), for a quarter of its weight's memory.

grouped_mm / grouped_lora_mm (MoE experts: one weight per group of rows sorted by expert): the Triton grouped
GEMM (kernels/triton_grouped_mm.py) on CUDA, the per-expert loop of the reference elsewhere; torch._grouped_mm
is the alternative that `GROUPED_MM_AUTO` (below) can switch "auto" to. grouped_nf4_mm: the same over routed
experts held in 4 bits (QLoRA on a mixture of experts), dequantised for the Triton GEMM (triton_grouped_mm.NF4_EXPERTS).

Attention (config key `attention`), for packed rows: "sdpa" uses a dense document-causal bool mask;
"flex" a FlexAttention block mask (no T×T mask, other documents' blocks skipped); "varlen" FlashAttention's
variable-length kernels, each document its own sequence (kernels/varlen.py; rows with shared prompts keep
flex, bf16 / fp16 only, else the dense mask). varlen took 1.13–1.47× flex's attention time (fwd + bwd, H100,
bf16, 8 × 2048 packed rows, at 12×64, 16/8×128, 6×128, 32/8×64 heads) and its 1B LoRA SFT / DPO step 1.05× /
1.02× flex's (bench/RESULTS.md "The DPO step without host waits"), so "auto" never takes it. "auto" on CUDA picks
per model, by `flex_pays` (the rule and its measurements are there), once the first attention call of
a forward shows the attention's width (heads × head_dim); sdpa on CPU (FlexAttention has no CPU backward).

Both are chosen for a block, `with kernels.using(backend, attention): ...` (the previous choice comes
back after it; tasks.cache.build_stage wraps every stage in the config's choice); outside one: auto, auto.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Iterator

import torch

from glm_lora.kernels import delta_rule, flash_linear, lora_group, moe, qlora, reference, varlen

BACKENDS = ("auto", "reference", "triton")
ATTENTION = ("auto", "sdpa", "flex", "varlen")
_MODULES = {"rms_norm": "triton_rms_norm", "add_rms_norm": "triton_rms_norm", "apply_rope": "triton_rope",
            "swiglu": "triton_swiglu", "swiglu_halves": "triton_swiglu",
            "lora_linear": "triton_lora_linear", "linear_cross_entropy": "triton_linear_loss",
            "linear_token_logprobs": "triton_linear_loss", "dequantize_nf4": "triton_nf4",
            "grouped_mm": "triton_grouped_mm", "grouped_lora_mm": "triton_grouped_mm",
            "grouped_nf4_mm": "triton_grouped_mm",
            "sparse_attention": "triton_sparse_attention"}
_BACKEND, _ATTENTION = "auto", "auto"     # what the ops below dispatch on; set by use() / using()


def _use(backend: str, attention: str = "auto") -> None:
    global _BACKEND, _ATTENTION
    if backend not in BACKENDS:
        raise ValueError(f"kernels backend must be one of {BACKENDS}, got {backend!r}")
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    _BACKEND, _ATTENTION = backend, attention


@contextlib.contextmanager
def using(backend: str, attention: str = "auto") -> Iterator[None]:
    """Dispatch op calls to `backend` / `attention` inside the block; the previous choice is back on exit,
    error or not.

    The choice is still process-wide while the block runs (every thread sees it), not per model.
    """
    previous = _BACKEND, _ATTENTION
    _use(backend, attention)
    try:
        yield
    finally:
        _use(*previous)


@functools.cache
def _triton_op(name: str):
    return getattr(importlib.import_module(f"glm_lora.kernels.{_MODULES[name]}"), name)


def _impl(name: str, t: torch.Tensor, fused_pays: bool = True):
    """`fused_pays`: False where "auto" measured the reference faster for these inputs (see above).

    Inside a torch.compile'd region "auto" takes the reference: inductor fuses its elementwise ops into the graph,
    where each of our Triton calls would break it (one graph per op, launched from Python). The 125M pretraining
    step: 37.5 ms compiled this way against 46.3 ms compiled around our ops and 47–48 ms eager fused (H200,
    bench/RESULTS.md "Compiled blocks on the GPU")."""
    if _BACKEND == "triton" or (_BACKEND == "auto" and t.is_cuda and fused_pays
                                and not torch.compiler.is_compiling()):
        return _triton_op(name)
    return getattr(reference, name)


def _norm_pays(x, weight) -> bool:
    return not (weight.requires_grad and x.shape[-1] < 1024)


def rms_norm(x, weight, eps, out_dtype=None):
    return _impl("rms_norm", x, fused_pays=_norm_pays(x, weight))(x, weight, eps, out_dtype)


def add_rms_norm(x, residual, weight, eps, out_dtype=None):
    """(x + residual, rms_norm of it): the residual stream's add fused into the norm that reads the sum."""
    return _impl("add_rms_norm", x, fused_pays=_norm_pays(x, weight))(x, residual, weight, eps, out_dtype)


def apply_rope(q, k, cos, sin, interleaved=False):
    return _impl("apply_rope", q)(q, k, cos, sin, interleaved)


def swiglu(gate, up):
    return _impl("swiglu", gate)(gate, up)


def swiglu_halves(gate_up):
    """swiglu of [gate | up] stacked on the last dim, read in place (no copies of the halves)."""
    return _impl("swiglu_halves", gate_up)(gate_up)


def _flash_linear(x: torch.Tensor) -> bool:
    """Gated DeltaNet on flash-linear-attention's kernels: on CUDA where it is installed, unless "reference"."""
    return x.is_cuda and _BACKEND != "reference" and flash_linear.available()


def causal_conv1d(x, weight, rows=None):
    """SiLU of gated DeltaNet's causal depthwise convolution, x (B, T, D), weight (D, K); `rows`
    (delta_rule.PackedRows): each packed document's window starts from zeros, or from the end of its shared prompt
    (the reference's: fla has no such input)."""
    if _flash_linear(x) and (rows is None or rows.prefix_docs is None):
        return flash_linear.causal_conv1d(x, weight, rows)
    if rows is None:
        return delta_rule.causal_conv1d(x, weight)[0]
    return delta_rule.causal_conv1d_packed(x, weight, rows)


def gated_delta_rule(q, k, v, g, beta, rows=None):
    """The chunked gated delta rule's output (B, T, H, Dv) from a zero state (q, k may have fewer heads, each shared
    by H / Hk value heads); with `rows`, each packed document starts anew, or from the final state of its shared
    prompt (the reference's)."""
    needs_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
    shared_prompts = rows is not None and rows.prefix_docs is not None
    if _flash_linear(q) and (not needs_backward or flash_linear.backward_ok()) and not shared_prompts:
        return flash_linear.gated_delta_rule(q, k, v, g, beta, rows)
    if rows is None:
        return delta_rule.gated_delta_rule(q, k, v, g, beta)[0]
    aligned = rows.aligned
    out = delta_rule.gated_delta_rule(*(aligned.split(t) for t in (q, k, v, g, beta)), resets=aligned.resets,
                                      carry=aligned.carry)[0]
    return aligned.join(out)


def lora_linear(x, weight, lora_a, lora_b, scale, dropout=0.0, training=False):
    impl = _impl("lora_linear", x, fused_pays=not (dropout > 0 and training))
    return impl(x, weight, lora_a, lora_b, scale, dropout, training)


# "auto": stack sibling projections (q/k/v, gate/up) where it measured faster (bench/RESULTS.md, "Sibling
# projections as one op"); "triton" always, "reference" never.
STACK_SIBLINGS = {"cuda": True, "cpu": False}


def stacks_siblings(x: torch.Tensor) -> bool:
    return _BACKEND == "triton" or (_BACKEND == "auto" and STACK_SIBLINGS.get(x.device.type, False))


def lora_linear_group(x, weights, lora_as, lora_bs, scale):
    """Sibling LoRA linears of one input (no dropout), their outputs side by side on the last dim: stacked GEMMs
    (kernels/lora_group.py) where `stacks_siblings`, the siblings one by one (the reference) otherwise."""
    if stacks_siblings(x):
        return lora_group.lora_linear_group(x, weights, lora_as, lora_bs, scale)
    return reference.lora_linear_group(x, weights, lora_as, lora_bs, scale)


def stacked_linear(x, weights, biases):
    """Sibling plain linears of one input (q/k/v, gate/up): one GEMM over the stacked weights, their outputs side
    by side on the last dim."""
    bias = None if biases[0] is None else torch.cat(list(biases))
    return torch.nn.functional.linear(x, lora_group.stack_rows(list(weights)), bias)


def dequantize_nf4(packed, absmax_codes, nested_absmax, offset, code, nested_code, dtype):
    return _impl("dequantize_nf4", packed)(packed, absmax_codes, nested_absmax, offset, code, nested_code, dtype)


def linear_cross_entropy(hidden, weight, labels, ignore_index=-100):
    return _impl("linear_cross_entropy", hidden)(hidden, weight, labels, ignore_index)


def linear_token_logprobs(hidden, weight, labels, ignore_index=-100):
    return _impl("linear_token_logprobs", hidden)(hidden, weight, labels, ignore_index)


# Which grouped GEMM "auto" takes on CUDA, per op: "triton" (kernels/triton_grouped_mm.py: our kernels, LoRA
# folded into the base GEMM's tiles) or "torch" (torch._grouped_mm's CUTLASS kernel, bf16 on sm90/sm100 with
# K, N multiples of 8 only — anything else keeps Triton — the LoRA term as two more of its GEMMs).
# Measured (H200, bf16, bench/grouped_mm_gpu.py, 2026-12-03, 64 experts top-8 and 16 top-4, 2048 ↔ 1408, r 16,
# p50 forward + backward): plain grouped_mm, torch 0.77–0.87× our time (1.14–1.29× in our disfavour);
# grouped_lora_mm (W frozen), ours 0.77–0.85× torch's three calls. So "torch" would pay for grouped_mm;
# it stays "triton" until the MoE model's step is measured with it (then set GROUPED_MM_AUTO = "torch").
GROUPED_MM_AUTO = "triton"
GROUPED_LORA_MM_AUTO = "triton"


def _grouped_torch(choice: str, x, w) -> bool:
    if _BACKEND != "auto" or choice != "torch" or not x.is_cuda:
        return False
    return importlib.import_module("glm_lora.kernels.triton_grouped_mm").torch_grouped_mm_supported(x, w)


def grouped_mm(x, w, offsets):
    """y[rows_g] = x[rows_g] · w[g]ᵀ, x (M, K) sorted by group, w (G, N, K), offsets (G,) int32 cumulative ends."""
    if _grouped_torch(GROUPED_MM_AUTO, x, w):
        return importlib.import_module("glm_lora.kernels.triton_grouped_mm").torch_grouped_mm(x, w, offsets)
    return _impl("grouped_mm", x)(x, w, offsets)


def grouped_lora_mm(x, w, a, b, scale, offsets):
    """grouped_mm(x, w) + scale · grouped_mm(grouped_mm(x, a), b), per-group LoRA a (G, r, K), b (G, N, r)."""
    if _grouped_torch(GROUPED_LORA_MM_AUTO, x, w) and a.shape[1] % 8 == 0:
        return importlib.import_module("glm_lora.kernels.triton_grouped_mm").torch_grouped_lora_mm(x, w, a, b, scale, offsets)
    return _impl("grouped_lora_mm", x)(x, w, a, b, scale, offsets)


def grouped_nf4_mm(x, w, offsets, a=None, b=None, scale=1.0):
    """grouped_mm (with a, b: grouped_lora_mm) over a frozen 4-bit stack w (kernels.reference.NF4Stack): on CUDA each
    layer's stack is dequantised in one Triton pass for the grouped GEMM (or each tile inside it: NF4_EXPERTS); elsewhere
    w is dequantised whole, then the per-group loop."""
    return _impl("grouped_nf4_mm", x)(x, w, offsets, a, b, scale)


def sparse_attention(q, k, v, index, scale):
    """DeepSeek sparse attention (GLM-5's DSA): softmax(scale · q kᵀ over the keys `index` lists per query) · v.
    q (B, Hq, T, Dk), k (B, Hkv, T, Dk), v (B, Hkv, T, Dv), index (B, T, K) key positions (-1: none) → (B, Hq, T, Dv).
    The Triton kernel (kernels/triton_sparse_attention.py, O(T·K) memory) on CUDA under "auto" where
    `sparse_kernel_pays`; below that on CUDA, `masked_dense_attention`; elsewhere the fp32 reference."""
    if _BACKEND == "auto" and q.is_cuda and not sparse_kernel_pays(q, k.shape[2]):
        return masked_dense_attention(q, k, v, index, scale)
    return _impl("sparse_attention", q)(q, k, v, index, scale)


def masked_dense_attention(q, k, v, index, scale):
    """DSA as transformers' sdpa path runs it, in the inputs' dtype: the T × T bool mask scattered from `index`, then
    SDPA's fused kernels with it (reference.sparse_attention is the same math with explicit fp32 scores)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    mask = reference.sparse_index_mask(index, k.shape[2])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# "auto" on CUDA takes the sparse kernel from this many keys a row; below, the masked-dense form. Measured (H100, bf16,
# one 16-head row, K 2048, fwd + bwd, bench/kernels/sparse_attention.py, bench/RESULTS.md "GLM-4.7-Flash and GLM-5"):
# masked-dense over expanded heads 4.5 / 71 ms at 4k / 16k tokens against the kernel's 28 / 147 ms (absorbed form);
# 64k was not reached. Past 32k the T × T mask (T² bytes a row, 1 GiB at 32k) is what the kernel's O(T·K) avoids.
SPARSE_KERNEL_MIN_KEYS = 32768


def sparse_kernel_pays(q: torch.Tensor, keys: int) -> bool:
    return keys >= SPARSE_KERNEL_MIN_KEYS or not q.is_cuda


index_topk = reference.index_topk
indexer_scores = reference.indexer_scores           # DSA's indexer top-k, chunked torch on every device (no_grad)
rope_cos_sin = reference.rope_cos_sin
moe_experts = moe.moe_experts               # grouped_mm / grouped_lora_mm around the MoE routing (kernels/moe.py)
nf4_lora_linear = qlora.nf4_lora_linear     # torch GEMMs around W rebuilt by dequantize_nf4 (above)


FLEX_MIN_WIDTH = 2048    # query heads × head_dim


def flex_pays(num_heads: int, head_dim: int) -> bool:
    """Attention "auto" on CUDA: FlexAttention block mask (True) or SDPA + dense document mask (False),
    by the attention's width (query heads × head_dim), from bench/RESULTS.md "Attention: FlexAttention
    vs the dense mask" (H200, bf16, packed 8 × 2048 rows, 2026-12-01, bench/peer_gpu.py):

      width 2048 (1B, 16 × 128): flex 1.23× the dense mask's tokens/s in LoRA SFT, 1.18× in DPO
      width  768 (125M, 12 × 64): flex 0.99× (p50; a tie) in SFT, 0.69× in DPO

    Attention alone, flex takes 0.45–0.72× the dense kernel's GPU time at all four of 12×64, 6×128,
    32×64 and 16×128, so neither head_dim nor the attention kernel decides. The 125M step is far from
    GPU-bound (84 TFLOP/s of model FLOPs against 362 at 1B; its step times jitter ±15%), and there flex's
    extra work (the compiled call per layer, a 2–4 ms block-mask build per forward against 0.2 ms for the
    dense mask) is not hidden (inferred: the 125M step was not profiled).
    Widths between 768 and 2048 were not measured: they keep the dense mask, never measured slower
    than a tie; rows of 2048 tokens only (longer rows were not measured either).
    """
    return num_heads * head_dim >= FLEX_MIN_WIDTH


class AutoDocumentMask:
    """Attention "auto" on CUDA: the packed rows' document mask, built on first use in the form
    `flex_pays` picks for that attention's shape (q: B, H, T, D), then shared by every layer of the forward."""

    def __init__(self, doc_ids: torch.Tensor, prefix_docs: torch.Tensor | None = None):
        self.doc_ids, self.prefix_docs, self.mask = doc_ids, prefix_docs, None

    def resolve(self, q: torch.Tensor):
        if self.mask is None:
            if flex_pays(q.shape[1], q.shape[-1]):
                from glm_lora.kernels import flex
                self.mask = flex.document_block_mask(self.doc_ids, self.prefix_docs)
            else:
                self.mask = reference.document_causal_mask(self.doc_ids, self.prefix_docs)
        return self.mask


_last_mask: list = []      # [(key, mask)]: see document_causal_mask


def document_causal_mask(doc_ids: torch.Tensor, prefix_docs: torch.Tensor | None = None):
    """A mask object for `attention`: a dense bool mask ("sdpa", or anything on CPU), a FlexAttention
    BlockMask ("flex" on CUDA, and "varlen" with shared prompts), varlen.Documents ("varlen" on CUDA), or an
    AutoDocumentMask ("auto" on CUDA) that becomes a dense or a block mask.
    `prefix_docs` (data.packing's shared prompts): each token also sees the whole document it names.

    The mask last built comes back while the same tensors return unchanged (same objects, same in-place
    version, same attention choice): DPO's policy and reference forwards over one batch build it once, where
    FlexAttention's block mask costs ~3 ms a build, mostly host time the GPU waits for."""
    if torch.compiler.is_compiling() or (doc_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return _document_causal_mask(doc_ids, prefix_docs)     # a graph builds its mask: none baked in from outside
    state = (doc_ids._version, None if prefix_docs is None else prefix_docs._version, _ATTENTION)
    if _last_mask:
        (ids, prefix, last_state), mask = _last_mask[0]
        if ids is doc_ids and prefix is prefix_docs and last_state == state:
            return mask
    mask = _document_causal_mask(doc_ids, prefix_docs)
    _last_mask[:] = [((doc_ids, prefix_docs, state), mask)]
    return mask


def _document_causal_mask(doc_ids: torch.Tensor, prefix_docs: torch.Tensor | None):
    if not doc_ids.is_cuda or _ATTENTION == "sdpa":
        return reference.document_causal_mask(doc_ids, prefix_docs)
    if _ATTENTION == "varlen" and prefix_docs is None:
        return varlen.documents(doc_ids)
    if _ATTENTION in ("flex", "varlen"):
        from glm_lora.kernels import flex
        return flex.document_block_mask(doc_ids, prefix_docs)
    return AutoDocumentMask(doc_ids, prefix_docs)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    if isinstance(mask, AutoDocumentMask):
        mask = mask.resolve(q)
    if isinstance(mask, varlen.Documents):
        if q.dtype in varlen.DTYPES and v.shape[-1] == q.shape[-1]:    # FlashAttention 2: one head size
            return varlen.attention(q, k, v, mask)
        mask = mask.dense_mask()
    if mask is not None and not isinstance(mask, torch.Tensor):
        from glm_lora.kernels import flex
        return flex.attention(q, k, v, mask)
    return reference.attention(q, k, v, mask)
