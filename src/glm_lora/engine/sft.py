"""LoRA supervised fine-tuning: a fresh adapter on the base, loss on the assistant tokens only."""
from __future__ import annotations

from pathlib import Path

from glm_lora.configs.schema import Config
from glm_lora.engine.adapter_stage import train_adapter
from glm_lora.evaluation.heldout import eval_tasks
from glm_lora.model.heads import causal_lm_loss
from glm_lora.model.hf import load_native


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    return train_adapter(cfg, inputs, out_dir, stage="sft", load_model=lambda i, place: load_native(i["base"], place=place),
                         loss=causal_lm_loss, evaluate=eval_tasks)
