"""The strongest peer setup we compare against: transformers + PEFT + Liger kernels, padding-free packing.

Anchor (a), what a user of the Hugging Face stack would run today for LoRA SFT / DPO at speed:
  * `LlamaForCausalLM` with attn_implementation="flex_attention" (SDPA on CPU smoke runs), no KV cache;
  * Liger kernels applied to that instance (`apply_liger_kernel_to_llama(model=...)`): RoPE, RMSNorm,
    SwiGLU and the fused linear cross-entropy forward (no logits materialised in training);
  * PEFT LoRA r64 α128 on the 7 projections;
  * our packed rows (8 × seq_len, several documents per row) passed padding-free: `position_ids`
    restarting at 0 per document and no attention_mask, so transformers' masking utilities find the
    documents from the positions (`find_packed_sequence_indices`) and build a FlexAttention block mask
    without cross-document attention. `check_packing` verifies that on the real shapes: the logits of
    documents inside a packed row equal those of the same documents run alone (and differ from plain
    causal attention over the row). Should a transformers version not detect the documents, the
    provider falls back to passing the block mask itself (recorded as `hf_mask: "explicit"`).
  * DPO: `LigerFusedLinearDPOLoss` (β 0.1, sigmoid, summed log-probs, torch.compile'd chunks as Liger's
    default) on the answer positions gathered from the packed hidden states; reference = the same
    forward under `disable_adapter()` + no_grad.

The Liger patches also replace module-level names in transformers' modeling_llama (RoPE function,
RMSNorm and MLP classes); `liger_llama()` restores them afterwards, so the plain HF anchors built later
in the same process stay plain.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from glm_lora.data.packing import IGNORE

HF_MASK = {"mode": "detect"}    # "detect": from position_ids (user path); "explicit": our BlockMask (fallback)


@contextlib.contextmanager
def liger_llama():
    """Let Liger patch transformers' Llama module inside the block; put every name back afterwards."""
    from transformers.models.llama import modeling_llama as ml
    names = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    saved = {n: getattr(ml, n) for n in names}
    saved_forward = ml.LlamaForCausalLM.forward
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(ml, n, v)
        ml.LlamaForCausalLM.forward = saved_forward


def liger_peft(cfg, device: torch.device, bf16_base: bool = False):
    """Anchor (a)'s model: HF Llama (flex attention on CUDA) + Liger kernels + PEFT LoRA. Call inside liger_llama().
    `bf16_base`: the whole base in bf16, as `from_pretrained(..., torch_dtype=torch.bfloat16)` gives it (PEFT's
    default `autocast_adapter_dtype` keeps the adapter in fp32)."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    from bench.workloads import hf_model, hf_peft
    cuda = device.type == "cuda"
    base = hf_model(cfg, device, attn="flex_attention" if cuda else "sdpa", use_cache=False)
    if bf16_base:
        base = base.to(torch.bfloat16)
    # CPU smoke runs (TRITON_INTERPRET=1): Liger's RMSNorm and SwiGLU kernels do not run in Triton's interpreter
    apply_liger_kernel_to_llama(rope=True, rms_norm=cuda, swiglu=cuda, cross_entropy=False,
                                fused_linear_cross_entropy=True, model=base)
    return hf_peft(cfg, device, base=base)


def _mask_kwargs(b: dict) -> dict:
    if HF_MASK["mode"] == "explicit" and b["doc_ids"].is_cuda:
        from glm_lora.kernels import flex
        return {"attention_mask": flex.document_block_mask(b["doc_ids"])}
    return {}


def liger_sft_loss(model):
    def loss_of(b):
        return model(input_ids=b["input_ids"], position_ids=b["position_ids"], labels=b["labels"],
                     use_cache=False, **_mask_kwargs(b)).loss
    return loss_of


def hidden(model, b: dict) -> torch.Tensor:
    """Final-norm hidden states (R, T, C) of the packed rows, through PEFT's wrapped LlamaModel."""
    body = model.get_base_model().model
    return body(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False,
                **_mask_kwargs(b)).last_hidden_state


