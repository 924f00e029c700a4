"""Experiment tracking in MLflow (`tracking.backend: mlflow`, README "Experiment tracking"): the one module that
imports mlflow, and only when tracking is on.

A flow run is one MLflow run: the config flattened as params; tags naming the Prefect flow run, the run directory and
each stage's digest. After each stage, built or reused from cache (the MLflow run shows the whole chain): every
logging window of its metrics.jsonl and every validation loss at its step (`sft/loss`), the manifest's other numbers
once (`sft/eval.exact_match`), and as artifacts its figures (tasks/report.py's plots), manifest, small JSON files and
markdown (the gate, the comparison, the export's model cards). An export that passes the serve stage becomes a
version of a registered model tagged with its digest; the version the endpoint serves carries the alias `serving`.

Tracking never costs a run: a store that cannot be used is one warning line before any stage runs, and the flow goes
on untracked; a failure later is one warning line, after which nothing more of this run goes to MLflow.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from glm_lora.artifacts.manifest import MANIFEST, read_manifest
from glm_lora.configs.schema import Config
from glm_lora.tasks import report

log = logging.getLogger("glm_lora.tracking")
SERVING_ALIAS = "serving"
BATCH = {"metrics": 1000, "params": 100, "tags": 100}   # MLflow's log_batch limits per call
MAX_PARAM = 6000                                         # characters of a param value MLflow keeps
SMALL_JSON = 2**20      # bytes: a stage's small JSON files are logged (sources, answers), not a tokenizer's vocabulary
NOT_METRICS = {"pid"}   # a number in a manifest that measures nothing
# MLflow retries a request 7 times, doubling a 2 s wait: a dead server would stall the flow for minutes. The probe
# before training does not retry; later calls retry twice. A user's own MLFLOW_HTTP_REQUEST_* settings win.
PROBE_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
RUN_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}


def tracking_uri(cfg: Config) -> str:
    """tracking.tracking_uri, or the local store beside the runs: sqlite:///<runs_dir>/mlflow.db."""
    return cfg.tracking.tracking_uri or f"sqlite:///{(cfg.runs_dir / 'mlflow.db').resolve()}"


def _sqlite_file(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///").split("?")[0]).resolve() if uri.startswith("sqlite:///") else None


@contextlib.contextmanager
def _http_limits(limits: dict[str, str]) -> Iterator[None]:
    added = {k: v for k, v in limits.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}{'…' if len(text) > 300 else ''}"


def connect(cfg: Config) -> "Tracker":
    """The flow's tracker: off unless tracking.backend is mlflow and the store answers — asked now, before any stage
    runs; if it does not, one warning line and the flow goes on untracked."""
    if cfg.tracking.backend == "none" or cfg.dist.node_rank > 0:      # several machines: node 0's run is tracked
        return Tracker(cfg)
    uri = tracking_uri(cfg)
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        log.warning("tracking: mlflow is not installed (pip install 'glm-lora[tracking]'); this run goes on untracked")
        return Tracker(cfg)
    name = cfg.tracking.experiment_name or cfg.run_name
    try:
        db = _sqlite_file(uri)
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)
        with _http_limits(PROBE_HTTP):
            client = MlflowClient(tracking_uri=uri, registry_uri=uri)
            experiment_id = _experiment(client, name, (db.parent / "mlartifacts").as_uri() if db else None)
    except Exception as e:      # noqa: BLE001 — whatever MLflow or the store raises: tracking is off, the run goes on
        log.warning("tracking: cannot use the MLflow tracking URI %s (%s); this run goes on untracked", uri,
                    _one_line(e))
        return Tracker(cfg)
    log.info("tracking: MLflow at %s, experiment %r", uri, name)
    return Tracker(cfg, client, experiment_id)


