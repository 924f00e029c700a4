"""The serve stage refuses to promote a model that is worse than the one being served — before any
server is started or stopped (the gate needs only the manifests)."""
import json
import subprocess
import sys

import pytest

from glm_lora.artifacts import write_manifest
from glm_lora.configs import load_config
from glm_lora.serve.deploy import Deployment
from glm_lora.serve.stage import GateFailed, serve


def _export_with(tmp_path, eval_metrics):
    export = tmp_path / "export"
    (export / "merged").mkdir(parents=True)
    (export / "merged" / "config.json").write_text("{}")
    write_manifest(export, "export", metrics={"eval": eval_metrics})
    return export


def test_a_worse_model_is_not_promoted_and_the_live_record_stays(tmp_path):
    cfg = load_config("tiny", {"runs_dir": str(tmp_path / "runs")})
    dep = Deployment.of(cfg)
    dep.root.mkdir(parents=True)
    served = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])   # stands in for the live server
    try:
        old = {"host": "127.0.0.1", "port": cfg.serve.port, "proxy": None, "candidate": None, "retiring": [],
               "history": [], "active": {"pid": served.pid, "port": 1, "digest": "d0", "spec": "s0",
                                         "eval": {"dpo": {"exact_match": 0.9, "implicit_reward_accuracy": 0.95}}}}
        dep.record.write_text(json.dumps(old))
        export = _export_with(tmp_path, {"dpo": {"exact_match": 0.5, "implicit_reward_accuracy": 0.97}})
        out = tmp_path / "out"
        out.mkdir()
        with pytest.raises(GateFailed, match=r"dpo\.exact_match.*0\.5.*0\.9"):
            serve(cfg, export, out)
        assert json.loads(dep.record.read_text()) == old        # nothing was started, stopped or replaced
        assert served.poll() is None
        assert "dpo.exact_match" in (out / "gate.md").read_text()
        assert not (dep.root / "logs").exists()                  # no candidate was ever started
    finally:
        served.kill()
        served.wait()


def test_thresholds_apply_when_nothing_is_served(tmp_path):
    cfg = load_config("tiny", {"runs_dir": str(tmp_path / "runs"), "serve.gate.min": {"sft.exact_match": 0.8}})
    export = _export_with(tmp_path, {"sft": {"exact_match": 0.3}})
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(GateFailed, match=r"sft\.exact_match"):
        serve(cfg, export, out)


def test_an_export_that_does_not_verify_is_refused(tmp_path):
    from glm_lora.configs.errors import UserError
    cfg = load_config("tiny", {"runs_dir": str(tmp_path / "runs")})
    export = _export_with(tmp_path, {})
    (export / "merged" / "config.json").write_text('{"edited": true}')
    with pytest.raises(UserError, match=r"does not verify against its manifest.*merged/config.json"):
        serve(cfg, export, tmp_path)
