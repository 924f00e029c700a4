"""LoRA supervised fine-tuning: a fresh adapter on the base, loss on the assistant tokens only."""
from __future__ import annotations

from pathlib import Path

from configs.schema import Config
from engine.adapter_stage import train_adapter
from engine.heldout import eval_tasks
from engine.losses import causal_lm_loss
from model.hf import load_native


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    return train_adapter(cfg, inputs, out_dir, stage="sft", load_model=lambda i: load_native(i["base"]),
                         loss=causal_lm_loss, evaluate=eval_tasks)
