"""The serve stage refuses to promote a model that is worse than the one being served."""
import json

import pytest

from artifacts import write_manifest
from configs import load_config
from serve.stage import RECORD, GateFailed, serve


def _export_with(tmp_path, eval_metrics):
    export = tmp_path / "export"
    (export / "merged").mkdir(parents=True)
    (export / "merged" / "config.json").write_text("{}")
    write_manifest(export, "export", metrics={"eval": eval_metrics})
    return export


def test_a_worse_model_is_not_promoted_and_the_old_server_record_stays(tmp_path):
    cfg = load_config("tiny", {"runs_dir": str(tmp_path / "runs")})
    serve_dir = cfg.stage_dir("serve")
    serve_dir.mkdir(parents=True)
    old = {"pid": 999999, "url": "http://127.0.0.1:1", "running": True,
           "eval": {"dpo": {"exact_match": 0.9, "implicit_reward_accuracy": 0.95}}}
    (serve_dir / RECORD).write_text(json.dumps(old))
    export = _export_with(tmp_path, {"dpo": {"exact_match": 0.5, "implicit_reward_accuracy": 0.97}})
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(GateFailed, match=r"dpo\.exact_match.*0\.5.*0\.9"):
        serve(cfg, export, out)
    assert json.loads((serve_dir / RECORD).read_text()) == old        # nothing was stopped or replaced
    assert "dpo.exact_match" in (out / "gate.md").read_text()


def test_thresholds_apply_when_nothing_is_served(tmp_path):
    cfg = load_config("tiny", {"runs_dir": str(tmp_path / "runs"), "serve.gate.min": {"sft.exact_match": 0.8}})
    export = _export_with(tmp_path, {"sft": {"exact_match": 0.3}})
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(GateFailed, match=r"sft\.exact_match"):
        serve(cfg, export, out)
