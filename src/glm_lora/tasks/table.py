"""The one table of stages: what runs, on what, depending on which config keys and code.

The flow (flows/glm_lora.py), the CLI (`python -m glm_lora.flows.cli stage NAME`, Prefect-free) and the cache
keys (tasks/cache.py) all read it; nothing else lists the stages or their edges. Each stage is a
plain function `run(cfg, inputs, out_dir) -> metrics`, named here as "module:function" (a reader or a tool
follows it with one jump; it is imported when the stage runs, so reading the table, e.g. to report a
config error, loads no torch), where `cfg` is the validated Config and `inputs` maps upstream stage
names to their published directories ("base" is pretrain, or import_base when `base_model` is set).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from glm_lora.configs.schema import LORA_STAGES, Config

TRAINING_CODE = ("configs", "data", "engine", "evaluation", "kernels", "model")
StageFunction = Callable[[Config, dict[str, Path], Path], dict]


@dataclass(frozen=True)
class Stage:
    entry: str                        # "module:function", the function run(cfg, inputs, out_dir) -> metrics
    upstream: tuple[str, ...]         # stage names; "base" = pretrain or import_base
    config: tuple[str, ...]           # dotted config keys its output depends on
    code: tuple[str, ...]             # packages whose sources are its code version
    cached: bool = True               # False: runs every time (serving is an action, not an artifact)
    ignore: tuple[str, ...] = ()      # keys inside `config` that only another stage reads (not in this one's key)

    @property
    def run(self) -> StageFunction:
        module, _, name = self.entry.partition(":")
        return getattr(importlib.import_module(module), name)


_ENGINE = ("device", "precision", "kernels", "attention", "dist.nproc_per_node", "dist.nnodes", "dist.strategy")
STAGES: dict[str, Stage] = {
    "data": Stage("glm_lora.data.prepare:data_stage", (), ("data", "eval.max_rows"), ("data",)),
    "tokenizer": Stage("glm_lora.data.prepare:tokenizer_stage", ("data",), ("tokenizer", "base_model"), ("data",)),
    "pretrain": Stage("glm_lora.engine.pretrain:run", ("tokenizer", "data"), ("model", "pretrain", *_ENGINE), TRAINING_CODE),
    "import_base": Stage("glm_lora.engine.import_base:run", (), ("base_model",), TRAINING_CODE),
    "sft": Stage("glm_lora.engine.sft:run", ("base", "tokenizer", "data"), ("sft", *_ENGINE), TRAINING_CODE),
    "dpo": Stage("glm_lora.engine.dpo:run", ("base", "sft", "tokenizer", "data"), ("dpo", *_ENGINE), TRAINING_CODE),
    # Optional (rl.enabled): GRPO on the DPO model; `glm-lora stage rl` runs it on a run's cached stages
    "rl": Stage("glm_lora.tasks.rl_sampler:rl_stage", ("base", "sft", "dpo", "tokenizer", "data"), ("rl", *_ENGINE),
                TRAINING_CODE + ("export", "serve", "tasks")),     # rl.sampler vllm: tasks/rl_sampler.py
    "export": Stage("glm_lora.export.hf_peft:run", ("base", "sft", "dpo", "tokenizer"), ("serve.dtype", "eval"),
                    ("export",) + TRAINING_CODE, ignore=("eval.harness",)),
    # Optional (eval.harness.tasks non-empty): lm-evaluation-harness on export/merged (and base/); the serve stage's
    # gate reads its scores
    "harness": Stage("glm_lora.evaluation.harness:run", ("export", "data"), ("eval.harness", "device"), ("evaluation", "data")),
    # Optional (export.gguf non-empty): the final model as GGUF files for llama.cpp / Ollama
    "gguf": Stage("glm_lora.export.gguf:run", ("export",), ("export.gguf",), ("export", "model")),
    "serve": Stage("glm_lora.serve.stage:run", ("export",), ("serve",), ("serve", "export") + TRAINING_CODE, cached=False),
}


DISTRIBUTED = ("pretrain", *LORA_STAGES)     # run under torchrun when dist asks for it (tasks/launch.py)


def base_stage(cfg: Config) -> str:
    return "import_base" if cfg.base_model else "pretrain"


def chain(cfg: Config) -> list[str]:
    """The stages a run of this config executes, in order."""
    names = ["data", "tokenizer", base_stage(cfg), "sft", "dpo", *(["rl"] if cfg.rl.enabled else []), "export",
             *(["gguf"] if cfg.export.gguf else []), *(["harness"] if cfg.eval.harness.tasks else [])]
    return names + (["serve"] if cfg.serve.enabled else [])


def upstream(name: str, cfg: Config) -> dict[str, str]:
    """input name → the stage that provides it (resolving "base"; the export takes the RL stage's adapter too when
    rl.enabled, the serve stage the harness stage's scores when eval.harness.tasks is set)."""
    names = STAGES[name].upstream + (("rl",) if name == "export" and cfg.rl.enabled else ()) + (
        ("harness",) if name == "serve" and cfg.eval.harness.tasks else ())
    return {u: base_stage(cfg) if u == "base" else u for u in names}
