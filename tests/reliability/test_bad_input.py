"""Bad input that must fail before any training: config, paths, data files, base model directories.

Each case runs the real CLI (`python -m glm_lora.flows.cli stage data|tokenizer|...`) in a subprocess and
asserts the exit status, one `error: ` line naming the place, and that nothing outside the run's
own bookkeeping (its lock file) was created or changed.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.reliability.conftest import (REPO, USER_ERROR_EXIT, changed, error_line, run_cli, snapshot,
                                        tiny_hf_base, write_config)
from glm_lora.configs.schema import LoRAConfig

GOOD_SFT = {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def jsonl(path: Path, rows: list) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return path


def expect_user_error(workdir: Path, config: Path, *words: str, stage: str = "data",
                      extra_args: tuple[str, ...] = ()) -> str:
    """Run one stage; it must exit 2 with one error line holding `words`, and leave the tree as it was."""
    before = snapshot(workdir)
    proc = run_cli("stage", stage, "--config", str(config), *extra_args, cwd=workdir)
    assert proc.returncode == USER_ERROR_EXIT, proc.stderr[-3000:]
    line = error_line(proc)
    for w in words:
        assert w in line, f"{w!r} not in {line!r}"
    diff = [p for p in changed(before, snapshot(workdir)) if not p.endswith("/.lock") and not p.endswith("/runs/case")]
    assert diff == [], f"files changed by a failed run: {diff}"
    return line


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("extra,words", [
    ({"run_name": ".."}, ["run_name", "'..'", "one directory under runs_dir"]),
    ({"run_name": "."}, ["run_name", "'.'"]),
    ({"run_name": "a/b"}, ["run_name", "'a/b'"]),
    ({"pretrain": {"max_steps": True}}, ["pretrain.max_steps", "expected a number, got true"]),
    ({"sft": {"lr": False}}, ["sft.lr", "expected a number, got false"]),
    ({"sft": {"seq_len": 256}}, ["sft.seq_len (256) exceeds model.max_seq_len (128)"]),
    ({"serve": {"enabled": True, "max_model_len": 1024}}, ["serve.max_model_len (1024) exceeds model.max_seq_len"]),
    ({"sft": {"bogus": 1}}, ["sft.bogus: unknown key"]),
    ({"sft": {"lora": {"target_modules": ["q_proj", "qkv"]}}}, ["sft.lora.target_modules", "'qkv'"]),
    ({"device": "tpu"}, ["device", "'tpu'"]),
])
def test_bad_config_values_name_the_key(workdir, extra, words):
    expect_user_error(workdir, write_config(workdir, extra), *words, "case.yaml")


def test_malformed_yaml_names_file_and_line(workdir):
    cfg = workdir / "case.yaml"
    cfg.write_text("run_name: case\nsft:\n  max_steps: [1,\n")
    expect_user_error(workdir, cfg, "case.yaml:4:1", "not valid YAML")


def test_yaml_that_is_not_a_mapping(workdir):
    cfg = workdir / "case.yaml"
    cfg.write_text("- run_name\n- case\n")
    expect_user_error(workdir, cfg, "case.yaml", "expected a mapping of config keys", "list")


def test_missing_config_file(workdir):
    expect_user_error(workdir, workdir / "nope.yaml", "nope.yaml not found")


def test_bad_override_value(workdir):
    expect_user_error(workdir, write_config(workdir), "sft.max_steps", "expected a number",
                      extra_args=("--set", "sft.max_steps=true"))


# ---------------------------------------------------------------- paths and publishing

def test_user_file_missing_fails_before_anything_is_generated(workdir):
    cfg = write_config(workdir, {"data": {"sft": str(workdir / "chat.jsonl")}})
    expect_user_error(workdir, cfg, "data.sft", "chat.jsonl does not exist")
    assert not (workdir / "runs" / "case" / "data").exists()


def test_empty_user_file(workdir):
    (workdir / "chat.jsonl").write_bytes(b"")
    expect_user_error(workdir, write_config(workdir, {"data": {"sft": str(workdir / "chat.jsonl")}}),
                      "data.sft", "chat.jsonl is empty")


def test_unreadable_user_file(workdir, monkeypatch):
    """In-process: CI runs as root, which reads any file, so unreadability is simulated at os.access."""
    import os
    from glm_lora.configs.load import load_config
    from glm_lora.data.formats import DataError
    from glm_lora.engine.preflight import preflight
    path = jsonl(workdir / "chat.jsonl", [GOOD_SFT])
    cfg = load_config(write_config(workdir, {"data": {"sft": str(path)}}))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == path else real_access(p, mode))
    with pytest.raises(DataError, match=r"data.sft: .*chat.jsonl is not readable by this user"):
        preflight(cfg)


def test_publish_refuses_to_replace_a_directory_that_is_not_ours(workdir):
    """runs_dir/run_name/data lands on the user's own data directory: it must survive untouched."""
    theirs = workdir / "home" / "proj" / "data"
    theirs.mkdir(parents=True)
    (theirs / "notes.txt").write_text("my notes")
    cfg = write_config(workdir, {"runs_dir": str(workdir / "home"), "run_name": "proj"})
    before = snapshot(workdir)
    proc = run_cli("stage", "data", "--config", str(cfg), cwd=workdir)
    assert proc.returncode == USER_ERROR_EXIT
    line = error_line(proc)
    assert str(theirs) in line and "is not a glm-lora 'data' output" in line and "refusing to replace" in line
    assert (theirs / "notes.txt").read_text() == "my notes"
    assert [p for p in changed(before, snapshot(workdir)) if not p.endswith(".lock")] == []


