"""Pretrain, base-model import, LoRA SFT and DPO as plain functions `(cfg, inputs..., out_dir) -> metrics`.

Each builds a model and a batch stream, then hands both to the one loop in engine.trainer with
the stage's loss. Prefect tasks, the CLI and tests all call these.
"""
from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

import kernels
from artifacts import read_manifest, sha256_json
from configs.errors import UserError
from configs.schema import Config, LoRAConfig, TrainConfig
from data import formats
from data.formats import DataError
from data.cleaning import CleanReport, check_drop_fraction, clean_conversations, clean_pairs, clean_texts
from data.packing import PackedBatches, padded_batches
from data.prefetch import Prefetcher
from data.holdout import without
from data.prepare import held_out_ids, split_path, split_provenance, split_source, unchanged_rows
from data.sampler import EpochSampler
from data.tokenize import dpo_examples, lm_examples, sft_examples, tokenized
from data.tokenizer import load_tokenizer
from engine.losses import DPOLoss, causal_lm_loss
from engine import evaluate
from engine.checkpoint import CheckpointManager
from engine.trainer import Runtime, to_device, train
from model import Decoder, DecoderConfig, inject_lora, load_lora_state_dict, lora_disabled, lora_state_dict, merge_lora
from model.hf import load_hf, load_native, save_native

log = logging.getLogger("glm_lora.stages")
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter.safetensors", "adapter.json"
METRICS, LOSSES = "metrics.jsonl", "losses.json"   # per-window metrics; the loss of every step


