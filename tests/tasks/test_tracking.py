"""Experiment tracking (tasks/tracking.py) against a local MLflow store (the default sqlite one under runs_dir), read
back through MLflow's own client: a stage's logging windows become metrics at their steps, the manifest's numbers
are logged once, its figures and small files are artifacts; a served export is registered once per digest. A store
that cannot be used is one warning line and the run goes on untracked. The flow against a real MLflow server:
tests/test_dag.py (the DAG's first run is tracked)."""
from __future__ import annotations

import importlib.util
import json
import logging
import socket
import sys
import time
from pathlib import Path

import pytest

from glm_lora.artifacts import manifest as artifacts
from glm_lora.configs.load import ConfigError, load_config
from glm_lora.tasks import tracking
from glm_lora.tasks.cache import key_parts
from glm_lora.tasks.table import STAGES

needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                  reason="mlflow is not installed (pip install -e '.[tracking]')")
WINDOWS = [{"step": 10, "loss": 3.0, "lr": 1e-3}, {"step": 20, "loss": 2.0, "lr": 9e-4},
           {"step": 30, "loss": 1.5, "lr": 8e-4}]
METRICS = {"loss": 1.5, "lr": 8e-4, "last_step": 30, "val_losses": [[15, 2.5], [30, 1.75]], "pid": 4242,
           "eval": {"exact_match": 0.75, "per_family": {"add_en": 0.5, "加法": 1.0}, "samples": [{"a": 1}]}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def _cfg(runs: Path, experiment: str, **tracking_keys):
    return load_config("tiny", {"runs_dir": str(runs), "tracking": {"backend": "mlflow", "experiment_name": experiment,
                                                                     **tracking_keys}})


def _stage(root: Path, name: str, files: dict[str, str], metrics: dict) -> dict:
    def write(tmp: Path) -> dict:
        for rel, text in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
        return metrics
    return artifacts.build(root / name, name, write).to_dict()


def _client(cfg):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking.tracking_uri(cfg))


def _only_run(cfg):
    client = _client(cfg)
    exp = client.get_experiment_by_name(cfg.tracking.experiment_name)
    (run,) = client.search_runs([exp.experiment_id])
    return client, run


@needs_mlflow
def test_a_stage_is_logged_by_step_its_manifest_once_with_figures_and_files_and_a_cached_one_too(runs, tmp_path):
    cfg = _cfg(runs, "stages")
    sft = _stage(tmp_path, "sft", {"metrics.jsonl": "".join(json.dumps(w) + "\n" for w in WINDOWS),
                                   "adapter.safetensors": "weights", "card/README.md": "# card"}, METRICS)
    data = _stage(tmp_path, "data", {"sft.jsonl": "{}\n", "sources.json": "{}"}, {"rows_sft": 1})
    tracker = tracking.connect(cfg)
    with tracker.run("0b7e-flow-run-id", "brave-otter"):
        tracker.stage("data", data, cached=True)
        tracker.stage("sft", sft, cached=False)

    client, run = _only_run(cfg)
    assert run.info.status == "FINISHED" and run.info.run_name == "brave-otter"
    assert run.data.tags["prefect.flow_run_id"] == "0b7e-flow-run-id"
    assert run.data.tags["stage.data"] == "cached" and run.data.tags["stage.sft"] == "built"
    assert run.data.tags["stage.sft.digest"] == sft["digest"]
    assert run.data.params["sft.max_steps"] == str(cfg.sft.max_steps)
    assert run.data.params["tracking.backend"] == "mlflow"
    assert json.loads(run.data.params["eval.compare_prompts"]) == cfg.eval.compare_prompts
    history = lambda key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]  # noqa: E731
    assert history("sft/loss") == [(10, 3.0), (20, 2.0), (30, 1.5)]          # per window, not the manifest's copy
    assert history("sft/val_loss") == [(15, 2.5), (30, 1.75)]
    assert history("sft/eval.exact_match") == [(30, 0.75)]
    assert run.data.metrics["sft/eval.per_family.加法"] == 1.0 and run.data.metrics["data/rows_sft"] == 1
    assert not {"sft/pid", "sft/eval.samples"} & run.data.metrics.keys()
    listed = lambda path: {a.path for a in client.list_artifacts(run.info.run_id, path)}  # noqa: E731
    assert listed("stages/sft") == {"stages/sft/manifest.json", "stages/sft/metrics.jsonl", "stages/sft/card"}
    assert listed("stages/sft/card") == {"stages/sft/card/README.md"}
    assert listed("stages/data") == {"stages/data/manifest.json", "stages/data/sources.json"}    # no data splits
    assert listed("reports") == {"reports/sft-loss.png"}


