"""Pluggable losses for the one training loop: `loss_fn(model, batch) -> (loss, metrics)`.

The language-model heads (causal_lm_loss, group_logprobs) are model.heads'; the preference and RL losses here
build on them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from glm_lora.kernels import ops as kernels
from glm_lora.data.packing import IGNORE
from glm_lora.model import mtp
from glm_lora.model.heads import group_logprobs, shifted
from glm_lora.model.lora import lora_disabled


def _log1m_exp(a: torch.Tensor) -> torch.Tensor:
    """log(1 − eᵃ) for a < 0, stable near 0 (ORPO's log-odds)."""
    return torch.log(-torch.expm1(a.clamp(max=-1e-6)))


# Paired preference losses, each its paper's formula, per pair: pc / pr the policy's summed log-probs of the chosen /
# rejected answer, rc / rr the reference's (None for reference-free losses), nc / nr their answer token counts.
# Each returns (loss per pair, margin per pair: > 0 when the pair is ranked right).
def dpo_loss(pc, pr, rc, rr, nc, nr, *, beta: float, **_):
    """DPO (Rafailov et al. 2023): −log σ(β · ((πc − refc) − (πr − refr)))."""
    margin = beta * ((pc - rc) - (pr - rr))
    return -F.logsigmoid(margin), margin


def ipo_loss(pc, pr, rc, rr, nc, nr, *, beta: float, **_):
    """IPO (Azar et al. 2023): (h − 1/(2β))², h the log-ratio difference of length-averaged log-probs (as TRL)."""
    h = (pc - rc) / nc - (pr - rr) / nr
    return (h - 1 / (2 * beta)) ** 2, h


def simpo_loss(pc, pr, rc, rr, nc, nr, *, beta: float, gamma: float, **_):
    """SimPO (Meng et al. 2024), reference-free: −log σ(β/|yc| · πc − β/|yr| · πr − γ)."""
    margin = beta * (pc / nc - pr / nr) - gamma
    return -F.logsigmoid(margin), margin


def orpo_loss(pc, pr, rc, rr, nc, nr, *, orpo_lambda: float, **_):
    """ORPO (Hong et al. 2024), reference-free: λ · −log σ(log odds(yc) − log odds(yr)), odds(y) = p/(1 − p) with p
    the length-averaged likelihood; the chosen answer's NLL is added by the caller (ORPO's L_SFT)."""
    ac, ar = pc / nc, pr / nr
    log_odds = (ac - ar) - (_log1m_exp(ac) - _log1m_exp(ar))
    return -orpo_lambda * F.logsigmoid(log_odds), log_odds


PAIRED = {"dpo": dpo_loss, "ipo": ipo_loss, "simpo": simpo_loss, "orpo": orpo_loss}
REFERENCE_FREE = ("simpo", "orpo")


def kto_loss(policy, ref, kl_policy, kl_ref, desirable, *, beta: float, desirable_weight: float,
             undesirable_weight: float):
    """KTO (Ethayarajh et al. 2024) on unpaired answers: r = log π(y|x) − log π_ref(y|x); z₀ = max(0, mean of the same
    log-ratio on mismatched (x, y') pairs), detached; desirable: λ_D · (1 − σ(β(r − z₀))), undesirable:
    λ_U · (1 − σ(β(z₀ − r))). Returns (loss per answer, r, z₀)."""
    r = policy - ref
    z0 = (kl_policy - kl_ref).mean().clamp(min=0).detach()
    loss = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (r - z0))),
                       undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r))))
    return loss, r, z0


