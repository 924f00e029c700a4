"""The `glm-lora` flow: tokenizer → pretrain (or base import) → SFT → DPO → export → serve.

Wiring only: each stage is a task in tasks/stages.py calling a plain function.
"""
from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.client.schemas.objects import State
from prefect.states import Failed

from artifacts import still_published
from artifacts.lock import run_lock
from configs import ConfigError, load_config
from configs.errors import UserError
from engine.preflight import preflight
from tasks.stages import (data_task, dpo_task, export_task, import_base_task, pretrain_task, serve_task, sft_task,
                          tokenizer_task)

STAGES = ("data", "tokenizer", "pretrain", "import_base", "sft", "dpo", "export", "serve")


class StageFailed(UserError):
    """A stage ended on a UserError (its task state carries the one-line message)."""


@flow(name="glm-lora")
def glm_lora(config: str = "tiny", overrides: dict[str, Any] | None = None,
             refresh: list[str] | None = None) -> dict | State:
    """Run the whole chain; `refresh` names stages to rebuild even if their cache key matches.

    A user error (config, data, base model, a busy run directory, a failed gate) ends the run in a
    Failed state named after the error, with its one-line message and no traceback.
    """
    try:
        cfg = load_config(config, overrides)
        unknown = set(refresh or ()) - set(STAGES)
        if unknown:
            raise ConfigError(f"refresh: unknown stages {sorted(unknown)}; stages are {list(STAGES)}")
        preflight(cfg)
        with run_lock(cfg.run_dir):
            return _chain(cfg.model_dump(mode="json"), refresh or [])
    except UserError as e:
        get_run_logger().error("error: %s", e)
        return Failed(name=type(e).__name__, message=str(e))


def _chain(cfg: dict, refresh: list[str]) -> dict:
    def t(task):
        forced = task.with_options(refresh_cache=True)

        def call(which, *args) -> dict:
            ref = which(*args)
            if isinstance(ref, State):      # the task failed on a user error (tasks.stages.fails_cleanly)
                raise StageFailed(f"{task.name}: {ref.message}")
            return ref

        def run(*args) -> dict:
            if task.name in refresh:
                return call(forced, *args)
            ref = call(task, *args)         # a cache hit whose artifact was deleted or replaced is rebuilt
            return ref if still_published(ref) else call(forced, *args)
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