def add_answer_index(b: dict) -> dict:
    """Host-side (before timing, as our batches carry `target_positions`): where each document's
    next-token targets sit in the flattened (R·T) hidden states, as Liger's DPO loss wants them:
    rows [chosen of every pair..., rejected of every pair...], padded with IGNORE targets."""
    labels, docs = b["labels"].numpy(), b["doc_ids"].numpy()
    R, T = labels.shape
    rr, jj = np.nonzero(labels[:, 1:] != IGNORE)           # hidden (r, j) predicts labels[r, j + 1]
    owner = docs[rr, jj + 1]
    flat = rr * T + jj
    order = np.argsort(owner, kind="stable")
    owner, flat, tgt = owner[order], flat[order], labels[rr, jj + 1][order]
    groups = b["group_docs"].numpy()
    seqs = list(groups[:, 0]) + list(groups[:, 1])
    starts = np.searchsorted(owner, seqs, side="left")
    ends = np.searchsorted(owner, seqs, side="right")
    L = int(max(1, (ends - starts).max()))
    index = np.zeros((len(seqs), L), dtype=np.int64)
    target = np.full((len(seqs), L), IGNORE, dtype=np.int64)
    for i, (s, e) in enumerate(zip(starts, ends)):
        index[i, :e - s], target[i, :e - s] = flat[s:e], tgt[s:e]
    return {**b, "answer_index": torch.from_numpy(index), "answer_target": torch.from_numpy(target)}


def liger_dpo_loss(model, beta: float):
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss
    cuda = model.get_base_model().lm_head.weight.is_cuda
    dpo = LigerFusedLinearDPOLoss(beta=beta, compute_nll_loss=False, use_ref_model=True, average_log_prob=False,
                                  loss_type="sigmoid", compiled=cuda)     # compiled: Liger's default (CPU smoke: eager)
    weight = model.get_base_model().lm_head.weight

    def answers(h, b):
        return h.flatten(0, 1)[b["answer_index"]]           # (2·pairs, L, C)

    def loss_of(b):
        x = answers(hidden(model, b), b)
        with torch.no_grad(), model.disable_adapter():
            ref = answers(hidden(model, b), b)
        return dpo(weight, x, b["answer_target"], ref_input=ref, ref_weight=weight)[0]
    return loss_of


def _alone(b: dict, picks: list[tuple[int, int, int]]) -> dict:
    """Each picked document (row, start, length) at the start of its own row, the rest padding."""
    R, T = b["input_ids"].shape
    ids = torch.zeros(len(picks), T, dtype=torch.long)
    pos = torch.zeros(len(picks), T, dtype=torch.long)
    doc = torch.zeros(len(picks), T, dtype=torch.long)
    for i, (r, s, n) in enumerate(picks):
        ids[i, :n] = b["input_ids"][r, s:s + n]
        pos[i, :n] = torch.arange(n)
        doc[i, :n] = 1
    return {"input_ids": ids, "position_ids": pos, "doc_ids": doc}


@torch.no_grad()
def check_packing(model, b: dict, device: torch.device, autocast) -> dict:
    """Logits of documents inside the packed rows vs the same documents alone (one per row, same shape).

    Picks the second document of each row (the first starts at 0 and would match trivially). Also
    reports how far plain causal attention over the packed row (documents seeing each other) lands,
    so the match is told apart from rounding. max abs diff over the picked documents' logits.
    """
    doc_ids = b["doc_ids"]
    picks = []
    for r in range(doc_ids.shape[0]):
        ids = doc_ids[r][doc_ids[r] > 0].unique_consecutive()
        if len(ids) >= 2:
            where = (doc_ids[r] == ids[1]).nonzero().squeeze(1)
            picks.append((r, int(where[0]), int(len(where))))
    if not picks:
        return {"error": "no row holds two documents"}
    alone = _alone(b, picks)
    dev = {k: v.to(device) for k, v in b.items() if isinstance(v, torch.Tensor)}
    alone = {k: v.to(device) for k, v in alone.items()}
    with torch.enable_grad(), autocast:       # the training path (grad mode on): the compiled kernels are reused
        packed = model(input_ids=dev["input_ids"], position_ids=dev["position_ids"], use_cache=False,
                       **_mask_kwargs(dev)).logits.detach()
        single = model(input_ids=alone["input_ids"], position_ids=alone["position_ids"], use_cache=False,
                       **_mask_kwargs(alone)).logits.detach()
        leaky = model(input_ids=dev["input_ids"], attention_mask=torch.ones_like(dev["input_ids"]),
                      use_cache=False).logits.detach()
    diff, leak, scale = 0.0, 0.0, 0.0
    for i, (r, s, n) in enumerate(picks):
        ref = single[i, :n].float()
        diff = max(diff, float((packed[r, s:s + n].float() - ref).abs().max()))
        leak = max(leak, float((leaky[r, s:s + n].float() - ref).abs().max()))
        scale = max(scale, float(ref.abs().max()))
    return {"documents": len(picks), "doc_lengths": [n for _, _, n in picks],
            "max_abs_diff_packed_vs_alone": diff, "max_abs_diff_plain_causal_vs_alone": leak,
            "max_abs_logit": scale, "ok": bool(diff < 0.1 * leak) if leak > 0 else diff == 0.0}
