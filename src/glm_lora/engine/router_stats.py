"""Router health of a mixture-of-experts model while it trains: which experts each step's tokens went to.

Per step (the stage's metrics.jsonl and the UI's metrics table): `router_max_share` / `router_min_share`, the
largest and smallest share of a layer's routed tokens one expert got (a balanced layer gives every expert
1/E); per logging window: `router_idle_experts`, how many (layer, expert) pairs got no token at all, with a
warning naming them. Over the stage: each layer's token share per expert (`RouterHealth.summary`: the stage's
`router` metrics, the table artifact and the heat map in the UI, tasks/report.py).

Optional load-balance loss (`<stage>.router_aux_loss`, 0 = off, the default for LoRA: the router and its
e_score_correction_bias are frozen there, so balance is mostly the base model's): DeepSeek-V3's
complementary balance loss over the batch, α · E · Σₑ fₑ · Pₑ per MoE layer (mean over layers), with fₑ the
share of routed tokens expert e got and Pₑ the mean of its normalised sigmoid score (arXiv:2412.19437 §2.1.2).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from glm_lora.model.model import Router

log = logging.getLogger("glm_lora.router")


class RouterHealth:
    def __init__(self, model: torch.nn.Module, aux_weight: float = 0.0, stage: str = "train"):
        self.routers = [(name, m) for name, m in model.named_modules() if isinstance(m, Router)]
        self.aux_weight, self.stage = aux_weight, stage
        experts = self.routers[0][1].weight.shape[0] if self.routers else 0
        self.window = torch.zeros(len(self.routers), experts, dtype=torch.long)
        self.total = torch.zeros_like(self.window)

    def __bool__(self) -> bool:
        return bool(self.routers)

    def wrap(self, loss_fn: Callable) -> Callable:
        """`loss_fn` plus the routing metrics of the step (and the balance loss when asked for)."""
        def loss_with_router_health(model, batch):
            loss, metrics = loss_fn(model, batch)
            stats = [r.stats for _, r in self.routers]
            if any(s is None for s in stats):          # not a training forward
                return loss, metrics
            experts = self.window.shape[1]
            counts = torch.stack([torch.bincount(s["experts"].flatten(), minlength=experts) for s in stats])  # (L, E)
            share = counts.float() / counts.sum(1, keepdim=True).clamp(min=1)
            metrics = {**metrics, "router_max_share": share.max(), "router_min_share": share.min()}
            self.window += counts.cpu()
            if self.aux_weight:
                aux = torch.stack([balance_loss(s["scores"], s["experts"]) for s in stats]).mean()
                loss = loss + self.aux_weight * aux
                metrics["router_aux_loss"] = aux.detach()
            for _, r in self.routers:
                r.stats = None
            return loss, metrics
        return loss_with_router_health

    def end_window(self) -> dict:
        """At each logging window: the experts that got no token in it (a warning names them)."""
        idle = (self.window == 0).nonzero().tolist()
        if idle and self.window.sum():
            where = ", ".join(f"{self.routers[layer][0]} expert {e}" for layer, e in idle[:6])
            log.warning("%s: %d routed expert(s) got no tokens in the last logging window: %s%s", self.stage,
                        len(idle), where, " …" if len(idle) > 6 else "")
        self.total += self.window
        self.window.zero_()
        return {"router_idle_experts": len(idle)}

    def summary(self) -> dict:
        """Over the stage: per MoE layer, each expert's share of the routed tokens, and its max / min."""
        total = self.total + self.window
        share = total.double() / total.sum(1, keepdim=True).clamp(min=1)
        return {"layers": [name.removesuffix(".mlp.gate") for name, _ in self.routers],
                "token_share": [[round(v, 6) for v in row] for row in share.tolist()],
                "max_share": float(share.max()) if share.numel() else 0.0,
                "min_share": float(share.min()) if share.numel() else 0.0,
                "idle_experts": int((total == 0).sum())}


def balance_loss(scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """E · Σₑ fₑ · Pₑ for one layer: scores (N, E) sigmoid router scores, experts (N, k) the chosen ones."""
    N, E = scores.shape
    f = torch.bincount(experts.flatten(), minlength=E).float() / experts.numel()     # share of routed slots
    p = (scores / scores.sum(-1, keepdim=True)).mean(0)                               # mean normalised score
    return E * (f * p).sum()
