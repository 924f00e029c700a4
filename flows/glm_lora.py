"""The `glm-lora` flow: tokenizer → pretrain (or base import) → SFT → DPO → export → serve.

Wiring only: each stage is a task in tasks/stages.py calling a plain function.
"""
from __future__ import annotations

from typing import Any

from prefect import flow

from artifacts import still_published
from configs import load_config
from tasks.stages import (data_task, dpo_task, export_task, import_base_task, pretrain_task, serve_task, sft_task,
                          tokenizer_task)

STAGES = ("data", "tokenizer", "pretrain", "import_base", "sft", "dpo", "export", "serve")


@flow(name="glm-lora")
def glm_lora(config: str = "tiny", overrides: dict[str, Any] | None = None,
             refresh: list[str] | None = None) -> dict:
    """Run the whole chain; `refresh` names stages to rebuild even if their cache key matches."""
    cfg = load_config(config, overrides).model_dump(mode="json")
    unknown = set(refresh or ()) - set(STAGES)
    if unknown:
        raise ValueError(f"refresh: unknown stages {sorted(unknown)}; stages are {list(STAGES)}")

    def t(task):
        forced = task.with_options(refresh_cache=True)
        if task.name in (refresh or ()):
            return forced

        def run(*args):
            ref = task(*args)   # a cache hit whose artifact was deleted or replaced is rebuilt
            return ref if still_published(ref) else forced(*args)
        return run

    data = t(data_task)(cfg)
    tokenizer = t(tokenizer_task)(cfg, data)
    if cfg["base_model"]:
        base = t(import_base_task)(cfg)
    else:
        base = t(pretrain_task)(cfg, tokenizer, data)
    sft = t(sft_task)(cfg, base, tokenizer, data)
    dpo = t(dpo_task)(cfg, base, sft, tokenizer, data)
    exported = t(export_task)(cfg, base, sft, dpo, tokenizer)
    if not cfg["serve"]["enabled"]:
        return {"export": exported}
    return t(serve_task)(cfg, exported)


if __name__ == "__main__":
    glm_lora()