def setup(cfg: Config, seed: int) -> Runtime:
    torch.manual_seed(seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    kernels.use(cfg.kernels, cfg.attention)
    return Runtime.resolve(cfg.device, cfg.precision)


def _decoder_config(cfg: Config, vocab: int) -> DecoderConfig:
    m = cfg.model
    if m.vocab_size is not None and m.vocab_size < vocab:
        raise UserError(f"model.vocab_size {m.vocab_size} is smaller than the tokenizer's {vocab} tokens")
    return DecoderConfig(vocab_size=m.vocab_size or vocab, hidden_size=m.hidden_size, num_layers=m.num_layers,
                         num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, intermediate_size=m.intermediate_size,
                         max_seq_len=m.max_seq_len, rope_theta=m.rope_theta, rms_norm_eps=m.rms_norm_eps,
                         tie_embeddings=m.tie_embeddings, arch=m.arch)


def _check_seq_len(seq_len: int, model: Decoder, key: str) -> None:
    if seq_len > model.config.max_seq_len:
        raise UserError(f"{key}.seq_len {seq_len} exceeds model.max_seq_len {model.config.max_seq_len}")


# ---------------------------------------------------------------- data

def token_store(cfg: Config, kind: str, tc: TrainConfig, tok, tokenizer_dir: Path, data_dir: Path,
                split: str | None = None):
    """Read → clean → tokenise once (cached, memory-mapped) one split of a `kind` (pretrain/sft/dpo)."""
    dc = cfg.data
    split = split or kind
    path, sha = split_source(data_dir, split)
    report = CleanReport(max_examples=dc.report_examples)
    read = {"pretrain": formats.read_pretrain, "sft": formats.read_sft, "dpo": formats.read_dpo}[kind]
    # Read lazily (only on a cache miss), checked against the hash the cache key is made of; rows the
    # data stage held out of this file for evaluation are skipped.
    held = held_out_ids(data_dir, split)
    rows = without(unchanged_rows(read(path, on_bad_row=dc.on_bad_row, report=report,
                                       max_line_bytes=dc.max_line_bytes), path, sha, split), held)
    if kind == "pretrain":
        examples = lm_examples(clean_texts(rows, dedup=dc.dedup, report=report), tok, seq_len=tc.seq_len,
                               min_tokens=dc.min_tokens, report=report)
    elif kind == "sft":
        examples = sft_examples(clean_conversations(rows, dedup=dc.dedup, report=report), tok, seq_len=tc.seq_len,
                                overlong=dc.overlong, min_tokens=dc.min_tokens, report=report)
    else:
        examples = dpo_examples(clean_pairs(rows, dedup=dc.dedup, report=report), tok, seq_len=tc.seq_len,
                                overlong=dc.overlong, report=report)
    settings = {"seq_len": tc.seq_len, "min_tokens": dc.min_tokens, "overlong": dc.overlong, "dedup": dc.dedup,
                "on_bad_row": dc.on_bad_row, "max_line_bytes": dc.max_line_bytes, "held_out": sha256_json(held)}
    store = tokenized(kind, sha, tokenizer_dir, examples, cache_root=cfg.runs_dir.resolve() / ".cache" / "tokens",
                      settings=settings, report=report)
    check_drop_fraction(store.meta.get("clean") or {}, split, dc.max_drop_fraction,
                        seq_len=f"{kind}.seq_len ({tc.seq_len})")
    if len(store) < store.meta["group_size"]:
        raise DataError(f"data.{split}: no examples left after cleaning ({store.meta.get('clean')}); "
                        f"check {kind}.seq_len ({tc.seq_len}) and data.min_tokens / data.overlong")
    return store


def token_stream(cfg: Config, kind: str, tc: TrainConfig, tok, tokenizer_dir: Path, data_dir: Path,
                 rt: Runtime) -> tuple[Callable[[dict | None], Prefetcher], dict]:
    """The training split: tokens → sample → pack → prefetch.

    Returns `make_batches(data_state)`: the batch stream, positioned by a checkpoint's data state.
    """
    store = token_store(cfg, kind, tc, tok, tokenizer_dir, data_dir)
    group = store.meta["group_size"]

    def make_batches(data_state: dict | None) -> Prefetcher:
        order = EpochSampler.from_env(len(store) // group, seed=tc.seed)
        if data_state and data_state.get("order"):
            order.load_state_dict(data_state["order"])
        if tc.packing:
            batches = PackedBatches(store, order, rows=tc.batch_size, seq_len=tc.seq_len, group_size=group)
            if data_state and data_state.get("packer"):
                batches.load_state_dict(data_state["packer"])
        else:
            batches = padded_batches(store, order, batch_size=tc.batch_size, group_size=group)
        return Prefetcher(batches, depth=tc.prefetch, device=rt.device)

    clean = store.meta.get("clean", {})
    log.info("%s: %d examples, %d tokens (%s); clean: %s", kind, len(store) // group, int(store.lengths().sum()),
             "packed" if tc.packing else "padded", clean)
    return make_batches, {"examples": len(store) // group, "clean": clean}


def validation_loss(cfg: Config, kind: str, tc: TrainConfig, loss_fn, model, tok, tokenizer_dir: Path,
                    data_dir: Path, rt: Runtime) -> Callable[[], float]:
    """`validate()`: the stage's own loss over its held-out split (one packed pass), weighted by
    target tokens (LM losses) or by pairs (DPO)."""
    store = token_store(cfg, kind, tc, tok, tokenizer_dir, data_dir, split=f"{kind}_eval")
    group = store.meta["group_size"]
    groups = min(len(store) // group, cfg.eval.max_rows)

    @torch.no_grad()
    def validate() -> float:
        model.eval()
        total, weight = torch.zeros((), device=rt.device), torch.zeros((), device=rt.device)
        batches = PackedBatches(store, iter(range(groups)), rows=tc.batch_size, seq_len=tc.seq_len, group_size=group)
        for batch in batches:
            batch = to_device(batch, rt.device)
            with rt.autocast():
                loss, m = loss_fn(model, batch)
            w = m["target_tokens"] if "target_tokens" in m else batch["group_docs"].shape[0]
            total += loss.float() * w
            weight += w
        return float(total / weight.clamp(min=1))
    return validate


# ---------------------------------------------------------------- training with checkpoints

def checkpoint_dir(cfg: Config, stage: str, tc: TrainConfig, input_digests: list[str]) -> Path:
    """Checkpoints of one stage configuration: a retry or a re-run after a crash finds them; any
    change other than max_steps/log_every (or of an upstream artifact) starts a fresh directory."""
    section = tc.model_dump(mode="json", exclude={"max_steps", "log_every"})
    key = sha256_json({"stage": stage, "section": section, "model": cfg.model.model_dump(mode="json"),
                       "device": cfg.device, "precision": cfg.precision, "kernels": cfg.kernels, "attention": cfg.attention,
                       "inputs": input_digests})
    return cfg.run_dir / "checkpoints" / f"{stage}-{key[:12]}"


def _train(stage: str, cfg: Config, tc: TrainConfig, model, loss_fn, tok, tokenizer_dir: Path, data_dir: Path,
           inputs: list[Path], rt: Runtime, out_dir: Path) -> dict:
    make_batches, data = token_stream(cfg, stage, tc, tok, tokenizer_dir, data_dir, rt)
    model.gradient_checkpointing = tc.activation_checkpointing
    ck = cfg.checkpoint
    digests = [read_manifest(p)["digest"] for p in inputs]
    root = checkpoint_dir(cfg, stage, tc, digests)
    manager = CheckpointManager(root, keep_last=ck.keep_last, async_save=ck.async_save)
    # Resuming across these would silently train something else: refuse, naming the key.
    run_config = {"model": _decoder_config(cfg, len(tok)).to_dict() if stage == "pretrain" else None,
                  "lora": tc.lora.model_dump(mode="json") if hasattr(tc, "lora") else None,
                  "inputs": digests, "seq_len": tc.seq_len,
                  "batch_size": tc.batch_size, "packing": tc.packing}
    validate = (validation_loss(cfg, stage, tc, loss_fn, model, tok, tokenizer_dir, data_dir, rt)
                if tc.eval_every else None)
    try:
        summary = train(model, loss_fn, make_batches, tc, rt, name=stage, metrics_path=Path(out_dir) / METRICS,
                        checkpoints=manager, ckpt_cfg=ck, run_config=run_config,
                        structural_keys=["model", "lora", "inputs", "seq_len", "batch_size", "packing"],
                        validate=validate)
    finally:
        manager.close()
    (Path(out_dir) / LOSSES).write_text(json.dumps(summary.pop("losses")))
    saves = manager.stats
    if saves:
        summary["checkpoint_saves"] = len(saves)
        summary["checkpoint_max_stall_s"] = max(x["stall_s"] for x in saves)
    return {**summary, **data, "checkpoints": str(root)}


# ---------------------------------------------------------------- adapters on disk

def save_adapter(model: torch.nn.Module, lora: LoRAConfig, out_dir: Path) -> None:
    save_file(lora_state_dict(model, lora.modules_to_save), Path(out_dir) / ADAPTER_WEIGHTS)
    (Path(out_dir) / ADAPTER_CONFIG).write_text(json.dumps(lora.model_dump(), indent=2))


def apply_adapter(model: Decoder, adapter_dir: Path, merge: bool = True) -> Decoder:
    lora = LoRAConfig.model_validate_json((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    inject_lora(model, lora.target_modules, lora.r, lora.alpha, modules_to_save=lora.modules_to_save)
    load_lora_state_dict(model, load_file(Path(adapter_dir) / ADAPTER_WEIGHTS), lora.modules_to_save)
    return merge_lora(model) if merge else model


def load_policy(base_dir: Path, *adapter_dirs: Path) -> Decoder:
    """Base weights with each adapter merged in order (e.g. pretrain → +SFT → +DPO)."""
    model = load_native(base_dir)
    for a in adapter_dirs:
        apply_adapter(model, a, merge=True)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


# ---------------------------------------------------------------- held-out evaluation

def eval_lm(cfg: Config, model, tok, data_dir: Path) -> dict:
    """Held-out LM metrics on pretrain_eval, read like training data (data.on_bad_row, data.max_line_bytes):
    with on_bad_row=skip a bad row is counted in `bad_rows_pretrain_eval` instead of failing the stage."""
    dc, report = cfg.data, CleanReport(max_examples=cfg.data.report_examples)
    rows = formats.read_pretrain(split_path(data_dir, "pretrain_eval"), on_bad_row=dc.on_bad_row, report=report,
                                 max_line_bytes=dc.max_line_bytes)
    texts = list(itertools.islice(rows, cfg.eval.max_rows))
    metrics = evaluate.lm_metrics(model, tok, texts, seq_len=cfg.pretrain.seq_len)
    if report.dropped.get("bad_row"):
        log.warning("pretrain_eval: skipped %d bad rows, e.g. %s", report.dropped["bad_row"],
                    report.examples.get("bad_row", []))
    return {**metrics, "bad_rows_pretrain_eval": report.dropped.get("bad_row", 0),
            "data": {"pretrain_eval": split_provenance(data_dir, "pretrain_eval", len(texts))}}


def eval_tasks(cfg: Config, model, tok, data_dir: Path) -> dict:
    """Exact match on sft_eval; bad rows as in eval_lm (counted in `bad_rows_sft_eval`)."""
    dc, report = cfg.data, CleanReport(max_examples=cfg.data.report_examples)
    rows = evaluate.read_task_rows(split_path(data_dir, "sft_eval"), limit=cfg.eval.max_rows,
                                   on_bad_row=dc.on_bad_row, report=report, max_line_bytes=dc.max_line_bytes)
    if report.dropped.get("bad_row"):
        log.warning("sft_eval: skipped %d bad rows, e.g. %s", report.dropped["bad_row"],
                    report.examples.get("bad_row", []))
    metrics = evaluate.task_metrics(model, tok, rows, max_new_tokens=cfg.eval.max_new_tokens)
    answers = evaluate.answer_metrics(model, tok, rows, seq_len=cfg.sft.seq_len)
    return {**metrics, **answers, "bad_rows_sft_eval": report.dropped.get("bad_row", 0),
            "data": {"sft_eval": split_provenance(data_dir, "sft_eval", len(rows))}}


def eval_preferences(cfg: Config, model, tok, data_dir: Path) -> dict:
    """DPO metrics on dpo_eval (+ exact match on sft_eval); bad rows as in eval_lm (`bad_rows_dpo_eval`)."""
    dc, report = cfg.data, CleanReport(max_examples=cfg.data.report_examples)
    rows = formats.read_dpo(split_path(data_dir, "dpo_eval"), on_bad_row=dc.on_bad_row, report=report,
                            max_line_bytes=dc.max_line_bytes)
    pairs = list(itertools.islice(rows, cfg.eval.max_rows))
    if report.dropped.get("bad_row"):
        log.warning("dpo_eval: skipped %d bad rows, e.g. %s", report.dropped["bad_row"],
                    report.examples.get("bad_row", []))
    prefs = evaluate.preference_metrics(model, tok, pairs, seq_len=cfg.dpo.seq_len, beta=cfg.dpo.beta)
    tasks = eval_tasks(cfg, model, tok, data_dir)
    rejected = evaluate.rejected_match_rate(model, tok, pairs, max_new_tokens=cfg.eval.max_new_tokens)
    with lora_disabled(model):      # the SFT model, for "DPO must lower the rejected-answer rate"
        sft_rejected = evaluate.rejected_match_rate(model, tok, pairs, max_new_tokens=cfg.eval.max_new_tokens)
    kept = ("exact_match", "min_family", "per_family", "chrf", "answer_loss", "answer_perplexity", "samples",
            "bad_rows_sft_eval")
    return {**prefs, **{k: tasks[k] for k in kept}, "rejected_match_rate": rejected,
            "sft_rejected_match_rate": sft_rejected, "bad_rows_dpo_eval": report.dropped.get("bad_row", 0),
            "data": {"dpo_eval": split_provenance(data_dir, "dpo_eval", len(pairs)), **tasks["data"]}}


# ---------------------------------------------------------------- stages

def pretrain(cfg: Config, tokenizer_dir: Path, data_dir: Path, out_dir: Path) -> dict:
    rt = setup(cfg, cfg.pretrain.seed)
    tok = load_tokenizer(tokenizer_dir)
    model = Decoder(_decoder_config(cfg, len(tok)))
    tc = cfg.pretrain
    _check_seq_len(tc.seq_len, model, "pretrain")
    log.info("pretrain: %.2fM parameters", model.num_params() / 1e6)
    init = eval_lm(cfg, model, tok, data_dir) if cfg.eval.enabled else None
    metrics = _train("pretrain", cfg, tc, model, causal_lm_loss, tok, tokenizer_dir, data_dir,
                     [tokenizer_dir, data_dir], rt, out_dir)
    if cfg.eval.enabled:
        metrics["eval"] = {**eval_lm(cfg, model, tok, data_dir), "init_perplexity": init["perplexity"],
                           "init_bits_per_byte": init["bits_per_byte"]}
        log.info("pretrain eval: %s", metrics["eval"])
    save_native(model.cpu(), out_dir)
    return {**metrics, "params": model.num_params()}


def import_base(cfg: Config, out_dir: Path) -> dict:
    """A local HF model of a supported layout (Llama, Qwen2/3, GLM, GLM-4-0414: model/hf.py) becomes the
    stage-2 starting point instead of pretraining."""
    model = load_hf(cfg.base_model)
    save_native(model, out_dir)
    return {"source": str(cfg.base_model), "params": model.num_params()}


def sft(cfg: Config, base_dir: Path, tokenizer_dir: Path, data_dir: Path, out_dir: Path) -> dict:
    rt = setup(cfg, cfg.sft.seed)
    tok = load_tokenizer(tokenizer_dir)
    tc = cfg.sft
    model = load_native(base_dir)
    _check_seq_len(tc.seq_len, model, "sft")
    inject_lora(model, tc.lora.target_modules, tc.lora.r, tc.lora.alpha, tc.lora.dropout, tc.lora.modules_to_save)
    log.info("sft: %.3fM trainable of %.2fM", model.num_params(True) / 1e6, model.num_params() / 1e6)
    metrics = _train("sft", cfg, tc, model, causal_lm_loss, tok, tokenizer_dir, data_dir,
                     [base_dir, tokenizer_dir, data_dir], rt, out_dir)
    if cfg.eval.enabled:
        metrics["eval"] = eval_tasks(cfg, model, tok, data_dir)
        log.info("sft eval: exact match %.3f %s", metrics["eval"]["exact_match"], metrics["eval"]["per_family"])
    save_adapter(model.cpu(), tc.lora, out_dir)
    return {**metrics, "trainable_params": model.num_params(True)}


def dpo(cfg: Config, base_dir: Path, sft_dir: Path, tokenizer_dir: Path, data_dir: Path, out_dir: Path) -> dict:
    """A fresh LoRA on top of the SFT-merged weights; the reference is the same weights, adapter off."""
    rt = setup(cfg, cfg.dpo.seed)
    tok = load_tokenizer(tokenizer_dir)
    tc = cfg.dpo
    model = load_policy(base_dir, sft_dir)
    _check_seq_len(tc.seq_len, model, "dpo")
    inject_lora(model, tc.lora.target_modules, tc.lora.r, tc.lora.alpha, tc.lora.dropout, tc.lora.modules_to_save)
    log.info("dpo: beta %.3g, nll_weight %.3g", tc.beta, tc.nll_weight)
    metrics = _train("dpo", cfg, tc, model, DPOLoss(tc.beta, tc.nll_weight), tok, tokenizer_dir, data_dir,
                     [base_dir, sft_dir, tokenizer_dir, data_dir], rt, out_dir)
    if cfg.eval.enabled:
        metrics["eval"] = eval_preferences(cfg, model, tok, data_dir)
        log.info("dpo eval: %s", {k: v for k, v in metrics["eval"].items() if k not in ("samples", "per_family")})
    save_adapter(model.cpu(), tc.lora, out_dir)
    return {**metrics, "trainable_params": model.num_params(True)}