def test_run_dir_on_the_project_itself_leaves_the_project_alone(workdir):
    """runs_dir/run_name = this package's folder: its own data/ package must not be swapped out."""
    pkg = REPO / "src" / "glm_lora"
    cfg = write_config(workdir, {"runs_dir": str(pkg.parent), "run_name": pkg.name})
    before = snapshot(pkg / "data")
    proc = run_cli("stage", "data", "--config", str(cfg), cwd=workdir)
    assert proc.returncode == USER_ERROR_EXIT
    assert "is not a glm-lora 'data' output" in error_line(proc)
    assert changed(before, snapshot(pkg / "data")) == []
    assert not list(pkg.glob(".data.*")), "a scratch dir was left in the package"
    (pkg / ".lock").unlink(missing_ok=True)


# ---------------------------------------------------------------- data files

@pytest.mark.parametrize("rows,words", [
    ([GOOD_SFT, b'{"conversations": [{"role": "user", "con'], ["chat.jsonl:2", "invalid JSON"]),
    ([GOOD_SFT, {"conversations": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}],
     ["chat.jsonl:2", "conversations[1].role", "got 'bot'"]),
    ([GOOD_SFT, {"conversations": [{"role": "user"}, {"role": "assistant", "content": "a"}]}],
     ["chat.jsonl:2", "conversations[0].content", "missing"]),
    ([GOOD_SFT, b'{"text": "caf\xe9"}'], ["chat.jsonl:2", "invalid UTF-8"]),
    ([GOOD_SFT, {"conversations": [{"role": "user", "content": "x" * 50_000}, {"role": "bot", "content": "a"}]}],
     ["chat.jsonl:2", "got 'bot'"]),
])
def test_bad_sft_row_names_file_line_and_field(workdir, rows, words):
    path = jsonl(workdir / "chat.jsonl", rows)
    expect_user_error(workdir, write_config(workdir, {"data": {"sft": str(path)}}), *words)


def test_file_with_no_usable_rows(workdir):
    path = jsonl(workdir / "chat.jsonl", [{"conversations": [{"role": "user", "content": "q"},
                                                             {"role": "bot", "content": "a"}]}])
    cfg = write_config(workdir, {"data": {"sft": str(path), "on_bad_row": "skip"}})
    expect_user_error(workdir, cfg, "data.sft", "no usable rows")


def test_most_of_a_split_dropped_is_an_error_not_a_quiet_loss(workdir):
    bad = {"conversations": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}
    path = jsonl(workdir / "chat.jsonl", [GOOD_SFT] * 10 + [bad] * 5)       # a third of the rows are bad
    cfg = write_config(workdir, {"data": {"sft": str(path), "on_bad_row": "skip"}})
    expect_user_error(workdir, cfg, "data.sft", "5 of 15 rows were dropped", "data.max_drop_fraction (0.2)",
                      "bad_row 5")


# ---------------------------------------------------------------- base models

@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return tiny_hf_base(tmp_path_factory.mktemp("base"), tie_word_embeddings=False)


def copy_of(base: Path, dest: Path) -> Path:
    shutil.copytree(base, dest)
    return dest


def base_config(workdir: Path, base: Path, extra: dict | None = None) -> Path:
    return write_config(workdir, {"base_model": str(base), "sft": {"seq_len": 64}, "dpo": {"seq_len": 64},
                                  **(extra or {})})


