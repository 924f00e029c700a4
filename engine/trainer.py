"""The one training loop shared by pretrain, SFT and DPO; only the loss function differs.

Logged per window: loss and the loss's own metrics, tokens/s (real tokens), token efficiency
(real / computed token slots) and io-wait (seconds per step spent waiting for a batch).

Sections: setup → per optimizer step (accumulate micro-batches, clip, step, schedule) → log.
Runs without Prefect (`python -m engine ...`, torchrun later); progress goes to `logging`
and to a metrics.jsonl the stage keeps.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from configs.schema import TrainConfig
from engine.optim import build_optimizer, lr_at

log = logging.getLogger("glm_lora.engine")

LossFn = Callable[[torch.nn.Module, dict], tuple[torch.Tensor, dict]]


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class Runtime:
    device: torch.device
    dtype: torch.dtype          # autocast dtype; float32 = no autocast

    @classmethod
    def resolve(cls, device: str = "auto", precision: str = "auto") -> "Runtime":
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("config device=cuda but no CUDA device is visible; use device: cpu or auto")
        if precision == "auto":
            precision = "bf16" if device == "cuda" else "fp32"
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        return cls(torch.device(device), dtype)

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def train(model: torch.nn.Module, loss_fn: LossFn, batches: Iterator[dict], cfg: TrainConfig, rt: Runtime,
          metrics_path: Path | None = None, on_log: Callable[[dict], None] | None = None) -> dict:
    """Train for cfg.max_steps optimizer steps; return a summary of the last logging window."""
    model.to(rt.device).train()
    opt = build_optimizer(model, cfg.lr, cfg.weight_decay, fused=rt.device.type == "cuda")
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    metrics_file = open(metrics_path, "a", encoding="utf-8") if metrics_path else None
    window: dict[str, float] = {}
    window_tokens = window_capacity = 0
    window_wait, window_start, t0, total_tokens = 0.0, time.perf_counter(), time.perf_counter(), 0
    total_capacity, total_wait = 0, 0.0
    summary: dict = {}
    try:
        for step in range(cfg.max_steps):
            lr = lr_at(step, max_steps=cfg.max_steps, warmup_steps=cfg.warmup_steps, base_lr=cfg.lr,
                       min_lr_ratio=cfg.min_lr_ratio)
            for group in opt.param_groups:
                group["lr"] = lr
            for micro in range(cfg.grad_accum):
                wait_start = time.perf_counter()
                batch = _to_device(next(batches), rt.device)
                window_wait += time.perf_counter() - wait_start
                with rt.autocast():
                    loss, metrics = loss_fn(model, batch)
                if not torch.isfinite(loss):
                    raise NonFiniteLossError(
                        f"loss is {loss.item()} at step {step}, micro-batch {micro}; nothing was saved. "
                        f"Try a lower lr (now {cfg.lr}), grad_clip > 0, or precision fp32/bf16.")
                scaler.scale(loss / cfg.grad_accum).backward()
                for k, v in metrics.items():
                    window[k] = window.get(k, 0.0) + float(v) / cfg.grad_accum
                window_tokens += int(batch["num_tokens"])
                window_capacity += int(batch["capacity"]) if "capacity" in batch else batch["input_ids"].numel()
            scaler.unscale_(opt)
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            window["grad_norm"] = window.get("grad_norm", 0.0) + float(grad_norm)
            window["steps"] = window.get("steps", 0) + 1
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.max_steps:
                elapsed = time.perf_counter() - window_start
                n = window.pop("steps")
                summary = {k: v / n for k, v in window.items()}
                total_tokens += window_tokens
                total_capacity += window_capacity
                total_wait += window_wait
                total_elapsed = time.perf_counter() - t0
                summary.update(step=step + 1, lr=lr, tokens_per_s=window_tokens / max(elapsed, 1e-9),
                               token_efficiency=window_tokens / max(window_capacity, 1),
                               io_wait_s=window_wait / n, tokens=total_tokens, elapsed_s=total_elapsed,
                               stage_tokens_per_s=total_tokens / max(total_elapsed, 1e-9),
                               stage_token_efficiency=total_tokens / max(total_capacity, 1),
                               stage_io_wait_s=total_wait)
                log.info("step %d/%d %s", step + 1, cfg.max_steps,
                         " ".join(f"{k}={v:.4g}" for k, v in summary.items() if k not in ("step",)))
                if metrics_file:
                    metrics_file.write(json.dumps(summary) + "\n")
                    metrics_file.flush()
                if on_log:
                    on_log(summary)
                window, window_tokens, window_capacity, window_wait = {}, 0, 0, 0.0
                window_start = time.perf_counter()
    finally:
        if metrics_file:
            metrics_file.close()
    return summary
