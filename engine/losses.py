"""Pluggable losses for the one training loop: `loss_fn(model, batch) -> (loss, metrics)`.

All heads go through kernels' fused linear+loss ops, so full-vocabulary logits need not be
materialised once the Triton versions land.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from data.batching import IGNORE
from model.lora import lora_disabled


def _shifted(model, batch):
    hidden = model.hidden_states(batch["input_ids"])[:, :-1]       # (B, T-1, C)
    labels = batch["labels"][:, 1:]                                  # (B, T-1)
    return hidden, labels


def causal_lm_loss(model, batch) -> tuple[torch.Tensor, dict]:
    """Mean next-token NLL over labelled tokens (pretrain: all; SFT: assistant tokens only)."""
    hidden, labels = _shifted(model, batch)
    loss_sum, count = kernels.linear_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, labels.flatten())
    loss = loss_sum / count.clamp(min=1)
    return loss, {"loss": loss.detach(), "target_tokens": count}


def sequence_logprobs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sum of label log-probs (B,) and label counts (B,)."""
    hidden, labels = _shifted(model, batch)
    logp = kernels.linear_token_logprobs(hidden, model.lm_head.weight, labels)
    return logp.sum(-1), (labels != IGNORE).sum(-1)


class DPOLoss:
    """Direct Preference Optimisation (Rafailov et al. 2023) + optional chosen-NLL term.

    Batches hold chosen rows then rejected rows. The reference policy is the same weights with
    the LoRA adapter disabled — no second model copy.
    """

    def __init__(self, beta: float, nll_weight: float = 0.0):
        self.beta, self.nll_weight = beta, nll_weight

    def __call__(self, model, batch) -> tuple[torch.Tensor, dict]:
        policy_logp, counts = sequence_logprobs(model, batch)
        with torch.no_grad(), lora_disabled(model):
            ref_logp, _ = sequence_logprobs(model, batch)
        n = policy_logp.shape[0] // 2
        chosen_reward = self.beta * (policy_logp[:n] - ref_logp[:n])
        rejected_reward = self.beta * (policy_logp[n:] - ref_logp[n:])
        margin = chosen_reward - rejected_reward
        loss = -F.logsigmoid(margin).mean()
        if self.nll_weight:
            loss = loss + self.nll_weight * (-policy_logp[:n].sum() / counts[:n].sum().clamp(min=1))
        return loss, {
            "loss": loss.detach(),
            "reward_margin": margin.detach().mean(),
            "preference_accuracy": (margin > 0).float().mean().detach(),
            "chosen_reward": chosen_reward.detach().mean(),
            "rejected_reward": rejected_reward.detach().mean(),
        }
