"""Pluggable losses for the one training loop: `loss_fn(model, batch) -> (loss, metrics)`.

All heads go through kernels' fused linear+loss ops, so full-vocabulary logits need not be
materialised once the Triton versions land.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from data.packing import IGNORE
from model.lora import lora_disabled


def _shifted(model, batch):
    """Hidden states at positions 0..T-2 and the labels they predict (tokens 1..T-1)."""
    doc_ids = batch["doc_ids"] if batch.get("packed") else None     # padded rows: plain causal attention
    hidden = model.hidden_states(batch["input_ids"], batch.get("position_ids"), doc_ids)
    return hidden[:, :-1], batch["labels"][:, 1:]                    # (B, T-1, C), (B, T-1)


def causal_lm_loss(model, batch) -> tuple[torch.Tensor, dict]:
    """Mean next-token NLL over labelled tokens (pretrain: all; SFT: assistant tokens only)."""
    hidden, labels = _shifted(model, batch)
    hidden, labels = hidden.flatten(0, 1), labels.flatten()
    # SFT labels only the answers (~15% of tokens on the default data): the lm_head runs on those rows
    # only. Batches from data.packing carry their positions (no host sync); hand-built ones don't.
    keep = batch.get("target_positions")
    if keep is None:
        keep = (labels != IGNORE).nonzero().squeeze(1)
    hidden, labels = hidden.index_select(0, keep), labels.index_select(0, keep)
    loss_sum, count = kernels.linear_cross_entropy(hidden, model.lm_head.weight, labels)
    loss = loss_sum / count.clamp(min=1)
    return loss, {"loss": loss.detach(), "target_tokens": count}


def group_logprobs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of label log-probs and label count per document, shaped like batch["group_docs"].

    Works for packed rows (several documents per row) and padded rows alike: each target
    token is credited to the document (doc_ids) it belongs to.
    """
    hidden, labels = _shifted(model, batch)
    logp = kernels.linear_token_logprobs(hidden, model.lm_head.weight, labels)     # (B, T-1)
    docs = batch["doc_ids"][:, 1:].flatten()
    n = int(batch["group_docs"].max()) + 1
    sums = logp.new_zeros(n).index_add(0, docs, logp.flatten())
    counts = torch.zeros(n, dtype=torch.long, device=docs.device).index_add(0, docs, (labels != IGNORE).flatten().long())
    return sums[batch["group_docs"]], counts[batch["group_docs"]]


class DPOLoss:
    """Direct Preference Optimisation (Rafailov et al. 2023) + optional chosen-NLL term.

    Batches hold (chosen, rejected) document pairs (`group_docs`). The reference policy is the
    same weights with the LoRA adapter disabled — no second model copy.
    """

    def __init__(self, beta: float, nll_weight: float = 0.0):
        self.beta, self.nll_weight = beta, nll_weight

    def __call__(self, model, batch) -> tuple[torch.Tensor, dict]:
        policy_logp, counts = group_logprobs(model, batch)                 # (pairs, 2)
        with torch.no_grad(), lora_disabled(model):
            ref_logp, _ = group_logprobs(model, batch)
        rewards = self.beta * (policy_logp - ref_logp)
        chosen_reward, rejected_reward = rewards[:, 0], rewards[:, 1]
        margin = chosen_reward - rejected_reward
        loss = -F.logsigmoid(margin).mean()
        if self.nll_weight:
            loss = loss + self.nll_weight * (-policy_logp[:, 0].sum() / counts[:, 0].sum().clamp(min=1))
        return loss, {
            "loss": loss.detach(),
            "reward_margin": margin.detach().mean(),
            "preference_accuracy": (margin > 0).float().mean().detach(),
            "chosen_reward": chosen_reward.detach().mean(),
            "rejected_reward": rejected_reward.detach().mean(),
        }
