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
from glm_lora.engine.losses import WithMTP
from glm_lora.engine.router_stats import RouterHealth
from glm_lora.evaluation.heldout import eval_mtp
from glm_lora.model import Decoder, DecoderConfig, inject_lora, mtp
from glm_lora.model.hf import Placement
from glm_lora.model.lora import base_placement, cast_frozen_gemm_weights
from glm_lora.model.adapters import save_adapter

log = logging.getLogger("glm_lora.adapter")

# (the stage's inputs, how the stage holds each base weight: `base_placement` for a model config) → its starting model
LoadModel = Callable[[dict[str, Path], Callable[[DecoderConfig], Placement]], Decoder]
Evaluate = Callable[[Config, Decoder, object, Path], dict]        # (cfg, trained model, tokenizer, data dir)
Batches = Callable[[StageData, Decoder, object], object]          # (data, model, runtime) → fit's data source


def train_adapter(cfg: Config, inputs: dict[str, Path], out_dir: Path, *, stage: str, load_model: LoadModel,
                  loss: Callable, evaluate: Evaluate, batches: Batches | None = None) -> dict:
    """Train a fresh LoRA adapter (config section `cfg.<stage>`) on the model `load_model(inputs, place)` gives,
    with `loss(model, batch) -> (loss, metrics)`; save it to `out_dir` and return the stage's metrics
    (`evaluate`'s under "eval" when eval.enabled). Batches come from the stage's token store, or from
    `batches(data, model, rt)` (the RL stage's rollouts of the model being trained). Under torchrun only rank 0
    evaluates and saves. `place(config)` is how the stage will hold each base weight (model/lora.py
    `base_placement`): SFT's loader streams the base onto the device in that form (its routed experts quantised as
    they arrive under nf4); DPO's and RL's (model/adapters.py load_policy) still load it whole in fp32 on the CPU,
    to merge the earlier adapters into."""
    tc = getattr(cfg, stage)
    rt = setup(cfg, tc.seed)            # seeds before the model is built: the adapter's init is reproducible
    data = StageData(cfg, inputs["tokenizer"], inputs["data"], rt.device)
    model = load_model(inputs, lambda base: base_placement(base, tc.lora, _load_device(cfg, stage, rt),
                                                         rt.dtype if rt.weights_in_compute_dtype else None))
    check_seq_len(tc.seq_len, model, stage)
    before = _mtp_before(cfg, stage, model, data, rt)
    loss = _mtp_training(cfg, stage, model, loss)
    inject_lora(model, tc.lora)             # the MTP layer too, where the stage trains it
    low_precision = _frozen_gemm_weights_in_compute_dtype(model, rt)
    log.info("%s: %.3fM trainable of %.2fM", stage, model.num_params(True) / 1e6, model.num_params() / 1e6)
    health = RouterHealth(model, tc.router_aux_loss, stage)         # mixture of experts: routing per step
    source = batches(data, model, rt) if batches else data
    metrics = fit(stage, cfg, tc, model, health.wrap(loss) if health else loss, source, list(inputs.values()), rt,
                  out_dir, window_metrics=health.end_window if health else None)
    if health:
        metrics["router"] = health.summary()
    if model.attention_paths:   # DSA: forwards on the dense path (no document past index_topk) and on the sparse one
        metrics["attention_paths"] = dict(model.attention_paths)
    model = consolidated(model, rt, lambda: _with_lora(mtp.same_architecture(model), tc.lora))   # None off rank 0
    if model is None:
        return metrics
    if cfg.eval.enabled:
        with rt.autocast() if low_precision else contextlib.nullcontext():
            metrics["eval"] = {**evaluate(cfg, model, data.tok, data.data_dir), **before}
        log.info("%s eval: %s", stage, {k: v for k, v in metrics["eval"].items() if k not in ("samples",)})
    save_adapter(model.cpu(), tc.lora, out_dir)
    return {**metrics, "trainable_params": model.num_params(True)}


def _load_device(cfg: Config, stage: str, rt) -> torch.device:
    """Where the base is loaded: the stage's device, but the CPU under FSDP2, whose sharding then moves each rank's
    shard alone to its GPU (no GPU ever holds the whole base)."""
    return torch.device("cpu") if rt.dist and dist.strategy_for(cfg, stage) == "fsdp2" else rt.device


def _frozen_gemm_weights_in_compute_dtype(model: Decoder, rt) -> bool:
    """Where `rt.weights_in_compute_dtype` (CUDA under bf16/fp16 autocast), the base's frozen GEMM weights (linear
    layers, routed experts) are kept in the compute dtype, as a user loads such a model: every matmul already ran in
    that dtype under autocast, so training is unchanged, but autocast no longer re-casts each frozen fp32 weight at
    every use (it caches casts of trainable weights only), and the base takes half the memory (bench/RESULTS.md,
    "bf16 frozen base"). The adapter, modules_to_save, norms and embeddings stay fp32. Under FSDP2 this runs before
    fit() shards the model, so the frozen shards are half the size too: FSDP2 gathers a parameter already in its
    param_dtype as it is and needs one dtype among the trainable ones only (tests/engine/test_dist.py). Returns
    whether it did (evaluation then runs under autocast too). A base loaded as `base_placement` says arrives with
    these weights in that dtype already: only the siblings' shared storage is then made here."""
    if not rt.weights_in_compute_dtype:
        return False
    cast_frozen_gemm_weights(model, rt.dtype)
    return True


BEFORE = {"sft": "base", "dpo": "sft", "rl": "dpo"}      # the model each adapter stage starts from


def _mtp_before(cfg: Config, stage: str, model: Decoder, data: StageData, rt) -> dict:
    """The starting model's MTP draft acceptance on sft_eval (evaluation/heldout.py `eval_mtp`) as
    `mtp_acceptance_<base|sft|dpo>`, measured before the stage trains, on its device, by the process that evaluates
    (not under FSDP2: no process holds the whole model); {} without an MTP layer or evaluation."""
    if not (cfg.eval.enabled and rt.main and mtp.has_mtp(model)):
        return {}
    if rt.dist and dist.strategy_for(cfg, stage) == "fsdp2":
        log.info("%s: the starting model's MTP acceptance is not measured under FSDP2", stage)
        return {}
    model.to(rt.device)
    low_precision = rt.weights_in_compute_dtype
    with rt.autocast() if low_precision else contextlib.nullcontext():
        ev = eval_mtp(cfg, model, data.tok, data.data_dir)
    return {f"mtp_acceptance_{BEFORE[stage]}": ev["mtp_acceptance"]}


def _mtp_training(cfg: Config, stage: str, model: Decoder, loss: Callable) -> Callable:
    """`<stage>.mtp: train`: the MTP layer built into the model (LoRA then reaches it) and its loss added; else the
    stage's loss as it is (the layer stays carried). Refused on a model without one, naming where it came from."""
    tc = getattr(cfg, stage)
    if getattr(tc, "mtp", "carry") != "train":
        return loss
    source = (f"the base model ({cfg.base_model / 'config.json'}, num_nextn_predict_layers)" if cfg.base_model
              else "the pretrained model (model.mtp_layers)")
    mtp.require_mtp(model, f"{stage}.mtp", source)
    mtp.attach(model)
    return WithMTP(loss, tc.mtp_weight, chosen_only=stage != "sft")


def _with_lora(model: torch.nn.Module, lora) -> torch.nn.Module:
    inject_lora(model, lora)
    return model
