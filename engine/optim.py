"""AdamW with decoupled weight decay on matrices only, and linear warmup + cosine decay."""
from __future__ import annotations

import math

import torch


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, fused: bool = False,
                    lora_b_lr_ratio: float = 1.0) -> torch.optim.AdamW:
    """Groups carry `lr_scale` (the loop sets lr = schedule × lr_scale): LoRA+ (Hayou et al. 2024)
    trains each adapter's B faster than its A, which speeds up LoRA learning."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("model has no trainable parameters")
    groups = []
    for scale in {1.0, lora_b_lr_ratio}:
        picked = [(n, p) for n, p in named if (lora_b_lr_ratio if n.endswith("lora_B.weight") else 1.0) == scale]
        decay = [p for _, p in picked if p.ndim >= 2]
        no_decay = [p for _, p in picked if p.ndim < 2]
        groups += [{"params": decay, "weight_decay": weight_decay, "lr_scale": scale},
                   {"params": no_decay, "weight_decay": 0.0, "lr_scale": scale}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95), fused=fused)


def lr_at(step: int, *, max_steps: int, warmup_steps: int, base_lr: float, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step `step` (0-based); cosine reaches min_lr at max_steps."""
    if warmup_steps and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * cosine)