@needs_mlflow
def test_a_served_export_is_registered_once_per_digest_and_the_alias_follows_the_endpoint(runs, tmp_path, monkeypatch):
    cfg = _cfg(runs, "registry", registered_model_name="tiny-model")
    export = tmp_path / "export"
    (export / "merged").mkdir(parents=True)
    (export / "merged" / "model.safetensors").write_bytes(b"\x00weights\x01")
    (export / "merged" / "README.md").write_text("# tiny model card")

    def serve(digest: str, running: bool) -> None:
        tracker = tracking.connect(cfg)
        with tracker.run(None, None):
            tracker.served({"digest": digest, "export": str(export), "running": running})

    serve("d1" * 32, running=False)                 # tested, not switched to (serve.keep_running: false)
    client = _client(cfg)
    (v1,) = client.search_model_versions("name = 'tiny-model'")
    assert v1.tags["export_digest"] == "d1" * 32 and client.get_registered_model("tiny-model").aliases == {}
    got = Path(client.download_artifacts(v1.run_id, "model", str(tmp_path / "down")))
    assert (got / "model.safetensors").read_bytes() == b"\x00weights\x01" and (got / "README.md").is_file()
    assert v1.source.endswith(f"{v1.run_id}/artifacts/model")
    assert client.get_run(v1.run_id).data.tags["registered_model"] == "tiny-model/1"

    serve("d1" * 32, running=True)                  # the same export, now live: no second copy, the alias moves
    assert len(client.search_model_versions("name = 'tiny-model'")) == 1
    assert client.get_model_version_by_alias("tiny-model", tracking.SERVING_ALIAS).version == v1.version
    from mlflow.artifacts import download_artifacts     # the README's way to fetch the served model
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking.tracking_uri(cfg))    # models:/ URIs ignore registry_uri=
    got = Path(download_artifacts("models:/tiny-model@serving", dst_path=str(tmp_path / "alias")))
    assert (got / "model.safetensors").read_bytes() == b"\x00weights\x01"
    serve("d2" * 32, running=True)
    assert client.get_model_version_by_alias("tiny-model", tracking.SERVING_ALIAS).tags["export_digest"] == "d2" * 32

    cfg_off = _cfg(runs, "no-registry", registered_model_name="not-registered", register_model=False)
    tracker = tracking.connect(cfg_off)
    with tracker.run(None, None):
        tracker.served({"digest": "d3" * 32, "export": str(export), "running": True})
    assert client.search_registered_models("name = 'not-registered'") == []


@needs_mlflow
def test_a_run_that_fails_ends_its_mlflow_run_failed_with_the_error(runs):
    cfg = _cfg(runs, "failed-run")
    tracker = tracking.connect(cfg)
    with pytest.raises(RuntimeError, match="sft: DataError"):
        with tracker.run("id", "calm-heron"):
            raise RuntimeError("sft: DataError: chat.jsonl:17: bad row")
    _, run = _only_run(cfg)
    assert run.info.status == "FAILED" and "chat.jsonl:17: bad row" in run.data.tags["error"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "glm_lora.tracking" and r.levelno == logging.WARNING]


