"""Instead of pretraining: a local Hugging Face model of a supported layout (Llama, Qwen2/3, GLM,
GLM-4-0414: model/hf.py) becomes the starting point of SFT."""
from __future__ import annotations

from pathlib import Path

from glm_lora.configs.schema import Config
from glm_lora.model.hf import load_hf, save_native


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    model = load_hf(cfg.base_model)
    save_native(model, out_dir)
    return {"source": str(cfg.base_model), "params": model.num_params()}
