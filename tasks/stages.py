"""One thin Prefect task per stage: cache key, retries, artifacts; the work is in plain functions.

Every task takes the validated config as a dict plus upstream ArtifactRef dicts and returns a
small ArtifactRef dict (path + digest) — never a model object.
"""
from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Any, Callable

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.states import Failed

import artifacts
from configs.errors import UserError
from configs.schema import Config
from tasks.cache import reusable, stage_key

logging.getLogger("glm_lora").setLevel(logging.INFO)


def _refs(params: dict) -> list[dict]:
    return [v for v in params.values() if isinstance(v, dict) and "digest" in v]


def _prefect_key(stage: str) -> Callable:
    def key_fn(ctx, params: dict) -> str:
        cfg = Config.model_validate(params["cfg"])
        return stage_key(stage, params["cfg"], _refs(params), cfg.stage_dir(stage))
    return key_fn


def _artifact_key(cfg: Config, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]", "-", f"{cfg.run_name}-{what}".lower())


def _metrics_markdown(stage: str, ref: artifacts.ArtifactRef, metrics: dict) -> str:
    rows = "\n".join(f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in metrics.items())
    return f"### {stage}\n\n`{ref.path}`  digest `{ref.digest[:16]}`\n\n| metric | value |\n|---|---|\n{rows}\n"


def run_stage(stage: str, cfg_dict: dict, upstream: list[dict], work: Callable[[Path], dict]) -> dict:
    """Reuse the published artifact if its key matches, else build it atomically."""
    cfg = Config.model_validate(cfg_dict)
    out = cfg.stage_dir(stage)
    key = stage_key(stage, cfg_dict, upstream, out)
    log = get_run_logger()
    ctx = TaskRunContext.get()
    forced = bool(ctx and ctx.task.refresh_cache)
    if reusable(out, key) and not forced:
        log.info("%s: reusing %s (key %s)", stage, out, key[:12])
        return artifacts.ref_for(out).to_dict()
    inputs = [artifacts.ArtifactRef.from_dict(r) for r in upstream]
    ref = artifacts.build(out, stage, work, config={"cache_key": key, "run": cfg_dict}, inputs=inputs)
    metrics = ref.manifest()["metrics"]
    create_markdown_artifact(key=_artifact_key(cfg, stage), markdown=_metrics_markdown(stage, ref, metrics),
                             description=f"{stage} metrics")
    log.info("%s: built %s %s", stage, out, {k: metrics[k] for k in list(metrics)[:8]})
    return ref.to_dict()


def _p(ref: dict) -> Path:
    return Path(ref["path"])


def _user_error_names(cls: type = UserError) -> set[str]:
    return {cls.__name__}.union(*(_user_error_names(sub) for sub in cls.__subclasses__()))


