"""The language-model heads' losses, shared by training and evaluation so their numbers mean the same: the mean
next-token NLL over labelled tokens and the per-document sum of label log-probs. Both run the lm_head only on the
labelled positions, through kernels' fused linear + loss ops (no full-vocabulary logits).
"""
from __future__ import annotations

import torch

from glm_lora.kernels import ops as kernels
from glm_lora.data.packing import IGNORE


def final_hidden(model, batch):
    """The model's final normed hidden states of a batch (B, T, C)."""
    doc_ids = batch["doc_ids"] if batch.get("packed") else None     # padded rows: plain causal attention
    return model.hidden_states(batch["input_ids"], batch.get("position_ids"), doc_ids,
                               prefix_docs=batch.get("prefix_docs"))


def shifted(model, batch):
    """Hidden states at positions 0..T-2 and the labels they predict (tokens 1..T-1)."""
    return final_hidden(model, batch)[:, :-1], batch["labels"][:, 1:]   # (B, T-1, C), (B, T-1)


def label_positions(batch, labels: torch.Tensor) -> torch.Tensor:
    """Flat indices of the labelled next-token targets (`labels` flattened). SFT and preference data label only
    the answers (~15% of SFT tokens on the default data), so the lm_head runs on those rows only. Batches from
    data.packing carry these positions (no host sync); hand-built ones don't."""
    keep = batch.get("target_positions")
    return (labels != IGNORE).nonzero().squeeze(1) if keep is None else keep


def causal_lm_loss(model, batch) -> tuple[torch.Tensor, dict]:
    """Mean next-token NLL over labelled tokens (pretrain: all; SFT: assistant tokens only)."""
    hidden, labels = shifted(model, batch)
    hidden, labels = hidden.flatten(0, 1), labels.flatten()
    keep = label_positions(batch, labels)
    hidden, labels = hidden.index_select(0, keep), labels.index_select(0, keep)
    loss_sum, count = kernels.linear_cross_entropy(hidden, model.lm_head.weight, labels)
    loss = loss_sum / count.clamp(min=1)
    return loss, {"loss": loss.detach(), "target_tokens": count}


def group_logprobs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of label log-probs and label count per document, shaped like batch["group_docs"].

    Works for packed rows (several documents per row) and padded rows alike: each target
    token is credited to the document (doc_ids) it belongs to.
    """
    hidden, labels = shifted(model, batch)
    hidden, labels = hidden.flatten(0, 1), labels.flatten()
    keep = label_positions(batch, labels)                                  # the answers' tokens: the lm_head runs on those
    docs = batch["doc_ids"][:, 1:].flatten().index_select(0, keep)
    logp = kernels.linear_token_logprobs(hidden.index_select(0, keep), model.lm_head.weight, labels.index_select(0, keep))
    # every document id is below this without a device→host sync: data.packing numbers a batch's documents
    # 1, 2, … and each has a token or is in group_docs
    n = batch["doc_ids"].numel() + batch["group_docs"].numel() + 1
    sums = logp.new_zeros(n).index_add(0, docs, logp)
    counts = torch.zeros(n, dtype=torch.long, device=docs.device).index_add(0, docs, torch.ones_like(docs))
    return sums[batch["group_docs"]], counts[batch["group_docs"]]
