"""Export: Hugging Face + PEFT formats that transformers, peft and vLLM load as they are.

    <out>/base/                 the starting weights (pretrained or imported) as LlamaForCausalLM
    <out>/merged/               base + SFT + DPO merged: what gets served
    <out>/adapters/sft/         PEFT LoRA adapter on base/
    <out>/adapters/dpo/         PEFT LoRA adapter on base/ with adapters/sft merged
    <out>/compare.md            fixed prompts answered by the pretrain, SFT and DPO models
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from artifacts import read_manifest
from configs.schema import Config, LoRAConfig
from data.prepare import TOKENIZER_FILES
from data.tokenizer import load_tokenizer
from engine import evaluate
from engine.stages import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_policy
from model.hf import save_hf

COMPARE = "compare.md"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_peft_adapter(adapter_dir: Path, out_dir: Path, base_model_path: str) -> None:
    """Our adapter (keys `<path>.lora_A.weight`) → PEFT's adapter_config.json + adapter_model.safetensors."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lora = LoRAConfig.model_validate_json((adapter_dir / ADAPTER_CONFIG).read_text())
    state = load_file(adapter_dir / ADAPTER_WEIGHTS)
    save_file({f"base_model.model.{k}": v for k, v in state.items()}, out_dir / "adapter_model.safetensors",
              metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_path,
        "r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules), "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "modules_to_save": lora.modules_to_save or None, "use_dora": False, "use_rslora": False,
        "init_lora_weights": True,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))


def _save_hf(model, tok, tokenizer_dir: Path, out_dir: Path, dtype: torch.dtype) -> None:
    save_hf(model, out_dir, bos_id=tok.bos_token_id, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, dtype=dtype)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).is_file() and f != "generation_config.json":
            shutil.copy2(tokenizer_dir / f, out_dir / f)
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))


def export(cfg: Config, base_dir: Path, sft_dir: Path, dpo_dir: Path, tokenizer_dir: Path, out_dir: Path) -> dict:
    out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    tok = load_tokenizer(tokenizer_dir)
    dtype = DTYPES[cfg.serve.dtype]
    models = {"pretrain": load_policy(base_dir), "sft": load_policy(base_dir, sft_dir),
              "dpo": load_policy(base_dir, sft_dir, dpo_dir)}
    _save_hf(models["pretrain"], tok, tokenizer_dir, out_dir / "base", dtype)
    _save_hf(models["dpo"], tok, tokenizer_dir, out_dir / "merged", dtype)
    if cfg.eval.enabled and cfg.eval.compare_prompts:
        (out_dir / COMPARE).write_text(compare_report(models, tok, cfg.eval.compare_prompts, cfg.eval.max_new_tokens))
    final = cfg.stage_dir("export")   # PEFT records where its base lives; point at the published path
    write_peft_adapter(Path(sft_dir), out_dir / "adapters" / "sft", str(final / "base"))
    write_peft_adapter(Path(dpo_dir), out_dir / "adapters" / "dpo", f"{final / 'base'} + adapters/sft (merged)")
    return {"dtype": cfg.serve.dtype, "eval": collect_eval(base_dir=base_dir, sft=sft_dir, dpo=dpo_dir)}


def compare_report(models: dict, tok, prompts: list[str], max_new_tokens: int) -> str:
    """The same prompts answered greedily by each model, side by side (markdown)."""
    chats = [[{"role": "user", "content": p}] for p in prompts]
    answers = {name: evaluate.greedy_answers(m, tok, chats, max_new_tokens=max_new_tokens) for name, m in models.items()}
    return "### Fixed prompts: pretrain vs SFT vs DPO\n\n" + evaluate.compare_prompts(answers, prompts) + "\n"


def collect_eval(**stage_dirs: Path) -> dict:
    """Each stage's held-out metrics (from its manifest), keyed by stage: what the gate compares."""
    out = {}
    for name, d in stage_dirs.items():
        metrics = read_manifest(Path(d))["metrics"].get("eval")
        if metrics:
            out["pretrain" if name == "base_dir" else name] = {k: v for k, v in metrics.items() if k != "samples"}
    return out
