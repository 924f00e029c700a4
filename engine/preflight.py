"""What can be checked before any stage runs, checked before any stage runs.

The schema (configs/schema.py) checks the config on its own; this adds what needs the disk:
the user's data files exist and are readable, and a base model directory is importable
(config.json of a supported layout with the keys we need, safetensors weights, a tokenizer that
fits its vocabulary, LoRA targets the layout has) with positions enough for every `seq_len` and
for `serve.max_model_len`. A mistake found here costs seconds, not a
training run; each raises a UserError naming the file and key.
"""
from __future__ import annotations

import torch

from configs.errors import UserError
from configs.schema import Config
from engine import dist
from data.prepare import base_tokenizer_files, check_user_paths
from data.tokenizer import load_tokenizer
from model.hf import check_tokenizer_fits, check_weights, read_hf_config
from model.lora import check_nf4_blocks, check_targets, target_names
from model.model import Decoder, DecoderConfig


def preflight(cfg: Config) -> None:
    check_user_paths(cfg.data)
    dist.check(cfg)              # batch math for the world size: rows × seq_len × grad_accum × world
    if cfg.base_model is None:
        layout = DecoderConfig(**{**cfg.model.model_dump(), "vocab_size": 1})
        for key, lora in (("sft.lora.target_modules", cfg.sft.lora), ("dpo.lora.target_modules", cfg.dpo.lora)):
            check_targets(layout, lora.target_modules, key)
        _check_quantizable(cfg, layout)
        return
    if not cfg.base_model.is_dir():
        raise UserError(f"base_model: {cfg.base_model} is not a directory (expected a local Hugging Face model dir)")
    layout = read_hf_config(cfg.base_model)
    limit = layout.max_seq_len
    check_weights(cfg.base_model)
    base_tokenizer_files(cfg.base_model)
    check_tokenizer_fits(cfg.base_model, len(load_tokenizer(cfg.base_model)))
    for key, lora in (("sft.lora.target_modules", cfg.sft.lora), ("dpo.lora.target_modules", cfg.dpo.lora)):
        check_targets(layout, lora.target_modules, key)
    _check_quantizable(cfg, layout)
    lengths = {"sft.seq_len": cfg.sft.seq_len, "dpo.seq_len": cfg.dpo.seq_len}     # pretraining is skipped
    if cfg.serve.enabled:
        lengths["serve.max_model_len"] = cfg.serve.max_model_len
    for key, value in lengths.items():
        if value > limit:
            raise UserError(f"{key} ({value}) exceeds the base model's max_position_embeddings ({limit}) in "
                            f"{cfg.base_model / 'config.json'}; lower {key}")


def _check_quantizable(cfg: Config, layout: DecoderConfig) -> None:
    """lora.quantization nf4: every target layer's weight splits into whole 64-weight blocks (a model on the
    meta device: shapes only, no memory)."""
    with torch.device("meta"):
        model = Decoder(layout)
    for key, lora in (("sft.lora.quantization", cfg.sft.lora), ("dpo.lora.quantization", cfg.dpo.lora)):
        if lora.quantization == "nf4":
            check_nf4_blocks(model, target_names(model, lora.target_modules), key)
