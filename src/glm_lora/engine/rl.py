"""The online RL stage (`rl`, GRPO): a fresh LoRA on the DPO model, trained on its own sampled answers to the SFT
prompts, scored by `rl.rewards` (engine/rollouts.py, engine/rewards.py, GRPOLoss in engine/losses.py); its
held-out view is the SFT stage's (exact match per family on sft_eval), and the sampled answers of the last steps
with their rewards are kept for the UI."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import Config
from glm_lora.engine.adapter_stage import train_adapter
from glm_lora.evaluation.heldout import eval_tasks
from glm_lora.engine.losses import GRPOLoss
from glm_lora.engine.rollouts import Rollouts
from glm_lora.model.adapters import load_policy


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path, make_sampler: Callable | None = None) -> dict:
    """`make_sampler(cfg, policy, tokenizer_dir)`: what samples the answers instead of our own sampler (None: ours),
    made on the policy before its adapter is added, closed when the stage ends: tasks/rl_sampler.py's vLLM server."""
    if cfg.rl.sampler != "ours" and make_sampler is None:
        raise UserError(f"rl.sampler {cfg.rl.sampler} runs in one process, from the DAG's rl stage (the flow, or "
                        "`python -m glm_lora.flows.cli stage rl`): not under torchrun (dist.nproc_per_node > 1) nor "
                        "`python -m glm_lora.engine rl`, which sample with rl.sampler ours")
    made: list[Rollouts] = []
    samplers: list = []

    def load(i: dict[str, Path], _):
        policy = load_policy(i["base"], i["sft"], i["dpo"])
        samplers.append(make_sampler(cfg, policy, i["tokenizer"]) if make_sampler else None)
        return policy

    def rollouts(data, model, rt) -> Rollouts:
        made.append(Rollouts(cfg, data.tok, data.data_dir, model, rt, sampler=samplers[-1]))
        return made[-1]

    try:
        metrics = train_adapter(cfg, inputs, out_dir, stage="rl", load_model=load, loss=GRPOLoss.of(cfg.rl),
                                evaluate=eval_tasks, batches=rollouts)
    finally:
        for s in filter(None, samplers):
            s.close()
    return {**metrics, "samples": made[0].samples if made else [], "sampler": cfg.rl.sampler}
