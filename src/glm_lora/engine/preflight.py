"""What can be checked before any stage runs, checked before any stage runs.

The schema (configs/schema.py) checks the config on its own; this adds what needs the disk:
the user's data files exist and are readable, and a base model directory is importable
(config.json of a supported layout with the keys we need, safetensors weights, a tokenizer that
fits its vocabulary, LoRA targets the layout has) with positions enough for every `seq_len` and
for `serve.max_model_len`; the lm-evaluation-harness tasks named exist and load offline. A mistake
found here costs seconds, not a training run; each raises a UserError naming the file and key.
"""
from __future__ import annotations

import logging

import torch

from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import Config
from glm_lora.engine import dist
from glm_lora.engine.fit import decoder_config
from glm_lora.engine.memory import GiB, describe, fits, lora_memory
from glm_lora.engine.trainer import Runtime
from glm_lora.data import formats
from glm_lora.data.cleaning import CleanReport
from glm_lora.data.prepare import base_tokenizer_files, check_user_paths
from glm_lora.data.tokenizer import load_tokenizer
from glm_lora.engine import rewards
from glm_lora.model.hf import check_tokenizer_fits, check_weights, read_hf_config
from glm_lora.evaluation import harness
from glm_lora.evaluation.metrics import read_task_rows
from glm_lora.model import gguf_support
from glm_lora.model.lora import check_lora
from glm_lora.model.model import DecoderConfig

log = logging.getLogger("glm_lora.preflight")


def preflight(cfg: Config) -> None:
    check_user_paths(cfg.data)
    _check_preference_rows(cfg)
    _check_rl(cfg)
    dist.check(cfg)              # batch math for the world size: rows × seq_len × grad_accum × world
    harness.check(cfg.eval.harness, synthetic=cfg.data.sft is None)   # lm-evaluation-harness tasks known and loadable
    if cfg.base_model is None:
        if cfg.tokenizer.path is not None:
            base_tokenizer_files(cfg.tokenizer.path.expanduser().resolve(), "tokenizer.path")
        _check_lora(cfg, decoder_config(cfg, 1))
        gguf_support.check(cfg.export.gguf, cfg.model.arch)
        return
    if not cfg.base_model.is_dir():
        raise UserError(f"base_model: {cfg.base_model} is not a directory (expected a local Hugging Face model dir)")
    layout = read_hf_config(cfg.base_model)
    limit = layout.max_seq_len
    check_weights(cfg.base_model)
    base_tokenizer_files(cfg.base_model)
    check_tokenizer_fits(cfg.base_model, len(load_tokenizer(cfg.base_model)))
    _check_lora(cfg, layout)
    _check_mtp(cfg, layout)
    _check_memory(cfg, layout)
    gguf_support.check(cfg.export.gguf, layout.arch, tokenizer_dir=cfg.base_model)
    lengths = {"sft.seq_len": cfg.sft.seq_len, "dpo.seq_len": cfg.dpo.seq_len}     # pretraining is skipped
    if cfg.serve.enabled:
        lengths["serve.max_model_len"] = cfg.serve.max_model_len
    for key, value in lengths.items():
        if value > limit:
            raise UserError(f"{key} ({value}) exceeds the base model's max_position_embeddings ({limit}) in "
                            f"{cfg.base_model / 'config.json'}; lower {key}")


def _check_lora(cfg: Config, layout: DecoderConfig) -> None:
    """Each LoRA stage's targets exist in the layout, fit the experts' rules and (nf4) split into whole blocks:
    model/lora.py's own checks on a model of this layout on the meta device."""
    for section, lora in (("sft.lora", cfg.sft.lora), ("dpo.lora", cfg.dpo.lora)) + (
            (("rl.lora", cfg.rl.lora),) if cfg.rl.enabled else ()):
        check_lora(layout, lora, section)


def _check_mtp(cfg: Config, layout: DecoderConfig) -> None:
    """`<stage>.mtp: train` needs a base model with an MTP layer (the schema checks a from-scratch model's)."""
    for key in ("sft", "dpo"):
        if getattr(cfg, key).mtp == "train" and not layout.num_nextn_predict_layers:
            raise UserError(f"{key}.mtp: train needs a model with an MTP (multi-token prediction) layer, and "
                            f"{cfg.base_model / 'config.json'} declares none (num_nextn_predict_layers: "
                            f"{layout.num_nextn_predict_layers}); set {key}.mtp: carry")


def _check_rl(cfg: Config) -> None:
    """The RL stage's reward functions import and exist, and its prompt file (rl.prompts) reads, before any stage
    trains."""
    if cfg.rl.enabled:
        rewards.resolve(cfg.rl.rewards)
        if cfg.rl.prompts is not None:
            _check_rl_prompts(cfg)


def _check_rl_prompts(cfg: Config) -> None:
    path = cfg.rl.prompts
    if not path.is_file():
        raise UserError(f"rl.prompts: {path} is not a file")
    rows = read_task_rows(path, on_bad_row=cfg.data.on_bad_row, max_line_bytes=cfg.data.max_line_bytes)
    for k, row in enumerate(rows):
        conv = row["conversations"]
        if len(conv) < 2 or conv[-1]["role"] != "assistant":
            raise UserError(f"rl.prompts: {path}: row {k + 1} must end with an assistant message (the reference "
                            "answer the rewards compare with) after at least one user message")
    if not rows:
        raise UserError(f"rl.prompts: {path} has no rows")


def _check_memory(cfg: Config, layout: DecoderConfig) -> None:
    """A base model's LoRA stages must fit the GPU they run on (engine/memory.py's estimate, per process): too
    big is refused before anything runs, naming what to change. Logged for a mixture-of-experts base."""
    on_cuda = cfg.device != "cpu" and torch.cuda.is_available()
    half = Runtime.resolve("cuda" if on_cuda else "cpu", cfg.precision).weights_in_compute_dtype
    for stage, tc in (("sft", cfg.sft), ("dpo", cfg.dpo)):
        need = lora_memory(layout, tc.lora, tc, world_size=dist.world_size(cfg), strategy=dist.strategy_for(cfg, stage),
                           cuda_half=half)
        if layout.layout.moe:
            log.info("%s needs about %.1f GiB per process (%s)", stage, need["total"] / GiB, describe(need))
        if on_cuda:
            have = torch.cuda.get_device_properties(0).total_memory
            if not fits(need["total"], have):
                raise UserError(f"{stage} needs about {need['total'] / GiB:.1f} GiB per GPU ({describe(need)}) and "
                                f"this GPU has {have / GiB:.1f} GiB (base_model {cfg.base_model}): set dist.strategy fsdp2 "
                                f"over more GPUs (dist.nproc_per_node), {stage}.activation_checkpointing: true, a "
                                f"smaller {stage}.batch_size, or {stage}.lora.quantization nf4 (4-bit frozen layers and experts)")


def _check_preference_rows(cfg: Config) -> None:
    """data.dpo may hold unpaired KTO rows, which only dpo.loss kto trains on (the data stage accepts both kinds):
    with a paired loss, its rows are read now, so such a row stops the run before SFT trains, naming file:line."""
    dc = cfg.data
    if dc.dpo is None or cfg.dpo.loss == "kto":
        return
    report = CleanReport(max_examples=0)
    for _ in formats.read_dpo(dc.dpo, on_bad_row=dc.on_bad_row, report=report, max_line_bytes=dc.max_line_bytes):
        pass
