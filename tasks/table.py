"""The one table of stages: what runs, on what, depending on which config keys and code.

The flow (flows/glm_lora.py), the CLI (`python -m flows.cli stage NAME`, Prefect-free) and the cache
keys (tasks/cache.py) all read it; nothing else lists the stages or their edges. Each stage is a
plain function `run(cfg, inputs, out_dir) -> metrics`, where `inputs` maps upstream stage names to
their published directories ("base" is pretrain, or import_base when `base_model` is set). Functions
are named "module:function" and imported only when their stage runs, so reading the table is cheap.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

TRAINING_CODE = ("configs", "data", "engine", "kernels", "model")


@dataclass(frozen=True)
class Stage:
    run: str                          # "module:function"
    upstream: tuple[str, ...]         # stage names; "base" = pretrain or import_base
    config: tuple[str, ...]           # dotted config keys its output depends on
    code: tuple[str, ...]             # packages whose sources are its code version
    cached: bool = True               # False: runs every time (serving is an action, not an artifact)

    def function(self) -> Callable[..., dict]:
        module, name = self.run.split(":")
        return getattr(importlib.import_module(module), name)


_ENGINE = ("device", "precision", "kernels", "attention", "dist.nproc_per_node", "dist.nnodes", "dist.strategy")
STAGES: dict[str, Stage] = {
    "data": Stage("data.prepare:data_stage", (), ("data", "eval.max_rows"), ("data",)),
    "tokenizer": Stage("data.prepare:tokenizer_stage", ("data",), ("tokenizer", "base_model"), ("data",)),
    "pretrain": Stage("engine.pretrain:run", ("tokenizer", "data"), ("model", "pretrain", *_ENGINE), TRAINING_CODE),
    "import_base": Stage("engine.import_base:run", (), ("base_model",), TRAINING_CODE),
    "sft": Stage("engine.sft:run", ("base", "tokenizer", "data"), ("sft", *_ENGINE), TRAINING_CODE),
    "dpo": Stage("engine.dpo:run", ("base", "sft", "tokenizer", "data"), ("dpo", *_ENGINE), TRAINING_CODE),
    "export": Stage("export:run", ("base", "sft", "dpo", "tokenizer"), ("serve.dtype", "eval"),
                    ("export",) + TRAINING_CODE),
    "serve": Stage("serve.stage:run", ("export",), ("serve",), ("serve", "export") + TRAINING_CODE, cached=False),
}


DISTRIBUTED = ("pretrain", "sft", "dpo")     # run under torchrun when dist asks for it (tasks/launch.py)


def base_stage(cfg: dict) -> str:
    return "import_base" if cfg.get("base_model") else "pretrain"


def chain(cfg: dict) -> list[str]:
    """The stages a run of this config executes, in order."""
    names = ["data", "tokenizer", base_stage(cfg), "sft", "dpo", "export"]
    return names + (["serve"] if cfg["serve"]["enabled"] else [])


def upstream(name: str, cfg: dict) -> dict[str, str]:
    """input name → the stage that provides it (resolving "base")."""
    return {u: base_stage(cfg) if u == "base" else u for u in STAGES[name].upstream}


def input_dirs(name: str, cfg, stage_dir: Callable[[str], Path]) -> dict[str, Path]:
    """input name → published directory, for a stage run outside the flow (the CLI)."""
    return {u: stage_dir(s) for u, s in upstream(name, cfg).items()}