class PreferenceLoss:
    """The preference stage's loss (`dpo.loss`): DPO, IPO, SimPO or ORPO on (chosen, rejected) document pairs
    (`group_docs`), or KTO on (answer, mismatched answer) pairs with a desirable/undesirable label per pair.

    The reference policy is the same weights with the LoRA adapter disabled — no second model copy — and SimPO
    and ORPO skip its forward altogether. `nll_weight` adds the chosen answer's NLL (ORPO has its own, weight 1).
    """

    def __init__(self, beta: float = 0.1, nll_weight: float = 0.0, kind: str = "dpo", *, gamma: float = 0.5,
                 orpo_lambda: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
        self.kind, self.beta, self.nll_weight = kind, beta, nll_weight
        self.params = dict(beta=beta, gamma=gamma, orpo_lambda=orpo_lambda)
        self.kto = dict(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)

    @classmethod
    def of(cls, tc) -> "PreferenceLoss":
        """From a DPOConfig section."""
        return cls(tc.beta, tc.nll_weight, tc.loss, gamma=tc.simpo_gamma, orpo_lambda=tc.orpo_lambda,
                   desirable_weight=tc.kto_desirable_weight, undesirable_weight=tc.kto_undesirable_weight)

    def __call__(self, model, batch) -> tuple[torch.Tensor, dict]:
        policy, counts = group_logprobs(model, batch)                      # (pairs, 2) each
        ref = None
        if self.kind not in REFERENCE_FREE:
            with torch.no_grad(), lora_disabled(model):
                ref, _ = group_logprobs(model, batch)
        if self.kind == "kto":
            return self._kto(policy, ref, batch["group_labels"].bool())
        n = counts.clamp(min=1).to(policy.dtype)
        per_pair, margin = PAIRED[self.kind](policy[:, 0], policy[:, 1], *(ref.unbind(1) if ref is not None
                                                                           else (None, None)),
                                             n[:, 0], n[:, 1], **self.params)
        loss = per_pair.mean()
        nll_weight = 1.0 if self.kind == "orpo" else self.nll_weight
        if nll_weight:
            loss = loss + nll_weight * (-policy[:, 0].sum() / counts[:, 0].sum().clamp(min=1))
        rewards = self.beta * ((policy - ref) if ref is not None else policy / n)
        return loss, {"loss": loss.detach(), "reward_margin": margin.detach().mean(),
                      "preference_accuracy": (margin > 0).float().mean().detach(),
                      "chosen_reward": rewards[:, 0].detach().mean(), "rejected_reward": rewards[:, 1].detach().mean()}

    def _kto(self, policy, ref, desirable) -> tuple[torch.Tensor, dict]:
        per, r, z0 = kto_loss(policy[:, 0], ref[:, 0], policy[:, 1].detach(), ref[:, 1], desirable, **self.kto)
        loss = per.mean()
        good, bad = desirable.float(), (~desirable).float()
        return loss, {"loss": loss.detach(), "kl": z0,
                      "desirable_reward": (self.beta * r * good).sum().detach() / good.sum().clamp(min=1),
                      "undesirable_reward": (self.beta * r * bad).sum().detach() / bad.sum().clamp(min=1),
                      "preference_accuracy": ((r > z0) == desirable).float().mean().detach()}



class WithMTP:
    """`<stage>.mtp: train` (and pretraining with model.mtp_layers): the stage's loss plus `weight` × the MTP
    layer's cross-entropy of token t+2 from slot t (model/mtp.py `mtp_loss`) on the labelled tokens — with
    `chosen_only` (preference stages) the chosen answers' only (KTO: the desirable ones). It reuses the hidden states
    of the stage loss's first forward (the policy's, with gradients), so the MTP loss's gradient reaches the main
    model too. `loss` in the metrics is the sum that is optimised; `mtp_loss` the MTP term before its weight."""

    def __init__(self, loss, weight: float, chosen_only: bool = False):
        self.loss, self.weight, self.chosen_only = loss, weight, chosen_only

    def __call__(self, model, batch) -> tuple[torch.Tensor, dict]:
        with mtp.captured_hidden(model) as seen:
            loss, metrics = self.loss(model, batch)
        docs = None
        if self.chosen_only:
            groups = batch["group_docs"]
            docs = groups[batch["group_labels"].bool(), 0] if "group_labels" in batch else groups[:, 0]
        extra, _ = mtp.mtp_loss(model, seen[0], batch, docs)
        total = loss + self.weight * extra
        return total, {**metrics, "loss": total.detach(), "mtp_loss": extra.detach()}


def grpo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *, clip_epsilon: float,
                    ref_logp: torch.Tensor | None = None, kl_beta: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's per-token loss (DeepSeekMath eq. 3): −min(ρ·A, clip(ρ, 1 ± ε)·A) + β·KL, with ρ = π/π_old per token,
    A the answer's advantage (broadcast over its tokens) and KL the k3 estimator exp(r − l) − (r − l) − 1 of the
    policy's divergence from the reference (l, r: policy and reference log-probs). Returns (loss, kl) per token."""
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon) * advantages)
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
    return -surrogate + kl_beta * kl, kl


class GRPOLoss:
    """The RL stage's loss on a batch of sampled answers (engine/rollouts.py): padded rows prompt + answer, labels on
    the answer tokens, one advantage per row. One update per rollout: π_old is the policy that sampled, i.e. these
    weights detached (ρ = 1, its gradient the policy gradient). `loss_type` grpo averages each answer's tokens, then
    the answers; token averages every answer token of the batch alike (DAPO). The batch's rollout statistics
    (`rollout_*` tensors) are passed through as metrics so they land in the step's log line. Log-probabilities are
    those of the distribution the answers were sampled from: logits / `temperature` (as TRL's GRPOTrainer), for the
    policy and the reference alike."""

    def __init__(self, clip_epsilon: float = 0.2, kl_beta: float = 0.0, loss_type: str = "grpo",
                 temperature: float = 1.0):
        if temperature <= 0:
            raise ValueError(f"GRPOLoss: temperature must be > 0, got {temperature}")
        self.clip_epsilon, self.kl_beta, self.loss_type = clip_epsilon, kl_beta, loss_type
        self.temperature = temperature

    @classmethod
    def of(cls, tc) -> "GRPOLoss":
        """From an RLConfig section."""
        return cls(tc.clip_epsilon, tc.kl_beta, tc.loss_type, tc.temperature)

    def _logprobs(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, labels = shifted(model, batch)
        if self.temperature != 1.0:          # (h / T) Wᵀ = logits / T: the lm head has no bias
            hidden = hidden / self.temperature
        return kernels.linear_token_logprobs(hidden, model.lm_head.weight, labels), labels     # (B, T-1)

    def __call__(self, model, batch) -> tuple[torch.Tensor, dict]:
        logp, labels = self._logprobs(model, batch)
        ref = None
        if self.kl_beta:
            with torch.no_grad(), lora_disabled(model):
                ref, _ = self._logprobs(model, batch)
        mask = (labels != IGNORE).to(logp.dtype)
        per_token, kl = grpo_token_loss(logp, logp.detach(), batch["advantages"][:, None].to(logp.dtype),
                                        clip_epsilon=self.clip_epsilon, ref_logp=ref, kl_beta=self.kl_beta)
        tokens = mask.sum(1).clamp(min=1)
        if self.loss_type == "token":
            # a rollout trained in parts (rl.train_chunks) divides by its share of the whole rollout's tokens
            loss = (per_token * mask).sum() / batch.get("token_norm", mask.sum().clamp(min=1))
        else:
            loss = ((per_token * mask).sum(1) / tokens).mean()
        rollout = {k[len("rollout_"):]: v for k, v in batch.items() if k.startswith("rollout_")}
        return loss, {"loss": loss.detach(), "kl": ((kl * mask).sum() / mask.sum().clamp(min=1)).detach(), **rollout}
