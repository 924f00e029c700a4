"""LoRA supervised fine-tuning: a fresh adapter on the base, loss on the assistant tokens only."""
from __future__ import annotations

import logging
from pathlib import Path

from configs.schema import Config
from data.pipeline import StageData
from engine.fit import check_seq_len, consolidated, fit, setup
from engine.heldout import eval_tasks
from engine.losses import causal_lm_loss
from model import Decoder, inject_lora
from model.adapters import save_adapter
from model.hf import load_native

log = logging.getLogger("glm_lora.sft")


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    tc = cfg.sft
    rt = setup(cfg, tc.seed)
    data = StageData(cfg, inputs["tokenizer"], inputs["data"], rt.device)
    model = load_native(inputs["base"])
    check_seq_len(tc.seq_len, model, "sft")
    lora = tc.lora

    def with_lora(m):
        inject_lora(m, lora.target_modules, lora.r, lora.alpha, lora.dropout, lora.modules_to_save,
                    lora.quantization)
        return m
    with_lora(model)
    log.info("sft: %.3fM trainable of %.2fM", model.num_params(True) / 1e6, model.num_params() / 1e6)
    metrics = fit("sft", cfg, tc, model, causal_lm_loss, data, list(inputs.values()), rt, out_dir)
    model = consolidated(model, rt, lambda: with_lora(Decoder(model.config)))    # None on ranks other than 0
    if model is None:
        return metrics
    if cfg.eval.enabled:
        metrics["eval"] = eval_tasks(cfg, model, data.tok, data.data_dir)
        log.info("sft eval: exact match %.3f %s", metrics["eval"]["exact_match"], metrics["eval"]["per_family"])
    save_adapter(model.cpu(), tc.lora, out_dir)
    return {**metrics, "trainable_params": model.num_params(True)}
