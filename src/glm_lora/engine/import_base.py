"""Instead of pretraining: a local Hugging Face model of a supported layout (Llama, Qwen2/3, GLM,
GLM-4-0414, the GLM mixtures of experts: model/hf.py) becomes the starting point of SFT, converted tensor by tensor
into our checkpoint without building the model (docs/base-model.md, "Large bases")."""
from __future__ import annotations

from pathlib import Path

from glm_lora.configs.schema import Config
from glm_lora.model.hf import import_hf


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    return {"source": str(cfg.base_model), "params": import_hf(cfg.base_model, out_dir)}
