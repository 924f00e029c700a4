"""The online RL stage (`rl`, GRPO): a fresh LoRA on the DPO model, trained on its own sampled answers to the SFT
prompts, scored by `rl.rewards` (engine/rollouts.py, engine/rewards.py, GRPOLoss in engine/losses.py); its
held-out view is the SFT stage's (exact match per family on sft_eval), and the sampled answers of the last steps
with their rewards are kept for the UI."""
from __future__ import annotations

from pathlib import Path

from glm_lora.configs.schema import Config
from glm_lora.engine.adapter_stage import train_adapter
from glm_lora.engine.heldout import eval_tasks
from glm_lora.engine.losses import GRPOLoss
from glm_lora.engine.rollouts import Rollouts
from glm_lora.model.adapters import load_policy


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    made: list[Rollouts] = []

    def rollouts(data, model, rt) -> Rollouts:
        made.append(Rollouts(cfg, data.tok, data.data_dir, model, rt))
        return made[-1]

    metrics = train_adapter(cfg, inputs, out_dir, stage="rl",
                            load_model=lambda i: load_policy(i["base"], i["sft"], i["dpo"]),
                            loss=GRPOLoss.of(cfg.rl), evaluate=eval_tasks, batches=rollouts)
    return {**metrics, "samples": made[0].samples if made else []}
