"""The one training loop shared by pretrain, SFT and DPO; only the loss function differs.

`train()` only loops: resume (`Checkpointer.restore`) → per step: data + step (`train_step`:
accumulate micro-batches, clip, step, schedule) → log → validate → checkpoint. The loop state is
a `TrainState`; everything on disk (resume, saves, best weights, RNG, verification) is the
Checkpointer's (engine/checkpoint.py).

Logged per window: loss and the loss's own metrics, tokens/s (real tokens), token efficiency
(real / computed token slots) and io-wait (seconds per step spent waiting for a batch).
Checkpoints carry the trainable weights, optimizer state, RNG states and the data position of
the last batch trained on, so a resumed run continues bit-identically (fp32, deterministic ops).
Runs without Prefect; progress goes to `logging` and to `on_log` (the stage keeps a metrics.jsonl).

With several processes (`Runtime.dist`, engine/dist.py) every rank runs this same loop on its own
share of the data; the loss and metrics of each micro-batch are averaged over ranks (so every rank
takes the same decisions: non-finite loss, stop signal, validation), tokens are summed, and only
rank 0 logs (`tokens_per_s` is then the total, `tokens_per_s_per_gpu` that over world_size).
"""
from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import TrainConfig
from glm_lora.data.packing import to_device
from glm_lora.engine.checkpoint import Checkpointer, TrainState
from glm_lora.engine.dist import injected_failure
from glm_lora.engine.optim import build_optimizer, lr_at

log = logging.getLogger("glm_lora.engine")

LossFn = Callable[[torch.nn.Module, dict], tuple[torch.Tensor, dict]]


class NonFiniteLossError(UserError, RuntimeError):
    """The loss went NaN/inf: the same data and settings would do it again, so no retry."""


class Preempted(RuntimeError):
    """SIGTERM/SIGINT arrived: a checkpoint was saved at a step boundary; re-run to resume."""