def _experiment(client, name: str, artifact_location: str | None) -> str:
    """The experiment's id, created if missing (a local store's artifacts beside its database, not in the cwd)."""
    found = client.get_experiment_by_name(name)
    if found is None:
        from mlflow.exceptions import MlflowException
        try:
            return client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException:
            found = client.get_experiment_by_name(name)      # another run created it meanwhile
            if found is None:
                raise
    if found.lifecycle_stage != "active":
        raise ValueError(f"experiment {name!r} is deleted: restore it (`mlflow experiments restore`) or set "
                         "tracking.experiment_name")
    return found.experiment_id


def _flat(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The leaves of nested dicts as (dotted key, value)."""
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _flat(v, f"{prefix}{k}.")
    else:
        yield prefix.removesuffix("."), node


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _key(name: str) -> str:
    """MLflow names hold letters, digits and _ - . / : and spaces (a user's task family may hold other characters)."""
    return re.sub(r"[^\w./\- :]", "_", name)[:250]


def params(cfg: Config) -> list[tuple[str, str]]:
    """The config as MLflow params: dotted keys, values as the YAML/JSON a user would write."""
    return [(_key(k), (v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))[:MAX_PARAM])
            for k, v in _flat(cfg.model_dump(mode="json"))]


def step_metrics(stage: str, stage_dir: Path, metrics: dict) -> list[tuple[str, float, int]]:
    """(key, value, step) of every logging window of the stage's metrics.jsonl and every validation loss."""
    points = [(_key(f"{stage}/{k}"), float(v), int(w["step"])) for w in report.windows(stage_dir) if "step" in w
              for k, v in w.items() if k != "step" and _number(v)]
    return points + [(f"{stage}/val_loss", float(v), int(s)) for s, v in metrics.get("val_losses") or []]


def summary_metrics(stage: str, metrics: dict, per_step: set[str]) -> list[tuple[str, float]]:
    """The manifest's numbers, flattened (`sft/eval.exact_match`), but those logged by step."""
    return [(key, float(v)) for k, v in _flat(metrics) if _number(v) and k.rsplit(".", 1)[-1] not in NOT_METRICS
            and (key := _key(f"{stage}/{k}")) not in per_step]


def stage_files(stage_dir: Path) -> list[str]:
    """What of a stage's published files goes to MLflow: its manifest and logging windows, every markdown file (gate,
    comparison, the export's model cards) and its other small top-level JSON files."""
    files = read_manifest(stage_dir)["files"]
    return [MANIFEST] + [rel for rel, entry in files.items()
                         if rel == report.METRICS_FILE or rel.endswith(".md")
                         or ("/" not in rel and rel.endswith(".json") and entry["size"] <= SMALL_JSON)]


def _best_effort(method):
    """Tracking is a side channel: an MLflow failure (server gone, disk full, a refused value) is one warning line and
    ends tracking for this run; the stage, the flow and their artifacts never see it."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.client is None:
            return None
        try:
            with _http_limits(RUN_HTTP):
                return method(self, *args, **kwargs)
        except Exception as e:      # noqa: BLE001 — see the docstring
            log.warning("tracking: %s failed, nothing more of this run goes to MLflow (%s)", method.__name__.strip("_"),
                        _one_line(e))
            self.client = None
    return wrapper


class Tracker:
    """The flow's handle on its MLflow run; does nothing while tracking is off (or, after a failure, turned off)."""

    def __init__(self, cfg: Config, client=None, experiment_id: str | None = None):
        self.cfg, self.client, self.experiment_id, self.run_id = cfg, client, experiment_id, None

    @contextlib.contextmanager
    def run(self, flow_run_id: str | None, flow_run_name: str | None) -> Iterator["Tracker"]:
        """One MLflow run around the chain: FINISHED, or FAILED with the error as a tag (KILLED on Ctrl-C)."""
        self._start(flow_run_id, flow_run_name)
        try:
            yield self
        except BaseException as e:
            self._end("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED", _one_line(e))
            raise
        self._end("FINISHED")

    @_best_effort
    def _start(self, flow_run_id: str | None, flow_run_name: str | None) -> None:
        from mlflow.entities import Param
        tags = {"glm_lora.run_name": self.cfg.run_name, "glm_lora.run_dir": str(self.cfg.run_dir),
                **({"prefect.flow_run_id": str(flow_run_id), "prefect.flow_run_name": flow_run_name or ""}
                   if flow_run_id else {})}
        run = self.client.create_run(self.experiment_id, run_name=flow_run_name or self.cfg.run_name, tags=tags)
        self.run_id = run.info.run_id
        self._log(params=[Param(k, v) for k, v in params(self.cfg)])
        log.info("tracking: MLflow run %s (experiment id %s)", self.run_id, self.experiment_id)

    @_best_effort
    def _end(self, status: str, error: str | None = None) -> None:
        if error:
            self.client.set_tag(self.run_id, "error", error)
        self.client.set_terminated(self.run_id, status)

    def _log(self, **entities: list) -> None:
        for kind, items in entities.items():
            for i in range(0, len(items), BATCH[kind]):
                self.client.log_batch(self.run_id, **{kind: items[i:i + BATCH[kind]]})

    @_best_effort
    def stage(self, name: str, ref: dict, cached: bool) -> None:
        """A finished stage, built or reused (its tag says which): metrics, figures and small files."""
        from mlflow.entities import Metric, RunTag
        stage_dir = Path(ref["path"])
        metrics = read_manifest(stage_dir)["metrics"]
        now = int(time.time() * 1000)
        steps = step_metrics(name, stage_dir, metrics)
        last = metrics.get("last_step") if _number(metrics.get("last_step")) else 0
        entries = [Metric(k, v, now, s) for k, v, s in steps]
        entries += [Metric(k, v, now, int(last)) for k, v in summary_metrics(name, metrics, {k for k, _, _ in steps})]
        self._log(metrics=entries, tags=[RunTag(f"stage.{name}", "cached" if cached else "built"),
                                         RunTag(f"stage.{name}.digest", ref["digest"])])
        for rel in stage_files(stage_dir):
            folder = "/".join(["stages", name, *rel.split("/")[:-1]])
            self.client.log_artifact(self.run_id, str(stage_dir / rel), folder)
        with tempfile.TemporaryDirectory() as tmp:
            for png in report.plots(name, stage_dir, metrics, Path(tmp)).values():
                self.client.log_artifact(self.run_id, str(png), "reports")

    @_best_effort
    def served(self, result: dict) -> None:
        """The serve stage passed (smoke test and gate): the export's final model (merged/) is a version of the
        registered model, once per export digest; the alias `serving` moves to it when the endpoint serves it."""
        from mlflow.entities import RunTag
        from mlflow.exceptions import MlflowException
        tc = self.cfg.tracking
        if not tc.register_model:
            return
        name, digest = tc.registered_model_name or self.cfg.run_name, result["digest"]
        try:
            self.client.create_registered_model(name, description=f"glm-lora run {self.cfg.run_name}: exports that "
                                                "passed the serve stage's smoke test and gate")
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        found = self.client.search_model_versions(f"name = '{name}' and tags.export_digest = '{digest}'")
        if found:
            version = found[0]
        else:
            self.client.log_artifacts(self.run_id, str(Path(result["export"]) / "merged"), "model")
            version = self.client.create_model_version(
                name, f"{self.client.get_run(self.run_id).info.artifact_uri}/model", run_id=self.run_id,
                tags={"export_digest": digest, "export": result["export"]},
                description=f"export/merged of run {self.cfg.run_name} (digest {digest[:16]}); its model card is "
                            "README.md among the files")
        if result.get("running"):
            self.client.set_registered_model_alias(name, SERVING_ALIAS, version.version)
        self._log(tags=[RunTag("registered_model", f"{name}/{version.version}")])
