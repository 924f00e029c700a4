"""Pretraining from scratch: the decoder of `model.*` on the pretrain split, next-token loss."""
from __future__ import annotations

import logging
from pathlib import Path

from glm_lora.configs.schema import Config
from glm_lora.data.pipeline import StageData
from glm_lora.engine.fit import check_seq_len, consolidated, decoder_config, fit, setup
from glm_lora.engine.losses import WithMTP
from glm_lora.evaluation.heldout import eval_lm
from glm_lora.model.heads import causal_lm_loss
from glm_lora.model import Decoder, mtp
from glm_lora.model.hf import save_native

log = logging.getLogger("glm_lora.pretrain")


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    tc = cfg.pretrain
    rt = setup(cfg, tc.seed)
    data = StageData(cfg, inputs["tokenizer"], inputs["data"], rt.device)
    model = Decoder(decoder_config(cfg, len(data.tok)))
    loss = causal_lm_loss
    if model.config.num_nextn_predict_layers:       # model.mtp_layers: trained beside the decoder, as GLM's is
        mtp.attach(model, fresh=True)
        loss = WithMTP(causal_lm_loss, tc.mtp_weight)
    check_seq_len(tc.seq_len, model, "pretrain")
    log.info("pretrain: %.2fM parameters", model.num_params() / 1e6)
    init = eval_lm(cfg, model, data.tok, data.data_dir) if cfg.eval.enabled and rt.main else None
    metrics = fit("pretrain", cfg, tc, model, loss, data, list(inputs.values()), rt, out_dir)
    model = consolidated(model, rt, lambda: mtp.same_architecture(model))     # None on ranks other than 0
    if model is None:
        return metrics
    if cfg.eval.enabled:
        metrics["eval"] = {**eval_lm(cfg, model, data.tok, data.data_dir), "init_perplexity": init["perplexity"],
                           "init_bits_per_byte": init["bits_per_byte"]}
        log.info("pretrain eval: %s", metrics["eval"])
    save_native(model.cpu(), out_dir)                  # the MTP layer: stored with the carried tensors
    return {**metrics, "params": model.num_params()}
