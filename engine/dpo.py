"""DPO: a fresh LoRA on the SFT-merged weights; the reference is the same weights with the adapter off."""
from __future__ import annotations

import logging
from pathlib import Path

from configs.schema import Config
from data.pipeline import StageData
from engine.fit import check_seq_len, consolidated, fit, setup
from engine.heldout import eval_preferences
from engine.losses import DPOLoss
from model import Decoder, inject_lora
from model.adapters import load_policy, save_adapter

log = logging.getLogger("glm_lora.dpo")


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    tc = cfg.dpo
    rt = setup(cfg, tc.seed)
    data = StageData(cfg, inputs["tokenizer"], inputs["data"], rt.device)
    model = load_policy(inputs["base"], inputs["sft"])
    check_seq_len(tc.seq_len, model, "dpo")
    lora = tc.lora

    def with_lora(m):
        inject_lora(m, lora.target_modules, lora.r, lora.alpha, lora.dropout, lora.modules_to_save,
                    lora.quantization)
        return m
    with_lora(model)
    log.info("dpo: beta %.3g, nll_weight %.3g", tc.beta, tc.nll_weight)
    metrics = fit("dpo", cfg, tc, model, DPOLoss(tc.beta, tc.nll_weight), data, list(inputs.values()), rt,
                  out_dir)
    model = consolidated(model, rt, lambda: with_lora(Decoder(model.config)))    # None on ranks other than 0
    if model is None:
        return metrics
    if cfg.eval.enabled:
        metrics["eval"] = eval_preferences(cfg, model, data.tok, data.data_dir)
        log.info("dpo eval: %s", {k: v for k, v in metrics["eval"].items() if k not in ("samples", "per_family")})
    save_adapter(model.cpu(), tc.lora, out_dir)
    return {**metrics, "trainable_params": model.num_params(True)}
