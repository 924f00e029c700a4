"""What every training stage shares: runtime setup, the model config from the user's config, and
`fit()` — data stream + validation + checkpoints around the one loop (engine/trainer.py)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from configs.errors import UserError
from configs.schema import Config, TrainConfig
from data.pipeline import StageData
from engine.checkpoint import Checkpointer
from engine.heldout import validation_loss
from engine.trainer import Runtime, train
from model import DecoderConfig

METRICS, LOSSES = "metrics.jsonl", "losses.json"   # per-window metrics; the loss of every step


def setup(cfg: Config, seed: int) -> Runtime:
    torch.manual_seed(seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return Runtime.resolve(cfg.device, cfg.precision)


def decoder_config(cfg: Config, vocab: int) -> DecoderConfig:
    """The from-scratch model: `model.*` as given, its vocabulary from the tokenizer unless set."""
    m = cfg.model
    if m.vocab_size is not None and m.vocab_size < vocab:
        raise UserError(f"model.vocab_size {m.vocab_size} is smaller than the tokenizer's {vocab} tokens")
    return DecoderConfig(**{**m.model_dump(), "vocab_size": m.vocab_size or vocab})


def check_seq_len(seq_len: int, model, key: str) -> None:
    if seq_len > model.config.max_seq_len:
        raise UserError(f"{key}.seq_len {seq_len} exceeds model.max_seq_len {model.config.max_seq_len}")


def fit(stage: str, cfg: Config, tc: TrainConfig, model, loss_fn, data: StageData, inputs: list[Path], rt: Runtime,
        out_dir: Path) -> dict:
    """Train `model` on the stage's split with checkpoints, validation and early stopping; return its metrics."""
    make_batches, summary_data = data.batches(stage, tc)
    model.gradient_checkpointing = tc.activation_checkpointing
    ckpt = Checkpointer.for_stage(cfg, stage, tc, inputs, model)
    validate = validation_loss(data, stage, tc, loss_fn, model, rt, cfg.eval.max_rows) if tc.eval_every else None
    with open(Path(out_dir) / METRICS, "a", encoding="utf-8") as metrics:       # a JSON line per logging window
        summary = train(model, loss_fn, make_batches, tc, rt, checkpointer=ckpt, validate=validate,
                        on_log=lambda s: print(json.dumps(s), file=metrics, flush=True))
    (Path(out_dir) / LOSSES).write_text(json.dumps(summary.pop("losses")))
    return {**summary, **ckpt.metrics(), **summary_data, "checkpoints": str(ckpt.root)}