def test_base_model_config_missing_a_required_key(workdir, base_model):
    base = copy_of(base_model, workdir / "base")
    cfg = json.loads((base / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (base / "config.json").write_text(json.dumps(cfg))
    expect_user_error(workdir, base_config(workdir, base), "config.json", "'num_hidden_layers'", "missing")


def test_base_model_with_only_pickled_weights_is_refused(workdir, base_model):
    base = copy_of(base_model, workdir / "base")
    (base / "model.safetensors").rename(base / "pytorch_model.bin")
    expect_user_error(workdir, base_config(workdir, base), "no *.safetensors weights", "pytorch_model.bin",
                      "never loaded")


def test_seq_len_over_the_base_models_positions(workdir, base_model):
    cfg = base_config(workdir, base_model, {"sft": {"seq_len": 128}})
    expect_user_error(workdir, cfg, "sft.seq_len (128)", "max_position_embeddings (96)", "config.json")


def test_served_length_over_the_base_models_positions(workdir, base_model):
    cfg = base_config(workdir, base_model, {"serve": {"enabled": True, "max_model_len": 128}})
    expect_user_error(workdir, cfg, "serve.max_model_len (128)", "max_position_embeddings (96)")


def test_base_model_of_an_unsupported_family(workdir, base_model):
    base = copy_of(base_model, workdir / "base")
    cfg = json.loads((base / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (base / "config.json").write_text(json.dumps(cfg))
    expect_user_error(workdir, base_config(workdir, base), "config.json", "model_type 'mamba'", "not supported")


def test_base_model_without_a_tokenizer(workdir, base_model):
    base = copy_of(base_model, workdir / "base")
    for f in ("tokenizer.json", "tokenizer.model"):
        (base / f).unlink(missing_ok=True)
    expect_user_error(workdir, base_config(workdir, base), "no tokenizer.json or tokenizer.model")


def test_lora_target_the_base_model_lacks(workdir, base_model, tmp_path):
    """Schema-valid targets that this model has no layer for: named before any step trains."""
    from glm_lora.model.hf import load_hf
    from glm_lora.model.lora import LoRAConfigError, inject_lora
    model = load_hf(base_model)
    for module in list(model.modules()):      # a model family without a separate gate projection
        if hasattr(module, "gate_proj"):
            del module.gate_proj
    with pytest.raises(LoRAConfigError, match=r"lora.target_modules \['gate_proj'\] not found"):
        inject_lora(model, LoRAConfig(target_modules=["q_proj", "gate_proj"], r=4, alpha=8))


# ---------------------------------------------------------------- under Prefect

def test_a_user_error_in_the_flow_is_one_line_and_not_retried(workdir):
    """The whole flow in-process (`flows.cli run`): the data stage's DataError ends the run once
    (no Prefect retry: it would fail the same way) with the same one line, no traceback."""
    path = jsonl(workdir / "chat.jsonl", [GOOD_SFT, {"conversations": [{"role": "user", "content": "q"},
                                                                       {"role": "bot", "content": "a"}]}])
    cfg = write_config(workdir, {"data": {"sft": str(path)}})
    before = snapshot(workdir)
    proc = run_cli("run", "--config", str(cfg), cwd=workdir)
    assert proc.returncode == USER_ERROR_EXIT, proc.stderr[-3000:]
    line = error_line(proc)
    assert line.startswith("error: data: ") and "chat.jsonl:2" in line and "got 'bot'" in line
    out = proc.stdout + proc.stderr
    assert out.count("Finished in state DataError") == 1, out[-3000:]       # one attempt: not retried
    assert "Retry 1/" not in out and "Retries are exhausted" not in out
    assert [p for p in changed(before, snapshot(workdir)) if not p.endswith((".lock", "/runs/case"))] == []


def test_a_layer_nf4_cannot_hold_is_named_before_any_training(tmp_path):
    """lora.quantization nf4 scales whole 64-weight blocks: a 36 × 36 q_proj (1,296 weights) is refused by
    preflight, naming the key and the layer, before the data stage."""
    from glm_lora.configs.load import load_config
    from glm_lora.engine.preflight import preflight
    from glm_lora.model.lora import LoRAConfigError
    shape = {"model.hidden_size": 36, "model.num_heads": 3, "model.num_kv_heads": 3, "serve.enabled": False,
             "runs_dir": str(tmp_path)}
    preflight(load_config("tiny", shape))                                       # fine without quantization
    with pytest.raises(LoRAConfigError, match=r"dpo\.lora\.quantization nf4 .*q_proj \(36×36\)"):
        preflight(load_config("tiny", {**shape, "dpo.lora.quantization": "nf4"}))