@dataclass
class Runtime:
    device: torch.device
    dtype: torch.dtype          # autocast dtype; float32 = no autocast
    dist: Any = None            # engine.dist.Dist under torchrun; None = one process

    @property
    def main(self) -> bool:
        """The process that logs and writes files (rank 0, or the only one)."""
        return self.dist is None or self.dist.main

    @classmethod
    def resolve(cls, device: str = "auto", precision: str = "auto") -> "Runtime":
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise UserError("config device=cuda but no CUDA device is visible; use device: cpu or auto")
        if precision == "auto":
            precision = "bf16" if device == "cuda" or cpu_has_native_bf16() else "fp32"
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        return cls(torch.device(device), dtype)

    @property
    def weights_in_compute_dtype(self) -> bool:
        """Whether the weights the matmuls read are held in the compute dtype (the one place that decides it): on
        CUDA under bf16/fp16, a LoRA stage's frozen GEMM weights (engine/adapter_stage.py), sharded so under FSDP2
        too, whose all-gathers then run in that dtype (engine/dist.py). Elsewhere fp32 weights, cast per matmul by
        autocast."""
        return self.device.type == "cuda" and self.dtype != torch.float32

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively: AMX tiles (Sapphire Rapids and later) or AVX512-BF16
    dot products (AMD Zen 4 and later, Cooper Lake). There bf16 autocast makes the tiny default's training step
    1.3x (AMX) to 1.8x (Zen 4) faster than fp32 (bench/RESULTS.md, "Two cores: bf16"); elsewhere bf16 matmuls
    are emulated and fp32 is kept."""
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        try:
            if getattr(torch.cpu, probe)():
                return True
        except (AttributeError, RuntimeError):      # a torch without the probe
            continue
    return False


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
    """One optimizer step over cfg.grad_accum micro-batches; None if it was skipped (non-finite loss).

    Under torchrun the numbers of each micro-batch are averaged over ranks before anything is decided
    (tokens and slots summed), and a DDP loss (`no_sync`) all-reduces gradients on the last micro-batch only.
    """
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
        n_tokens = int(batch["num_tokens"])
        n_slots = int(batch["capacity"]) if "capacity" in batch else batch["input_ids"].numel()
        last = micro == cfg.grad_accum - 1
        with (loss_fn.no_sync() if not last and hasattr(loss_fn, "no_sync") else contextlib.nullcontext()):
            with rt.autocast():
                loss, m = loss_fn(model, batch)
            # One device→host copy per micro-batch for the loss and every metric (not one per value).
            values = torch.stack([loss.detach().float(), *(torch.as_tensor(v, device=loss.device).float()
                                                            for v in m.values())]).tolist()
            if rt.dist is not None:     # one all-reduce: the rank mean of every value, the sum of tokens
                sums = rt.dist.sum([*values, n_tokens, n_slots])
                values = [v / rt.dist.world_size for v in sums[:-2]]
                n_tokens, n_slots = int(sums[-2]), int(sums[-1])
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
        tokens += n_tokens
        capacity += n_slots
    scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    if hasattr(grad_norm, "full_tensor"):      # FSDP2: a DTensor (the norm over every rank's shard)
        grad_norm = grad_norm.full_tensor()
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
    world_size: int | None = None    # several processes: tokens are everyone's, also report per GPU

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
        if self.world_size:
            out.update(tokens_per_s_per_gpu=out["tokens_per_s"] / self.world_size, world_size=self.world_size)
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


def _out_of_memory(name: str, step: int, cfg: TrainConfig) -> RuntimeError:
    return RuntimeError(
        f"{name}: out of memory at step {step}. Lower {name}.batch_size (now {cfg.batch_size}) "
        f"or {name}.seq_len ({cfg.seq_len}) and raise {name}.grad_accum ({cfg.grad_accum}) to keep "
        f"the tokens per step; or use precision bf16.")


def train(model: torch.nn.Module, loss_fn: LossFn, make_batches: Callable[[dict | None], Iterator[dict]],
          cfg: TrainConfig, rt: Runtime, *, checkpointer: Checkpointer | None = None,
          validate: Callable[[], float] | None = None, on_log: Callable[[dict], None] | None = None) -> dict:
    """Train until cfg.max_steps optimizer steps (or early stopping); return the last logging window's summary.

    `make_batches(data_state)` builds the batch stream, positioned by `data_state` on resume. `validate()`
    returns the held-out loss: with cfg.eval_every it runs every that many steps and the best weights, not
    the last, are left in the model. `checkpointer` (default: none on disk) is closed when the loop ends.
    """
    ckpt = checkpointer or Checkpointer()
    d = rt.dist
    if d is None:
        model.to(rt.device)
    model.train()       # (under torchrun engine.dist.parallelize has placed it)
    opt = build_optimizer(model, cfg.lr, cfg.weight_decay, fused=rt.device.type in ("cuda", "cpu"),
                          lora_b_lr_ratio=cfg.lora.b_lr_ratio if hasattr(cfg, "lora") else 1.0)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = ckpt.restore(model, opt, cfg.max_steps) or TrainState()
    validating = validate is not None and cfg.eval_every > 0
    batches, window, summary = make_batches(state.data_state), Window(world_size=d and d.world_size), {}
    with ckpt, StopRequest() as stop, (contextlib.closing(batches) if hasattr(batches, "close")
                                       else contextlib.nullcontext()):
        while state.step < cfg.max_steps and not state.stopped_early:
            injected_failure(d.rank if d else 0, state.step)
            # ---- data + step (train_step draws cfg.grad_accum micro-batches)
            try:
                result = train_step(model, loss_fn, batches, opt, scaler, trainable, cfg, rt, state.step)
            except torch.OutOfMemoryError as e:
                raise _out_of_memory(ckpt.name, state.step, cfg) from e
            if result is None:
                state.skipped += 1
                if state.skipped > 100:
                    raise NonFiniteLossError(f"{ckpt.name}: more than 100 batches skipped for non-finite loss")
                continue
            step = state.advance(result.loss, result.num_tokens, result.data_state)
            window.add(result)
            # ---- log
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                summary = {**window.summary(step), "skipped_batches": state.skipped}
                if rt.main:
                    log.info("%s step %d/%d %s", ckpt.name, step, cfg.max_steps,
                             " ".join(f"{k}={v:.4g}" for k, v in summary.items() if k != "step" and v is not None))
                    if on_log:
                        on_log(summary)
            # ---- validate (before the checkpoint, so a resume knows the best step)
            if validating and (step % cfg.eval_every == 0 or step == cfg.max_steps):
                val_loss = validate()
                model.train()
                if state.validated(val_loss, cfg.min_delta, cfg.patience):
                    ckpt.save_best(state, model)
                log.info("%s step %d validation loss %.4f (best %.4f at step %d)%s", ckpt.name, step, val_loss,
                         state.best_val_loss, state.best_step, "; stopping early: no improvement in %d validations"
                         % cfg.patience if state.stopped_early else "")
            # ---- checkpoint (a signal seen by any rank stops them all at this same step)
            stopping = stop.requested if d is None else d.any(stop.requested)
            ckpt.maybe_save(state, model, opt, stop=stopping, max_steps=cfg.max_steps)
            if stopping:
                raise Preempted(f"{ckpt.name}: stopped by signal at step {step}; checkpoint saved, re-run to resume")
    if validating:
        ckpt.restore_best(model, state)
        summary.update(val_losses=state.val_losses, best_val_loss=state.best_val_loss,
                       best_step=state.best_step, stopped_early=state.stopped_early, last_step=state.step)
    return {**summary, "losses": state.losses, "skipped_batches": state.skipped}
