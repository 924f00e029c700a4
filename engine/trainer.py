"""The one training loop shared by pretrain, SFT and DPO; only the loss function differs.

Sections, top to bottom: setup → resume (newest verified checkpoint) → per step
(`train_step`: accumulate micro-batches, clip, step, schedule) → log → checkpoint.

Logged per window: loss and the loss's own metrics, tokens/s (real tokens), token efficiency
(real / computed token slots) and io-wait (seconds per step spent waiting for a batch).
Checkpoints carry the trainable weights, optimizer state, RNG states and the data position of
the last batch trained on, so a resumed run continues bit-identically (fp32, deterministic ops).
Runs without Prefect; progress goes to `logging` and to a metrics.jsonl the stage keeps.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from configs.errors import UserError
from configs.schema import CheckpointConfig, TrainConfig
from artifacts import sha256_json, source_hash
from engine.checkpoint import CheckpointManager, capture_rng, config_diff, restore_rng
from engine.optim import build_optimizer, lr_at

log = logging.getLogger("glm_lora.engine")

CODE_VERSION = source_hash(Path(__file__).resolve().parents[1], ("data", "engine", "kernels", "model"))
LossFn = Callable[[torch.nn.Module, dict], tuple[torch.Tensor, dict]]


class NonFiniteLossError(UserError, RuntimeError):
    """The loss went NaN/inf: the same data and settings would do it again, so no retry."""


class IncompatibleResumeError(UserError, RuntimeError):
    pass


class Preempted(RuntimeError):
    """SIGTERM/SIGINT arrived: a checkpoint was saved at a step boundary; re-run to resume."""


@dataclass
class Runtime:
    device: torch.device
    dtype: torch.dtype          # autocast dtype; float32 = no autocast

    @classmethod
    def resolve(cls, device: str = "auto", precision: str = "auto") -> "Runtime":
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise UserError("config device=cuda but no CUDA device is visible; use device: cpu or auto")
        if precision == "auto":
            precision = "bf16" if device == "cuda" else "fp32"
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        return cls(torch.device(device), dtype)

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@dataclass
class StepResult:
    loss: float
    metrics: dict[str, float]
    grad_norm: float
    num_tokens: int
    capacity: int
    wait_s: float
    data_state: dict | None


def train_step(model, loss_fn: LossFn, batches: Iterator[dict], opt, scaler, trainable, cfg: TrainConfig,
               rt: Runtime, step: int) -> StepResult | None:
    """One optimizer step over cfg.grad_accum micro-batches; None if it was skipped (non-finite loss)."""
    lr = lr_at(step, max_steps=cfg.max_steps, warmup_steps=cfg.warmup_steps, base_lr=cfg.lr,
               min_lr_ratio=cfg.min_lr_ratio)
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    total, metrics, tokens, capacity, wait, data_state = 0.0, {}, 0, 0, 0.0, None
    for micro in range(cfg.grad_accum):
        t = time.perf_counter()
        batch = to_device(next(batches), rt.device)
        wait += time.perf_counter() - t
        data_state = batch.get("data_state")
        with rt.autocast():
            loss, m = loss_fn(model, batch)
        # One device→host copy per micro-batch for the loss and every metric (not one per value).
        values = torch.stack([loss.detach().float(), *(torch.as_tensor(v, device=loss.device).float()
                                                        for v in m.values())]).tolist()
        value = values[0]
        if not math.isfinite(value):
            opt.zero_grad(set_to_none=True)
            if cfg.nonfinite == "skip":
                log.warning("loss is %s at step %d, micro-batch %d: batch skipped", value, step, micro)
                return None
            raise NonFiniteLossError(
                f"loss is {value} at step {step}, micro-batch {micro}; nothing was saved for this step. "
                f"Try a lower lr (now {cfg.lr}), grad_clip > 0, precision fp32/bf16, or nonfinite: skip.")
        scaler.scale(loss / cfg.grad_accum).backward()
        total += value / cfg.grad_accum
        for k, v in zip(m, values[1:]):
            metrics[k] = metrics.get(k, 0.0) + v / cfg.grad_accum
        tokens += int(batch["num_tokens"])
        capacity += int(batch["capacity"]) if "capacity" in batch else batch["input_ids"].numel()
    scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    metrics["lr"] = lr
    return StepResult(total, metrics, float(grad_norm), tokens, capacity, wait, data_state)


@dataclass
class Window:
    """Running sums between two log lines, plus stage totals."""

    t0: float = field(default_factory=time.perf_counter)
    start: float = field(default_factory=time.perf_counter)
    sums: dict = field(default_factory=dict)
    steps: int = 0
    tokens: int = 0
    capacity: int = 0
    wait: float = 0.0
    total_tokens: int = 0
    total_capacity: int = 0
    total_wait: float = 0.0

    def add(self, r: StepResult) -> None:
        for k, v in {**r.metrics, "grad_norm": r.grad_norm}.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.steps += 1
        self.tokens, self.capacity, self.wait = self.tokens + r.num_tokens, self.capacity + r.capacity, self.wait + r.wait_s

    def summary(self, step: int) -> dict:
        now = time.perf_counter()
        self.total_tokens += self.tokens
        self.total_capacity += self.capacity
        self.total_wait += self.wait
        out = {k: v / self.steps for k, v in self.sums.items()}
        out.update(step=step, tokens_per_s=self.tokens / max(now - self.start, 1e-9),
                   token_efficiency=self.tokens / max(self.capacity, 1), io_wait_s=self.wait / self.steps,
                   tokens=self.total_tokens, elapsed_s=now - self.t0,
                   stage_tokens_per_s=self.total_tokens / max(now - self.t0, 1e-9),
                   stage_token_efficiency=self.total_tokens / max(self.total_capacity, 1),
                   stage_io_wait_s=self.total_wait)
        self.sums, self.steps, self.tokens, self.capacity, self.wait, self.start = {}, 0, 0, 0, 0.0, now
        return out


class StopRequest:
    """Turns SIGTERM/SIGINT into a flag the loop checks at step boundaries (main thread only)."""

    def __init__(self):
        self.requested, self._old = False, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        log.warning("received signal %d: saving a checkpoint at the end of this step", signum)
        self.requested = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


class EarlyStopping:
    """Tracks the validation loss: keeps the best trainable weights and says when patience ran out."""

    def __init__(self, cfg: TrainConfig, trainable: dict[str, torch.nn.Parameter],
                 checkpoints: CheckpointManager | None):
        self.cfg, self.trainable, self.checkpoints = cfg, trainable, checkpoints
        self.best: dict[str, torch.Tensor] | None = None

    def update(self, state: dict, val_loss: float) -> bool:
        """Record a validation at state["step"]; True when the stage should stop now."""
        state["val_losses"].append([state["step"], val_loss])
        best = state["best_val_loss"]
        if best is None or val_loss < best - self.cfg.min_delta:
            state.update(best_val_loss=val_loss, best_step=state["step"], bad_evals=0)
            self.best = {n: p.detach().to("cpu", copy=True) for n, p in self.trainable.items()}
            if self.checkpoints is not None:
                self.checkpoints.save_best(self.best, step=state["step"], val_loss=val_loss)
            return False
        state["bad_evals"] += 1
        return bool(self.cfg.patience) and state["bad_evals"] >= self.cfg.patience

    def resume(self, state: dict) -> None:
        if state.get("best_step") is not None and self.checkpoints is not None:
            self.best = self.checkpoints.load_best(state["best_step"])

    def restore_best(self, state: dict, name: str) -> None:
        """Put the best weights back if the last step is not the best one."""
        if state["best_step"] is None or state["best_step"] == state["step"]:
            return
        if self.best is None:
            log.warning("%s: best weights of step %s are not available; keeping the last step's", name,
                        state["best_step"])
            return
        with torch.no_grad():
            for n, p in self.trainable.items():
                p.copy_(self.best[n])
        log.info("%s: carrying forward the weights of step %d (validation loss %.4f), not step %d's", name,
                 state["best_step"], state["best_val_loss"], state["step"])


def _restore(model, opt, ckpt, run_config: dict, structural_keys: Sequence[str], name: str) -> dict:
    c = ckpt.latest()
    if c is None:
        if ckpt.best_step() is not None:
            log.warning("%s: discarding the best weights of step %s under %s: there is no checkpoint to resume "
                        "from, so the stage starts over", name, ckpt.best_step(), ckpt.root)
        return {}
    diff = config_diff(c.trainer_state.get("config", {}), run_config, list(structural_keys))
    if diff:
        raise IncompatibleResumeError(
            f"{name}: the checkpoint in {c.path} was made with a different {', '.join(diff)}; "
            f"refusing to resume. Delete {c.path.parent} (or use checkpoint.resume: never) to start over.")
    params = dict(model.named_parameters())
    missing = sorted(set(c.weights) ^ {n for n, p in params.items() if p.requires_grad})
    if missing:
        raise IncompatibleResumeError(f"{name}: checkpoint {c.path} weights differ from the model's: {missing[:5]}")
    with torch.no_grad():
        for n, t in c.weights.items():
            params[n].copy_(t)
    if c.optimizer is not None:
        opt.load_state_dict(c.optimizer)
    else:
        log.warning("%s: checkpoint %s has no optimizer state; the optimizer restarts (resume is not exact)", name, c.path)
    restore_rng(c.rng)
    log.info("%s: resumed from step %d (%s)", name, c.step, c.path)
    return c.trainer_state


def train(model: torch.nn.Module, loss_fn: LossFn, make_batches: Callable[[dict | None], Iterator[dict]],
          cfg: TrainConfig, rt: Runtime, *, name: str = "train", metrics_path: Path | None = None,
          on_log: Callable[[dict], None] | None = None, checkpoints: CheckpointManager | None = None,
          ckpt_cfg: CheckpointConfig | None = None, run_config: dict | None = None,
          structural_keys: Sequence[str] = (), validate: Callable[[], float] | None = None) -> dict:
    """Train until cfg.max_steps optimizer steps (or early stopping); return the last logging window's summary.

    `make_batches(data_state)` builds the batch stream, positioned by `data_state` on resume.
    `validate()` returns the held-out loss; with cfg.eval_every it runs every that many steps and
    the best weights, not the last, are left in the model.
    """
    # ---- setup
    model.to(rt.device).train()
    lora = getattr(cfg, "lora", None)
    opt = build_optimizer(model, cfg.lr, cfg.weight_decay, fused=rt.device.type == "cuda",
                          lora_b_lr_ratio=lora.b_lr_ratio if lora is not None else 1.0)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    ckpt_cfg = ckpt_cfg or CheckpointConfig()
    run_config = run_config or {}
    # ---- resume
    state = {"step": 0, "tokens": 0, "losses": [], "skipped": 0, "data_state": None,
             "val_losses": [], "best_val_loss": None, "best_step": None, "bad_evals": 0, "stopped_early": False}
    if checkpoints is not None and ckpt_cfg.resume == "auto":
        state.update(_restore(model, opt, checkpoints, run_config, structural_keys, name))
    validating = validate is not None and cfg.eval_every > 0
    early = EarlyStopping(cfg, {n: p for n, p in model.named_parameters() if p.requires_grad}, checkpoints)
    early.resume(state)
    batches = make_batches(state["data_state"])
    metrics_file = open(metrics_path, "a", encoding="utf-8") if metrics_path else None
    window, summary = Window(), {}
    try:
        with StopRequest() as stop, contextlib.closing(batches) if hasattr(batches, "close") else contextlib.nullcontext():
            while state["step"] < cfg.max_steps and not state["stopped_early"]:
                # ---- step
                try:
                    result = train_step(model, loss_fn, batches, opt, scaler, trainable, cfg, rt, state["step"])
                except torch.OutOfMemoryError as e:
                    raise RuntimeError(
                        f"{name}: out of memory at step {state['step']}. Lower {name}.batch_size (now {cfg.batch_size}) "
                        f"or {name}.seq_len ({cfg.seq_len}) and raise {name}.grad_accum ({cfg.grad_accum}) to keep "
                        f"the tokens per step; or use precision bf16.") from e
                if result is None:
                    state["skipped"] += 1
                    if state["skipped"] > 100:
                        raise NonFiniteLossError(f"{name}: more than 100 batches skipped for non-finite loss")
                    continue
                state["step"] += 1
                state["tokens"] += result.num_tokens
                state["losses"].append(result.loss)
                state["data_state"] = result.data_state
                window.add(result)
                step = state["step"]
                # ---- log
                if step % cfg.log_every == 0 or step == cfg.max_steps:
                    summary = {**window.summary(step), "skipped_batches": state["skipped"]}
                    log.info("%s step %d/%d %s", name, step, cfg.max_steps,
                             " ".join(f"{k}={v:.4g}" for k, v in summary.items() if k != "step" and v is not None))
                    if metrics_file:
                        metrics_file.write(json.dumps(summary) + "\n")
                        metrics_file.flush()
                    if on_log:
                        on_log(summary)
                # ---- validate (before the checkpoint, so a resume knows the best step)
                if validating and (step % cfg.eval_every == 0 or step == cfg.max_steps):
                    val_loss = validate()
                    model.train()
                    state["stopped_early"] = early.update(state, val_loss)
                    log.info("%s step %d validation loss %.4f (best %.4f at step %d)%s", name, step, val_loss,
                             state["best_val_loss"], state["best_step"],
                             "; stopping early: no improvement in %d validations" % cfg.patience
                             if state["stopped_early"] else "")
                # ---- checkpoint
                if checkpoints is not None and (stop.requested or state["stopped_early"]
                                                or (ckpt_cfg.save_every and step % ckpt_cfg.save_every == 0)):
                    with_opt = stop.requested or step % ckpt_cfg.save_optimizer_every == 0
                    stall = checkpoints.save(
                        step, weights={n: p.detach() for n, p in model.named_parameters() if p.requires_grad},
                        optimizer=opt.state_dict() if with_opt else None, rng=capture_rng(),
                        trainer_state={**state, "config": run_config, "config_hash": sha256_json(run_config),
                                       "code_version": CODE_VERSION, "max_steps": cfg.max_steps,
                                       "epoch": ((state["data_state"] or {}).get("order") or {}).get("epoch")})
                    log.info("%s: checkpoint at step %d (stall %.3f s%s)", name, step, stall,
                             ", with optimizer" if with_opt else "")
                if stop.requested:
                    raise Preempted(f"{name}: stopped by signal at step {step}; checkpoint saved, re-run to resume")
    finally:
        if metrics_file:
            metrics_file.close()
        if checkpoints is not None:
            checkpoints.wait()
    if validating:
        early.restore_best(state, name)
        summary.update(val_losses=state["val_losses"], best_val_loss=state["best_val_loss"],
                       best_step=state["best_step"], stopped_early=state["stopped_early"], last_step=state["step"])
    summary["losses"] = state["losses"]
    summary["skipped_batches"] = state["skipped"]
    return summary
