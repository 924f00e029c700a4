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
    groups: dict[tuple[float, bool], list] = {}       # (lr_scale, decayed: matrices only) -> params
    for n, p in named:
        scale = lora_b_lr_ratio if n.endswith("lora_B.weight") else 1.0
        groups.setdefault((scale, p.ndim >= 2), []).append(p)
    return torch.optim.AdamW([{"params": ps, "weight_decay": weight_decay if decay else 0.0, "lr_scale": scale}
                              for (scale, decay), ps in groups.items()], lr=lr, betas=(0.9, 0.95), fused=fused)


def lr_at(step: int, *, max_steps: int, warmup_steps: int, base_lr: float, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step `step` (0-based); cosine reaches min_lr at max_steps."""
    if warmup_steps and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * cosine)