def fails_cleanly(fn: Callable) -> Callable:
    """A UserError ends the task in a Failed state named after the error, with its one-line message:
    no traceback in the logs (it is not a bug) and no retry (see `transient`)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            get_run_logger().error("error: %s", e)
            return Failed(name=type(e).__name__, message=str(e))
    return wrapper


def is_user_error(state) -> bool:
    """A Failed state made by `fails_cleanly` (or the flow's own equivalent)."""
    return state.name in _user_error_names()


def transient(task, task_run, state) -> bool:
    """Retry only what may pass next time (I/O, preemption, a crashed server) — not bad data, a bad
    config or a failed gate, which would fail the same way again."""
    return not is_user_error(state)


stage_task = dict(retries=1, retry_delay_seconds=5, retry_condition_fn=transient, persist_result=True,
                  result_serializer="json")


@task(name="data", cache_key_fn=_prefect_key("data"), **stage_task)
@fails_cleanly
def data_task(cfg: dict) -> dict:
    """Generate the embedded data (or validate the user's files)."""
    from data.prepare import prepare_data
    c = Config.model_validate(cfg)
    return run_stage("data", cfg, [], lambda out: prepare_data(c.data, out, eval_rows=c.eval.max_rows))


@task(name="tokenizer", cache_key_fn=_prefect_key("tokenizer"), **stage_task)
@fails_cleanly
def tokenizer_task(cfg: dict, data: dict) -> dict:
    """Train the sentencepiece BPE tokenizer, or take the base model's."""
    from data.prepare import prepare_tokenizer
    c = Config.model_validate(cfg)
    return run_stage("tokenizer", cfg, [data], lambda out: prepare_tokenizer(
        _p(data), c.tokenizer.vocab_size, out, base_model=c.base_model))


@task(name="pretrain", cache_key_fn=_prefect_key("pretrain"), **stage_task)
@fails_cleanly
def pretrain_task(cfg: dict, tokenizer: dict, data: dict) -> dict:
    """Pretrain the decoder from scratch."""
    from engine.stages import pretrain
    return run_stage("pretrain", cfg, [tokenizer, data], lambda out: pretrain(
        Config.model_validate(cfg), _p(tokenizer), _p(data), out))


@task(name="import_base", cache_key_fn=_prefect_key("import_base"), **stage_task)
@fails_cleanly
def import_base_task(cfg: dict) -> dict:
    """Load a local Hugging Face base model instead of pretraining."""
    from engine.stages import import_base
    return run_stage("import_base", cfg, [], lambda out: import_base(Config.model_validate(cfg), out))


@task(name="sft", cache_key_fn=_prefect_key("sft"), **stage_task)
@fails_cleanly
def sft_task(cfg: dict, base: dict, tokenizer: dict, data: dict) -> dict:
    """LoRA supervised fine-tuning on assistant tokens."""
    from engine.stages import sft
    return run_stage("sft", cfg, [base, tokenizer, data], lambda out: sft(
        Config.model_validate(cfg), _p(base), _p(tokenizer), _p(data), out))


@task(name="dpo", cache_key_fn=_prefect_key("dpo"), **stage_task)
@fails_cleanly
def dpo_task(cfg: dict, base: dict, sft: dict, tokenizer: dict, data: dict) -> dict:
    """DPO with a fresh LoRA on the SFT-merged model."""
    from engine.stages import dpo
    return run_stage("dpo", cfg, [base, sft, tokenizer, data], lambda out: dpo(
        Config.model_validate(cfg), _p(base), _p(sft), _p(tokenizer), _p(data), out))


@task(name="export", cache_key_fn=_prefect_key("export"), **stage_task)
@fails_cleanly
def export_task(cfg: dict, base: dict, sft: dict, dpo: dict, tokenizer: dict) -> dict:
    """Write the merged HF model and the PEFT adapters."""
    from export import COMPARE, export
    ref = run_stage("export", cfg, [base, sft, dpo, tokenizer], lambda out: export(
        Config.model_validate(cfg), _p(base), _p(sft), _p(dpo), _p(tokenizer), out))
    report = Path(ref["path"]) / COMPARE
    if report.is_file():
        create_markdown_artifact(key=_artifact_key(Config.model_validate(cfg), "compare"),
                                 markdown=report.read_text(), description="fixed prompts side by side")
    return ref


@task(name="serve", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=10, retry_condition_fn=transient)
@fails_cleanly
def serve_task(cfg: dict, export: dict) -> dict[str, Any]:
    """Start vLLM on the merged export, ask it the configured prompt, record the answer."""
    from serve.stage import serve
    c = Config.model_validate(cfg)
    result: dict = {}

    def work(out: Path) -> dict:
        result.update(serve(c, _p(export), out))
        return result
    ref = artifacts.build(c.stage_dir("serve"), "serve", work, config={"run": cfg},
                          inputs=[artifacts.ArtifactRef.from_dict(export)])
    create_markdown_artifact(
        key=_artifact_key(c, "answer"),
        markdown=f"### Served answer\n\n**endpoint** `{result['endpoint']}`\n\n**prompt** {result['prompt']}\n\n"
                 f"**vLLM** {result['answer']}\n\n**in-process** {result['inprocess_answer']}\n\n"
                 f"### Promotion gate\n\n{result['gate']}\n",
        description="answer from the served model")
    return {**ref.to_dict(), **result}
