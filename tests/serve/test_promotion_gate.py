"""The serve stage refuses to promote a model that is worse than the one being served — before any
server is started or stopped (the gate needs only the manifests)."""
import json
import subprocess
import sys

import pytest

from glm_lora.artifacts.manifest import write_manifest
from glm_lora.configs.load import load_config
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


def _harness_stage(tmp_path, export, score, base=None):
    """A published harness stage dir that scored `export` (its manifest names the export among its inputs)."""
    from glm_lora.artifacts.manifest import ref_for
    d = tmp_path / "harness"
    d.mkdir()
    scored = lambda s: {"glm_lora_arithmetic": {"metric": "exact_match", "exact_match": s, "score": s,   # noqa: E731
                                                "higher_is_better": True, "n": 8}}
    metrics = {"harness": scored(score), **({"base": scored(base)} if base is not None else {})}
    write_manifest(d, "harness", metrics=metrics, inputs=[ref_for(export)])
    return d


def test_the_gate_reads_the_harness_stages_score_against_the_served_models(tmp_path):
    """serve.gate.harness: the candidate's lm-evaluation-harness score (from the harness stage that scored this
    export) must beat the served model's recorded one by min_delta; nothing is started when it does not."""
    cfg = load_config("tiny", {"runs_dir": str(tmp_path / "runs"), "eval.harness.tasks": ["glm_lora_arithmetic"],
                               "serve.gate.harness": {"glm_lora_arithmetic": 0.05}, "serve.gate.no_regression": []})
    dep = Deployment.of(cfg)
    dep.root.mkdir(parents=True)
    served = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        old = {"host": "127.0.0.1", "port": cfg.serve.port, "proxy": None, "candidate": None, "retiring": [],
               "history": [], "active": {"pid": served.pid, "port": 1, "digest": "d0", "spec": "s0",
                                         "eval": {"harness": {"glm_lora_arithmetic": {"score": 0.6}}}}}
        dep.record.write_text(json.dumps(old))
        export = _export_with(tmp_path, {"dpo": {"exact_match": 0.9}})
        out = tmp_path / "out"
        out.mkdir()
        harness_dir = _harness_stage(tmp_path, export, 0.62, base=0.1)
        with pytest.raises(GateFailed, match=r"harness\.glm_lora_arithmetic: candidate 0\.62 does not beat the "
                                             r"served model's 0\.6 by min_delta 0\.05"):
            serve(cfg, export, out, harness_dir=harness_dir)
        gate = (out / "gate.md").read_text()
        assert "| harness.glm_lora_arithmetic | 0.62 | 0.6 | ≥ served + 0.05 | **FAIL** |" in gate
        assert json.loads(dep.record.read_text()) == old and served.poll() is None
        # scores of another export are not this one's: missing, and that fails too
        other = _export_with(tmp_path / "other", {"dpo": {"exact_match": 0.9}})
        (other / "merged" / "config.json").write_text('{"other": true}')         # other files: another digest
        write_manifest(other, "export", metrics={"eval": {"dpo": {"exact_match": 0.9}}})
        with pytest.raises(GateFailed, match=r"harness\.glm_lora_arithmetic: candidate score is missing"):
            serve(cfg, other, out, harness_dir=harness_dir)
    finally:
        served.kill()
        served.wait()
