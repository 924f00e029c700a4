"""The `glm-lora-serve` flow (deployment `serve` in prefect.yaml): promote an existing export to the
configured run's endpoint through the blue/green path of the serve stage — e.g. a rollback:

    prefect deployment run glm-lora-serve/serve --param export=/abs/runs/tiny/serving/exports/<digest> \\
        --param allow_regression=true
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Failed

from glm_lora.configs.load import load_config
from glm_lora.configs.errors import UserError


@flow(name="glm-lora-serve")
def serve_export(export: str, config: str = "tiny", overrides: dict[str, Any] | None = None,
                 allow_regression: bool = False):
    """Verify `export` (its manifest), then start it beside the served model, smoke-test it, gate it and
    switch the endpoint to it; any failure leaves the served model answering."""
    from glm_lora.serve.stage import promote_export
    try:
        cfg = load_config(config, overrides)
        return promote_export(cfg, Path(export), allow_regression=allow_regression)
    except UserError as e:
        get_run_logger().error("error: %s", e)
        return Failed(name=type(e).__name__, message=str(e))
