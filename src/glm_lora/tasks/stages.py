"""One Prefect task per stage of the table (tasks/table.py): retries, one-line user errors, artifacts.

The work and the caching are Prefect-free (`tasks.cache.build_stage`: the manifest key is the one
cache); a stage reused from it ends in a Completed state named "Cached". Tasks take the validated
Config (validated once, where the flow loads it) plus upstream ArtifactRef dicts and return a small
ArtifactRef dict — never a model.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import Callable

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency
from prefect.states import Completed, Failed

from glm_lora.configs.errors import UserError
from glm_lora.engine import progress
from glm_lora.configs.schema import Config
from glm_lora.tasks import nodes, report
from glm_lora.tasks.cache import build_stage
from glm_lora.tasks.report import artifact_key
from glm_lora.tasks.table import STAGES

logging.getLogger("glm_lora").setLevel(logging.INFO)
# A global concurrency limit (scripts/run.sh creates it with 1 slot): a manual run and the nightly, or two
# runs of different names, never train at once on one machine. Without the limit on the server: no wait.
TRAIN_SLOT = "glm-lora-train"
TRAINING = ("pretrain", "sft", "dpo", "rl")


def _limit_exists(name: str) -> bool:
    """Whether the Prefect server has the global concurrency limit `name` (a read; True when it can't tell)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    try:
        with get_client(sync_client=True) as client:
            client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        return False
    except Exception:       # noqa: BLE001 -- unreachable or an older server: let `concurrency` decide, as before
        return True
    return True


@contextlib.contextmanager
def train_slot():
    """Hold TRAIN_SLOT while a stage trains, where the server has that limit. Where it has none, ask nothing:
    Prefect would still try to take a slot, an UPDATE on its database that SQLite refuses while another write
    is open ("database is locked", a 503 the client retries after ~2 s: 1.7-2.4 s at most LoRA stages' start
    on the test server), then log that the limit doesn't exist."""
    if not _limit_exists(TRAIN_SLOT):
        yield
        return
    with concurrency(TRAIN_SLOT, occupy=1):
        yield


def _compare_artifact(cfg: Config, out: Path, metrics: dict) -> None:
    from glm_lora.export.hf_peft import COMPARE
    if (out / COMPARE).is_file():
        create_markdown_artifact(key=artifact_key(cfg.run_name, "compare"), markdown=(out / COMPARE).read_text(),
                                 description="fixed prompts side by side")


def _answer_artifact(cfg: Config, out: Path, r: dict) -> None:
    create_markdown_artifact(
        key=artifact_key(cfg.run_name, "answer"),
        markdown=f"### Served answer\n\n**endpoint** `{r['endpoint']}`\n\n**prompt** {r['prompt']}\n\n"
                 f"**vLLM** {r['answer']}\n\n**in-process** {r['inprocess_answer']}\n\n"
                 f"### Promotion gate\n\n{r['gate']}\n",
        description="answer from the served model")


EXTRA_ARTIFACTS: dict[str, Callable[[Config, Path, dict], None]] = {"export": _compare_artifact,
                                                                    "serve": _answer_artifact}


def _user_error_names(cls: type = UserError) -> set[str]:
    return {cls.__name__}.union(*(_user_error_names(sub) for sub in cls.__subclasses__()))


def is_user_error(state) -> bool:
    """A Failed state made by `fails_cleanly` (or the flow's own equivalent)."""
    return state.name in _user_error_names()


def transient(task, task_run, state) -> bool:
    """Retry only what may pass next time (I/O, preemption, a crashed server) — not bad data, a bad
    config or a failed gate, which would fail the same way again."""
    return not is_user_error(state)


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


class ProgressArtifact:
    """A training stage's progress artifact, updated every logging window (step, loss, tokens/s, ETA);
    100% when the stage has finished (also when early stopping ended it before max_steps)."""

    def __init__(self, cfg: Config, stage: str):
        self.key, self.stage, self.id, self.text = artifact_key(cfg.run_name, f"{stage}-progress"), stage, None, ""

    def __call__(self, event: dict) -> None:
        if event.get("stage") != self.stage or not event.get("max_steps"):
            return
        eta = progress.eta_s(event)
        self.text = (f"{self.stage}: step {event['step']}/{event['max_steps']}, loss {event.get('loss') or 0:.4g}, "
                     f"{event.get('tokens_per_s') or 0:,.0f} tokens/s" + (f", ETA {eta / 60:.1f} min" if eta else ""))
        self._set(100.0 * event["step"] / event["max_steps"], self.text)

    def done(self) -> None:
        if self.id is not None:
            self._set(100.0, f"{self.text} — done")

    def _set(self, pct: float, text: str) -> None:
        if self.id is None:
            self.id = create_progress_artifact(pct, key=self.key, description=text)
        else:
            update_progress_artifact(self.id, pct, description=text)


def run_stage(name: str, cfg: Config, inputs: dict[str, dict], force: bool = False):
    """Build (or reuse) one stage's artifact, with its Prefect artifacts and logs."""
    log = get_run_logger()
    slot = train_slot if name in TRAINING else contextlib.nullcontext
    bar = ProgressArtifact(cfg, name)
    with progress.listening(bar) if name in TRAINING else contextlib.nullcontext():
        ref, reused = build_stage(name, cfg, inputs, force=force, log=log, guard=slot)
    bar.done()
    if reused:
        log.info("%s: reusing %s (cache key in its manifest matches)", name, ref.path)
        return Completed(name="Cached", data=ref.to_dict(), message=f"reused {ref.path}")
    if nodes.follows(cfg):           # node 0 published it and its reports
        log.info("%s: trained along with node 0, which published %s", name, ref.path)
        return ref.to_dict()
    metrics = ref.manifest()["metrics"]
    report.publish(cfg.run_name, cfg.run_dir, name, Path(ref.path), metrics)
    if name in EXTRA_ARTIFACTS:
        EXTRA_ARTIFACTS[name](cfg, Path(ref.path), metrics)
    log.info("%s: built %s %s", name, ref.path, {k: metrics[k] for k in list(metrics)[:8]})
    return ref.to_dict()


def _stage_task(name: str):
    def stage(cfg: Config, inputs: dict[str, dict], force: bool = False) -> dict:
        return run_stage(name, cfg, inputs, force)
    fn = STAGES[name].run
    stage.__doc__ = f"The {name} stage ({fn.__module__}.{fn.__name__})."
    return task(name=name, cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5,
                retry_condition_fn=transient)(fails_cleanly(stage))


TASKS = {name: _stage_task(name) for name in STAGES}
