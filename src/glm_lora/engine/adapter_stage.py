"""The one LoRA adapter stage: SFT, DPO and every later adapter-training loss run through `train_adapter`.

A stage names its loss, how its starting model is loaded and how the trained model is evaluated; this
function does the rest the same way for all of them: seed, data, LoRA injection (the stage's `lora`
section), router health on a mixture-of-experts model (engine/router_stats.py), the training loop with
checkpoints (engine/fit.py), consolidation under torchrun, held-out evaluation on rank 0 and the adapter
files (model/adapters.py).
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable

import torch

from glm_lora.configs.schema import Config
from glm_lora.data.pipeline import StageData
from glm_lora.engine import dist
from glm_lora.engine.fit import check_seq_len, consolidated, fit, setup
from glm_lora.engine.router_stats import RouterHealth
from glm_lora.model import Decoder, inject_lora
from glm_lora.model.lora import cast_frozen_gemm_weights
from glm_lora.model.adapters import save_adapter

log = logging.getLogger("glm_lora.adapter")

LoadModel = Callable[[dict[str, Path]], Decoder]                  # the stage's inputs → its starting model
Evaluate = Callable[[Config, Decoder, object, Path], dict]        # (cfg, trained model, tokenizer, data dir)
Batches = Callable[[StageData, Decoder, object], object]          # (data, model, runtime) → fit's data source


def train_adapter(cfg: Config, inputs: dict[str, Path], out_dir: Path, *, stage: str, load_model: LoadModel,
                  loss: Callable, evaluate: Evaluate, batches: Batches | None = None) -> dict:
    """Train a fresh LoRA adapter (config section `cfg.<stage>`) on the model `load_model(inputs)` gives,
    with `loss(model, batch) -> (loss, metrics)`; save it to `out_dir` and return the stage's metrics
    (`evaluate`'s under "eval" when eval.enabled). Batches come from the stage's token store, or from
    `batches(data, model, rt)` (the RL stage's rollouts of the model being trained). Under torchrun only rank 0
    evaluates and saves."""
    tc = getattr(cfg, stage)
    rt = setup(cfg, tc.seed)            # seeds before the model is built: the adapter's init is reproducible
    data = StageData(cfg, inputs["tokenizer"], inputs["data"], rt.device)
    model = load_model(inputs)
    check_seq_len(tc.seq_len, model, stage)
    inject_lora(model, tc.lora)
    low_precision = _frozen_gemm_weights_in_compute_dtype(model, cfg, stage, rt)
    log.info("%s: %.3fM trainable of %.2fM", stage, model.num_params(True) / 1e6, model.num_params() / 1e6)
    health = RouterHealth(model, tc.router_aux_loss, stage)         # mixture of experts: routing per step
    source = batches(data, model, rt) if batches else data
    metrics = fit(stage, cfg, tc, model, health.wrap(loss) if health else loss, source, list(inputs.values()), rt,
                  out_dir, window_metrics=health.end_window if health else None)
    if health:
        metrics["router"] = health.summary()
    if model.attention_paths:   # DSA: forwards on the dense path (no document past index_topk) and on the sparse one
        metrics["attention_paths"] = dict(model.attention_paths)
    model = consolidated(model, rt, lambda: _with_lora(Decoder(model.config), tc.lora))   # None off rank 0
    if model is None:
        return metrics
    if cfg.eval.enabled:
        with rt.autocast() if low_precision else contextlib.nullcontext():
            metrics["eval"] = evaluate(cfg, model, data.tok, data.data_dir)
        log.info("%s eval: %s", stage, {k: v for k, v in metrics["eval"].items() if k not in ("samples",)})
    save_adapter(model.cpu(), tc.lora, out_dir)
    return {**metrics, "trainable_params": model.num_params(True)}


def _frozen_gemm_weights_in_compute_dtype(model: Decoder, cfg: Config, stage: str, rt) -> bool:
    """On CUDA under bf16/fp16 autocast, the base's frozen GEMM weights (linear layers, routed experts) are kept
    in the compute dtype, as a user loads such a model: every matmul already ran in that dtype under autocast, so
    training is unchanged, but autocast no longer re-casts each frozen fp32 weight at every use (it caches casts of
    trainable weights only), and the base takes half the memory (bench/RESULTS.md, "bf16 frozen base"). The
    adapter, modules_to_save, norms and embeddings stay fp32. Not under FSDP2, whose mixed-precision policy casts
    per all-gather. Returns whether it did (evaluation then runs under autocast too)."""
    if not frozen_weights_in_compute_dtype(rt.device, rt.dtype, fsdp2=bool(rt.dist)
                                           and dist.strategy_for(cfg, stage) == "fsdp2"):
        return False
    cast_frozen_gemm_weights(model, rt.dtype)
    return True


def frozen_weights_in_compute_dtype(device: torch.device, dtype: torch.dtype, fsdp2: bool = False) -> bool:
    """Whether a LoRA stage holds its frozen GEMM weights in `dtype` (the one place that decides it)."""
    return device.type == "cuda" and dtype != torch.float32 and not fsdp2


def _with_lora(model: torch.nn.Module, lora) -> torch.nn.Module:
    inject_lora(model, lora)
    return model
