"""Our adapter on disk, beside the LoRA code it saves: `adapter.safetensors` (the trainable tensors of
lora_state_dict: LoRA A/B and any modules_to_save) + `adapter.json` (the LoRAConfig it was made with).
Export turns these into PEFT's format (export/hf_peft.py); training stages and export load them here.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from glm_lora.configs.schema import LoRAConfig
from glm_lora.model import mtp
from glm_lora.model.hf import load_native
from glm_lora.model.lora import inject_lora, load_lora_state_dict, lora_state_dict, merge_lora
from glm_lora.model.model import Decoder

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter.safetensors", "adapter.json"


def save_adapter(model: torch.nn.Module, lora: LoRAConfig, out_dir: Path) -> None:
    save_file(lora_state_dict(model, lora.modules_to_save), Path(out_dir) / ADAPTER_WEIGHTS)
    (Path(out_dir) / ADAPTER_CONFIG).write_text(json.dumps(lora.model_dump(), indent=2))


def read_adapter(adapter_dir: Path) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    lora = LoRAConfig.model_validate_json((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    return lora, load_file(Path(adapter_dir) / ADAPTER_WEIGHTS)


def apply_adapter(model: Decoder, adapter_dir: Path, merge: bool = True) -> Decoder:
    """The adapter on `model`; merged, unless `merge` is false. An adapter that trained the MTP layer (keys under
    `mtp.`) gets it built from the carried tensors (model/mtp.py); merged, its weights go back there."""
    lora, state = read_adapter(adapter_dir)
    if any(k.startswith(f"{mtp.MODULE}.") for k in state) and mtp.attached(model) is None:
        mtp.attach(model)
    # The base the adapter was trained on: with nf4, merging folds it into the dequantised base weights.
    inject_lora(model, lora)
    load_lora_state_dict(model, state, lora.modules_to_save)
    if not merge:
        return model
    merge_lora(model)
    mtp.detach(model)
    return model


def load_policy(base_dir: Path, *adapter_dirs: Path) -> Decoder:
    """Base weights with each adapter merged in order (e.g. pretrain → +SFT → +DPO)."""
    model = load_native(base_dir)
    for a in adapter_dirs:
        apply_adapter(model, a, merge=True)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# Beside a PEFT adapter whose stage trained the MTP layer (`<stage>.mtp: train`): that layer's LoRA, keyed as PEFT
# would key it (base_model.model.model.layers.{L}.…), kept out of adapter_model.safetensors (transformers has no MTP
# layer, and vLLM applies no LoRA to its MTP draft model).
MTP_LORA = "mtp_lora.safetensors"
MTP_LORA_IGNORED = ("it trained the MTP (multi-token prediction) layer too, and vLLM never applies a LoRA to the MTP "
                    "draft model, so speculative decoding would draft with the untrained layer; its merged form (MTP "
                    "layer updated) is served instead")
# vLLM's latent attention (GLM-4.7-Flash, GLM-5) decodes with kv_b_proj folded into the other weights at load, so a
# LoRA on kv_b_proj is accepted and never applied: served as a LoRA, the model would silently not be the trained one.
KV_B_PROJ_IGNORED = ("it adapts kv_b_proj, whose LoRA vLLM accepts and never applies (its latent attention decodes "
                     "with kv_b_proj folded into other weights at load); its merged form is served instead")
# Beside a PEFT adapter trained on a 4-bit base (lora.quantization nf4): transformers' BitsAndBytesConfig
# arguments that load its base as it was trained (our NF4 format is bitsandbytes' own: tests/kernels/test_nf4.py).
BASE_QUANTIZATION = "base_quantization.json"
NF4_BNB_CONFIG = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                  "bnb_4bit_compute_dtype": "bfloat16"}


VLLM_SUFFIX = "-vllm"     # adapters/<name>-vllm/: the split form of a fused layout's adapter (export/hf_peft.py)


def served_form(export_dir: Path, adapter: str, moe: bool = False) -> dict:
    """What a server needs to know of the exported adapter `adapter` (a path in export_dir, e.g. "adapters/sft"),
    as export records it in its manifest (`adapters`): the PEFT dir, the form vLLM loads (`<dir>-vllm/` where
    export wrote one), the rank `r` (the largest vLLM will see), why vLLM cannot serve it as a LoRA (None when it
    can) and whether its base is a mixture of experts (`moe`: vLLM's CPU build serves no LoRA on one)."""
    adapter = Path(adapter)
    vllm = adapter.with_name(adapter.name + VLLM_SUFFIX)
    config = json.loads((Path(export_dir) / adapter / PEFT_CONFIG).read_text())
    return {"dir": str(adapter), "vllm_dir": str(vllm if (Path(export_dir) / vllm / PEFT_CONFIG).is_file() else adapter),
            "r": max([config["r"], *(config.get("rank_pattern") or {}).values()]),   # vLLM checks the largest
            "unservable": vllm_unservable(Path(export_dir) / adapter), "moe": moe}


def vllm_unservable(adapter_dir: Path) -> str | None:
    """None if vLLM can serve this PEFT adapter as a LoRA; else why not (it refuses modules_to_save)."""
    config = Path(adapter_dir) / PEFT_CONFIG
    if not config.is_file():
        return f"{adapter_dir} has no {PEFT_CONFIG}"
    if (Path(adapter_dir) / BASE_QUANTIZATION).is_file():
        return ("it was trained on a 4-bit (nf4) base, so on a full-precision base it is not the model that was "
                "trained; its merged form (merged into the dequantised base) is served instead")
    if (Path(adapter_dir) / MTP_LORA).is_file():
        return MTP_LORA_IGNORED
    config = json.loads(config.read_text())
    saved = config.get("modules_to_save")
    if saved:
        return f"it trains {', '.join(saved)} in full (modules_to_save), which vLLM refuses"
    if "kv_b_proj" in (config.get("target_modules") or []):
        return KV_B_PROJ_IGNORED
    return None
