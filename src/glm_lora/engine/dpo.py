"""The preference stage (`dpo`): a fresh LoRA on the SFT-merged weights trained with `dpo.loss` — DPO, IPO, SimPO,
ORPO or KTO (engine/losses.py); where the loss has a reference, it is the same weights with the adapter off."""
from __future__ import annotations

from pathlib import Path

from glm_lora.configs.schema import Config
from glm_lora.engine.adapter_stage import train_adapter
from glm_lora.evaluation.heldout import eval_preferences
from glm_lora.engine.losses import PreferenceLoss
from glm_lora.model.adapters import load_policy


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    return train_adapter(cfg, inputs, out_dir, stage="dpo", load_model=lambda i, _: load_policy(i["base"], i["sft"]),
                         loss=PreferenceLoss.of(cfg.dpo), evaluate=eval_preferences)
