"""`python -m glm_lora.flows.cli status`: per stage, reused or not, and if not which part of its key changed."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from glm_lora.artifacts import manifest as artifacts
from glm_lora.configs.load import load_config
from glm_lora.tasks import cache
from glm_lora.tasks.cache import build_stage, status
from glm_lora.tasks.table import chain, upstream
from tests.reliability.conftest import write_config

CHAT = [{"conversations": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w}]}
        for w in ("apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "piano", "lemon", "amber") * 5]


def _run_chain(cfg) -> None:
    refs = {}
    for name in chain(cfg):
        ref, _ = build_stage(name, cfg, {k: refs[s] for k, s in upstream(name, cfg).items()})
        refs[name] = ref.to_dict()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("status")
    (root / "runs").mkdir()
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    path = write_config(root, {"data": {"sft": str(root / "chat.jsonl")}})
    _run_chain(load_config(path))
    return root, path


def _status(path: Path, **overrides) -> dict[str, list[str]]:
    return dict(status(load_config(path, overrides)))


def test_everything_built_is_reused(built):
    _, path = built
    assert _status(path) == {s: [] for s in ("data", "tokenizer", "pretrain", "sft", "dpo", "export")}


def test_a_changed_config_key_names_the_key_and_only_downstream_runs(built):
    _, path = built
    report = _status(path, **{"dpo.beta": 0.2})
    assert report["dpo"] == ["config dpo.beta: 0.1 → 0.2"]
    assert report["export"] == ["after dpo re-runs, if its output changes"]
    assert report["sft"] == [] and report["data"] == []


def test_an_edited_user_file_is_named_and_a_touched_one_is_not(built):
    import os
    root, path = built
    user = root / "chat.jsonl"
    original = user.read_bytes()
    os.utime(user, (1, 1))                                  # touched, same content: nothing re-runs
    cache._content_hash.cache_clear()
    assert _status(path)["data"] == []
    try:
        user.write_bytes(original + json.dumps(CHAT[0]).encode() + b"\n")
        report = _status(path)
        assert report["data"] == [f"user file {user} changed"]
        assert report["tokenizer"] == ["after data re-runs, if its output changes"]
    finally:
        user.write_bytes(original)


def test_a_code_change_names_the_packages(built, monkeypatch):
    _, path = built
    real = artifacts.code_version
    monkeypatch.setattr(cache, "code_version", lambda pkgs: real(pkgs) + ("-edited" if "engine" in pkgs else ""))
    report = _status(path)
    assert report["pretrain"] == ["code changed in configs, data, engine, evaluation, kernels, model"]
    assert report["data"] == [] and report["tokenizer"] == []


def test_the_stage_logs_the_same_reasons_when_it_runs(built, caplog):
    _, path = built
    cfg = load_config(path, {"dpo.beta": 0.3, "run_name": "case"})
    inputs = {k: artifacts.ref_for(cfg.stage_dir(s)).to_dict() for k, s in upstream("dpo", cfg).items()}
    with caplog.at_level(logging.INFO, logger="glm_lora.stages"):
        build_stage("dpo", cfg, inputs)
    assert "dpo: running: config dpo.beta: 0.1 → 0.3" in caplog.text
