"""DPO: a fresh LoRA on the SFT-merged weights; the reference is the same weights with the adapter off."""
from __future__ import annotations

from pathlib import Path

from configs.schema import Config
from engine.adapter_stage import train_adapter
from engine.heldout import eval_preferences
from engine.losses import DPOLoss
from model.adapters import load_policy


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    tc = cfg.dpo
    return train_adapter(cfg, inputs, out_dir, stage="dpo", load_model=lambda i: load_policy(i["base"], i["sft"]),
                         loss=DPOLoss(tc.beta, tc.nll_weight), evaluate=eval_preferences)
