"""Pretrain, base-model import, LoRA SFT and DPO as plain functions `(cfg, inputs..., out_dir) -> metrics`.

Each builds a model and a batch stream, then hands both to the one loop in engine.trainer with
the stage's loss. Prefect tasks, the CLI and tests all call these.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import kernels
from configs.schema import Config, LoRAConfig
from data import formats
from data.batching import pad_batch, pad_pairs, pretrain_blocks, shuffled_batches, truncate
from data.prepare import split_path
from data.tokenizer import load_tokenizer, tokenize_chat
from engine.losses import DPOLoss, causal_lm_loss
from engine.trainer import Runtime, train
from model import Decoder, DecoderConfig, inject_lora, load_lora_state_dict, lora_state_dict, merge_lora
from model.hf import load_hf_llama, load_native, save_native

log = logging.getLogger("glm_lora.stages")
ADAPTER_WEIGHTS, ADAPTER_CONFIG, METRICS = "adapter.safetensors", "adapter.json", "metrics.jsonl"


def setup(cfg: Config, seed: int) -> Runtime:
    torch.manual_seed(seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    kernels.use(cfg.kernels)
    return Runtime.resolve(cfg.device, cfg.precision)


def _decoder_config(cfg: Config, vocab: int) -> DecoderConfig:
    m = cfg.model
    if m.vocab_size is not None and m.vocab_size < vocab:
        raise ValueError(f"model.vocab_size {m.vocab_size} is smaller than the tokenizer's {vocab} tokens")
    return DecoderConfig(vocab_size=m.vocab_size or vocab, hidden_size=m.hidden_size, num_layers=m.num_layers,
                         num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, intermediate_size=m.intermediate_size,
                         max_seq_len=m.max_seq_len, rope_theta=m.rope_theta, rms_norm_eps=m.rms_norm_eps,
                         tie_embeddings=m.tie_embeddings)


def _pad_id(tok) -> int:
    """Padding never gets a label and sits after every real token (causal), so any id works."""
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def _check_seq_len(seq_len: int, model: Decoder, key: str) -> None:
    if seq_len > model.config.max_seq_len:
        raise ValueError(f"{key}.seq_len {seq_len} exceeds model.max_seq_len {model.config.max_seq_len}")


# ---------------------------------------------------------------- adapters on disk

def save_adapter(model: torch.nn.Module, lora: LoRAConfig, out_dir: Path) -> None:
    save_file(lora_state_dict(model), Path(out_dir) / ADAPTER_WEIGHTS)
    (Path(out_dir) / ADAPTER_CONFIG).write_text(json.dumps(lora.model_dump(), indent=2))


def apply_adapter(model: Decoder, adapter_dir: Path, merge: bool = True) -> Decoder:
    lora = LoRAConfig.model_validate_json((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    inject_lora(model, lora.target_modules, lora.r, lora.alpha)
    load_lora_state_dict(model, load_file(Path(adapter_dir) / ADAPTER_WEIGHTS))
    return merge_lora(model) if merge else model


def load_policy(base_dir: Path, *adapter_dirs: Path) -> Decoder:
    """Base weights with each adapter merged in order (e.g. pretrain → +SFT → +DPO)."""
    model = load_native(base_dir)
    for a in adapter_dirs:
        apply_adapter(model, a, merge=True)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


# ---------------------------------------------------------------- stages

def pretrain(cfg: Config, tokenizer_dir: Path, data_dir: Path, out_dir: Path) -> dict:
    rt = setup(cfg, cfg.pretrain.seed)
    tok = load_tokenizer(tokenizer_dir)
    model = Decoder(_decoder_config(cfg, len(tok)))
    tc = cfg.pretrain
    _check_seq_len(tc.seq_len, model, "pretrain")
    docs = (tok.encode(text, add_special_tokens=False) for text in formats.read_pretrain(split_path(data_dir, "pretrain")))
    blocks = pretrain_blocks(docs, tc.seq_len, tok.eos_token_id)
    log.info("pretrain: %d blocks of %d tokens, %.2fM parameters", len(blocks), tc.seq_len, model.num_params() / 1e6)
    batches = shuffled_batches(blocks, tc.batch_size, lambda b: pad_batch(b, _pad_id(tok)), tc.seed)
    summary = train(model, causal_lm_loss, batches, tc, rt, metrics_path=Path(out_dir) / METRICS)
    save_native(model.cpu(), out_dir)
    return {**summary, "params": model.num_params(), "blocks": len(blocks)}


def import_base(cfg: Config, out_dir: Path) -> dict:
    """A local HF Llama-family model becomes the stage-2 starting point instead of pretraining."""
    model = load_hf_llama(cfg.base_model)
    save_native(model, out_dir)
    return {"source": str(cfg.base_model), "params": model.num_params()}


def _sft_examples(tok, path: Path, seq_len: int) -> list:
    examples, dropped = [], 0
    for messages in formats.read_sft(path):
        ids, labels = truncate(tokenize_chat(tok, messages), seq_len)
        if any(lab != -100 for lab in labels[1:]):
            examples.append((ids, labels))
        else:
            dropped += 1
    if dropped:
        log.warning("sft: %d examples had no assistant tokens within seq_len %d and were dropped", dropped, seq_len)
    return examples


def sft(cfg: Config, base_dir: Path, tokenizer_dir: Path, data_dir: Path, out_dir: Path) -> dict:
    rt = setup(cfg, cfg.sft.seed)
    tok = load_tokenizer(tokenizer_dir)
    tc = cfg.sft
    model = load_native(base_dir)
    _check_seq_len(tc.seq_len, model, "sft")
    inject_lora(model, tc.lora.target_modules, tc.lora.r, tc.lora.alpha, tc.lora.dropout)
    examples = _sft_examples(tok, split_path(data_dir, "sft"), tc.seq_len)
    log.info("sft: %d examples, %.3fM trainable of %.2fM", len(examples),
             model.num_params(True) / 1e6, model.num_params() / 1e6)
    batches = shuffled_batches(examples, tc.batch_size, lambda b: pad_batch(b, _pad_id(tok)), tc.seed)
    summary = train(model, causal_lm_loss, batches, tc, rt, metrics_path=Path(out_dir) / METRICS)
    save_adapter(model.cpu(), tc.lora, out_dir)
    return {**summary, "examples": len(examples), "trainable_params": model.num_params(True)}


def dpo(cfg: Config, base_dir: Path, sft_dir: Path, tokenizer_dir: Path, data_dir: Path, out_dir: Path) -> dict:
    """A fresh LoRA on top of the SFT-merged weights; the reference is the same weights, adapter off."""
    rt = setup(cfg, cfg.dpo.seed)
    tok = load_tokenizer(tokenizer_dir)
    tc = cfg.dpo
    model = load_policy(base_dir, sft_dir)
    _check_seq_len(tc.seq_len, model, "dpo")
    inject_lora(model, tc.lora.target_modules, tc.lora.r, tc.lora.alpha, tc.lora.dropout)
    pairs = []
    for prompt, chosen, rejected in formats.read_dpo(split_path(data_dir, "dpo")):
        pairs.append((truncate(tokenize_chat(tok, prompt + [chosen]), tc.seq_len),
                      truncate(tokenize_chat(tok, prompt + [rejected]), tc.seq_len)))
    log.info("dpo: %d pairs, beta %.3g, nll_weight %.3g", len(pairs), tc.beta, tc.nll_weight)
    batches = shuffled_batches(pairs, tc.batch_size, lambda b: pad_pairs(b, _pad_id(tok)), tc.seed)
    summary = train(model, DPOLoss(tc.beta, tc.nll_weight), batches, tc, rt, metrics_path=Path(out_dir) / METRICS)
    save_adapter(model.cpu(), tc.lora, out_dir)
    return {**summary, "pairs": len(pairs), "trainable_params": model.num_params(True)}