@needs_mlflow
def test_an_unreachable_tracking_uri_is_one_warning_before_training_and_the_run_goes_on_untracked(tmp_path, caplog):
    uri = f"http://127.0.0.1:{_free_port()}"        # nothing listens there
    cfg = load_config("tiny", {"runs_dir": str(tmp_path), "tracking": {"backend": "mlflow", "tracking_uri": uri}})
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="glm_lora.tracking"):
        tracker = tracking.connect(cfg)
        ref = _stage(tmp_path, "data", {"sources.json": "{}"}, {"rows_sft": 1})
        with tracker.run("id", "name"):
            tracker.stage("data", ref, cached=False)
            tracker.served({"digest": "d" * 64, "export": str(tmp_path), "running": True})
    assert time.monotonic() - started < 30                  # no minutes of MLflow's own retries
    (warning,) = _warnings(caplog)
    assert uri in warning and "untracked" in warning and "\n" not in warning and len(warning) < 600, warning
    bad_sqlite = tmp_path / "a-file"
    bad_sqlite.write_text("")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="glm_lora.tracking"):
        cfg = load_config("tiny", {"runs_dir": str(tmp_path), "tracking.backend": "mlflow",
                                   "tracking.tracking_uri": f"sqlite:///{bad_sqlite}/mlflow.db"})
        assert tracking.connect(cfg).client is None
    assert len(_warnings(caplog)) == 1


@needs_mlflow
def test_a_tracking_failure_mid_run_is_one_warning_and_never_reaches_the_stage(runs, tmp_path, caplog, monkeypatch):
    cfg = _cfg(runs, "mid-run-failure")
    ref = _stage(tmp_path, "data", {"sources.json": "{}"}, {"rows_sft": 1})
    tracker = tracking.connect(cfg)

    def server_gone(*args, **kwargs):
        raise ConnectionError("connection refused")
    with caplog.at_level(logging.INFO, logger="glm_lora.tracking"):
        with tracker.run("id", "name"):
            monkeypatch.setattr(tracker.client, "log_batch", server_gone)
            tracker.stage("data", ref, cached=False)
            tracker.stage("data", ref, cached=True)         # tracking is off now: nothing, not a second warning
    (warning,) = _warnings(caplog)
    assert "stage failed" in warning and "connection refused" in warning
    assert tracker.client is None and ref["digest"] == artifacts.ref_for(Path(ref["path"])).digest


def test_without_mlflow_installed_tracking_is_one_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)          # import fails as if not installed
    with caplog.at_level(logging.INFO, logger="glm_lora.tracking"):
        assert tracking.connect(load_config("tiny", {"runs_dir": str(tmp_path), "tracking": "mlflow"})).client is None
    (warning,) = _warnings(caplog)
    assert "glm-lora[tracking]" in warning


def test_tracking_is_off_by_default_has_a_shorthand_and_enters_no_stage_key():
    off, on = load_config("tiny"), load_config("tiny", {"tracking": "mlflow"})
    assert off.tracking.backend == "none" and tracking.connect(off).client is None
    assert on.tracking.backend == "mlflow"
    on = load_config("tiny", {"tracking": {"backend": "mlflow", "tracking_uri": "http://127.0.0.1:5000"}})
    for stage in STAGES:
        assert key_parts(stage, off, [], Path("/x")) == key_parts(stage, on, [], Path("/x")), stage
    with pytest.raises(ConfigError, match="tracking.backend"):
        load_config("tiny", {"tracking": "wandb"})
    with pytest.raises(ConfigError, match="tracking.registered_model_name"):
        load_config("tiny", {"tracking.registered_model_name": "it's"})
    with pytest.raises(ConfigError, match="tracking.tracking_uri: holds a password"):
        load_config("tiny", {"tracking.tracking_uri": "http://me:secret@127.0.0.1:5000"})
