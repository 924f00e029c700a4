"""What can be checked before any stage runs, checked before any stage runs.

The schema (configs/schema.py) checks the config on its own; this adds what needs the disk:
the user's data files exist and are readable, and a base model directory is importable
(config.json with the keys we need, safetensors weights, a tokenizer) with positions enough
for every `seq_len` and for `serve.max_model_len`. A mistake found here costs seconds, not a
training run; each raises a UserError naming the file and key.
"""
from __future__ import annotations

from configs.errors import UserError
from configs.schema import Config
from data.prepare import base_tokenizer_files, check_user_paths
from model.hf import check_weights, read_hf_config


def preflight(cfg: Config) -> None:
    check_user_paths(cfg.data)
    if cfg.base_model is None:
        return
    if not cfg.base_model.is_dir():
        raise UserError(f"base_model: {cfg.base_model} is not a directory (expected a local Hugging Face model dir)")
    limit = read_hf_config(cfg.base_model).max_seq_len
    check_weights(cfg.base_model)
    base_tokenizer_files(cfg.base_model)
    lengths = {"sft.seq_len": cfg.sft.seq_len, "dpo.seq_len": cfg.dpo.seq_len}     # pretraining is skipped
    if cfg.serve.enabled:
        lengths["serve.max_model_len"] = cfg.serve.max_model_len
    for key, value in lengths.items():
        if value > limit:
            raise UserError(f"{key} ({value}) exceeds the base model's max_position_embeddings ({limit}) in "
                            f"{cfg.base_model / 'config.json'}; lower {key}")
