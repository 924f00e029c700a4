"""What every training stage shares: runtime setup, the model config from the user's config, and
`fit()` — data stream + validation + checkpoints around the one loop (engine/trainer.py).

Under torchrun (engine/dist.py) `setup` puts each rank on its device, `fit` shards the data and wraps
the model for the stage's strategy (the model the stage passed in is then trained in place: whole on
every rank with DDP, sharded with FSDP2), and `consolidated` gives rank 0 the plain trained model back
for held-out evaluation and the stage's files.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable

import torch

from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import Config, TrainConfig
from glm_lora.data.pipeline import StageData
from glm_lora.engine import dist, progress
from glm_lora.engine.checkpoint import Checkpointer
from glm_lora.engine.compile import compiled_training
from glm_lora.engine.cuda_graphs import graphed_training
from glm_lora.engine.validation import validation_loss
from glm_lora.engine.trainer import Runtime, train
from glm_lora.model import DecoderConfig

METRICS, LOSSES = "metrics.jsonl", "losses.json"   # per-window metrics; the loss of every step


def setup(cfg: Config, seed: int) -> Runtime:
    torch.manual_seed(seed)       # every rank alike: the same initial weights everywhere
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rt = Runtime.resolve(cfg.device, cfg.precision)
    d = dist.current()
    return rt if d is None else Runtime(d.device, rt.dtype, d)


def decoder_config(cfg: Config, vocab: int) -> DecoderConfig:
    """The from-scratch model: `model.*` as given, its vocabulary from the tokenizer unless set."""
    m = cfg.model
    if m.vocab_size is not None and m.vocab_size < vocab:
        raise UserError(f"model.vocab_size {m.vocab_size} is smaller than the tokenizer's {vocab} tokens")
    fields = m.model_dump(exclude={"mtp_layers"})
    return DecoderConfig(**{**fields, "vocab_size": m.vocab_size or vocab, "num_nextn_predict_layers": m.mtp_layers})


def check_seq_len(seq_len: int, model, key: str) -> None:
    if seq_len > model.config.max_seq_len:
        raise UserError(f"{key}.seq_len {seq_len} exceeds model.max_seq_len {model.config.max_seq_len}")


def fit(stage: str, cfg: Config, tc: TrainConfig, model, loss_fn, data: StageData, inputs: list[Path], rt: Runtime,
        out_dir: Path, window_metrics: Callable[[], dict] | None = None) -> dict:
    """Train `model` on the stage's split with checkpoints, validation and early stopping; return its metrics.
    Several processes: every rank trains its share; rank 0 writes the metrics files. `window_metrics()` adds to
    each logging window's line what only a whole window tells (a MoE model's idle experts)."""
    d = rt.dist
    strategy = dist.strategy_for(cfg, stage) if d else None
    section = tc        # as configured: names the checkpoint directory, which must not depend on the world size
    if tc.global_batch_size is not None:
        tc = tc.model_copy(update={"grad_accum": dist.grad_accum(cfg, stage, d.world_size if d else 1)})
    parts = getattr(tc, "train_chunks", 1)      # rl: each rollout arrives as train_chunks micro-batches
    if parts > 1:
        tc = tc.model_copy(update={"grad_accum": tc.grad_accum * parts})
    extra = {}
    if d:
        with d.main_first():        # rank 0 tokenises into the shared cache, the others then open it
            data.store(stage, tc)
            if tc.eval_every:
                data.store(stage, tc, split=f"{stage}_eval")
        make_batches, summary_data = data.batches(stage, tc, rank=d.rank, world_size=d.world_size)
        ckpt = Checkpointer.for_stage(cfg, stage, section, inputs, model, dist=d, sharded=strategy == "fsdp2")
        train_loss = dist.parallelize(model, loss_fn, strategy, rt)
        torch.manual_seed(tc.seed + 1_000_003 * (d.rank + 1))    # each rank its own dropout masks from here
        extra = {"world_size": d.world_size, "strategy": strategy, "grad_accum": tc.grad_accum,
                 "global_batch_size": tc.batch_size * tc.grad_accum // parts * d.world_size}
    else:
        make_batches, summary_data = data.batches(stage, tc)
        ckpt = Checkpointer.for_stage(cfg, stage, section, inputs, model)
        train_loss = loss_fn
    model.gradient_checkpointing = tc.activation_checkpointing
    validate = validation_loss(data, stage, tc, loss_fn, model, rt, cfg.eval.max_rows) if tc.eval_every else None
    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)
    with (open(Path(out_dir) / METRICS, "a", encoding="utf-8") if rt.main    # a JSON line per logging window
          else contextlib.nullcontext()) as metrics:
        def on_log(window: dict) -> None:
            window = {**window, **(window_metrics() if window_metrics else {})}
            print(json.dumps(window), file=metrics, flush=True)
            progress.report({"stage": stage, "step": window["step"], "max_steps": tc.max_steps,
                             "loss": window.get("loss"), "tokens_per_s": window.get("tokens_per_s"),
                             "elapsed_s": window.get("elapsed_s")})
        with compiled_training(model, tc.compile, device=rt.device, dist=d, runs_dir=cfg.runs_dir,
                               name=stage, steps=tc.max_steps) as compiled, \
                graphed_training(model, tc.cuda_graphs, device=rt.device, dist=d, grad_accum=tc.grad_accum,
                                 name=stage) as graphed:
            summary = train(model, train_loss, make_batches, tc, rt, checkpointer=ckpt, validate=validate,
                            on_log=on_log if rt.main else None)
    losses = summary.pop("losses")
    if rt.device.type == "cuda":        # this process's training peak (allocated tensors; the caching allocator holds more)
        summary["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated(rt.device) / 1e9
    if rt.main:
        (Path(out_dir) / LOSSES).write_text(json.dumps(losses))
    return {**summary, **ckpt.metrics(), **summary_data, **extra, **compiled, **graphed, "checkpoints": str(ckpt.root)}


def consolidated(model, rt: Runtime, build: Callable[[], torch.nn.Module]):
    """The trained model, whole and plain, where held-out evaluation and saving happen: `model` itself with
    one process; rank 0's copy under torchrun (None on the other ranks). `build()` makes an untrained model
    of the same architecture (called on the meta device, only to gather a sharded model into)."""
    return dist.consolidated(model, rt, build)
