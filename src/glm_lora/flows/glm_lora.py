"""The `glm-lora` flow: data → tokenizer → pretrain (or base import) → SFT → DPO → export → serve.

Wiring only: the stages and their edges are the table in tasks/table.py; each is a task in
tasks/stages.py calling a plain function. With `tracking` on, the flow run is an MLflow run too (tasks/tracking.py).
"""
from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.client.schemas.objects import State
from prefect.runtime import flow_run
from prefect.states import Failed

from glm_lora.artifacts.manifest import read_manifest
from glm_lora.artifacts.lock import run_lock
from glm_lora.configs.load import ConfigError, load_config
from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import Config
from glm_lora.engine.preflight import preflight
from glm_lora.serve.stage import serving_notes
from glm_lora.tasks import tracking
from glm_lora.tasks.stages import TASKS
from glm_lora.tasks.table import STAGES, chain, upstream


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
        for note in serving_notes(cfg):
            get_run_logger().warning("%s", note)
        tracker = tracking.connect(cfg)      # a store that cannot be used: one warning line, the run goes on untracked
        with run_lock(cfg.run_dir, cfg.dist.node_rank):
            return run_chain(cfg, set(refresh or ()), tracker)
    except UserError as e:
        get_run_logger().error("error: %s", e)
        return Failed(name=type(e).__name__, message=str(e))


def run_chain(cfg: Config, refresh: set[str], tracker: tracking.Tracker | None = None) -> dict:
    tracker = tracker or tracking.Tracker(cfg)
    refs: dict[str, dict] = {}
    with tracker.run(flow_run.id, flow_run.name):
        for name in chain(cfg):
            inputs = {key: refs[stage] for key, stage in upstream(name, cfg).items()}
            state = TASKS[name](cfg, inputs, force=name in refresh, return_state=True)
            if not state.is_completed():
                if state.is_failed() and state.name != "Failed":      # a user error: its one line, no traceback
                    raise StageFailed(f"{name}: {state.message}")
                state.result()                                         # a bug: raise it with its traceback
            refs[name] = state.result()
            tracker.stage(name, refs[name], cached=state.name == "Cached")
        if chain(cfg)[-1] != "serve":
            return {"export": refs["export"]}
        result = {**refs["serve"], **read_manifest(refs["serve"]["path"])["metrics"]}
        tracker.served(result)
        return result


if __name__ == "__main__":
    glm_lora()
