"""Failures that involve what is already on disk: changed user files, corrupted weights and
checkpoints, a second run on the same directory, leftovers of a crashed run.

One small run (data → tokenizer → pretrain, user SFT file) is built once and copied per case —
so every case also runs from a copied run directory, as a user's would.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.conftest import (REPO, USER_ERROR_EXIT, changed, error_line, run_cli, snapshot,
                                        write_config)

CHAT = [{"conversations": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w}]}
        for w in ("apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "piano", "lemon", "amber") * 6]
SFT = {"sft": {"max_steps": 4, "eval_every": 2}, "checkpoint": {"save_every": 2, "save_optimizer_every": 2,
                                                                 "async_save": False}}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """data, tokenizer and pretrain of a run whose SFT split is the user's own file."""
    root = tmp_path_factory.mktemp("built")
    (root / "runs").mkdir()
    _jsonl(root / "chat.jsonl", CHAT)
    cfg = write_config(root, {"data": {"sft": str(root / "chat.jsonl")}, **SFT})
    for stage in ("data", "tokenizer", "pretrain"):
        proc = run_cli("stage", stage, "--config", str(cfg), cwd=root)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.fixture
def run(built, tmp_path) -> tuple[Path, Path]:
    """A copy of the built run (user file included), with its config pointing at the copy."""
    shutil.copytree(built / "runs", tmp_path / "runs")
    user_file = shutil.copy(built / "chat.jsonl", tmp_path / "chat.jsonl")
    # the data stage recorded the original file's path; the copy's data stage must name the copy
    sources = tmp_path / "runs" / "case" / "data" / "sources.json"
    text = sources.read_text().replace(str(built / "chat.jsonl"), str(user_file))
    sources.write_text(text)
    _refresh_manifest(tmp_path / "runs" / "case" / "data")
    return tmp_path, write_config(tmp_path, {"data": {"sft": str(user_file)}, **SFT})


def _refresh_manifest(stage_dir: Path) -> None:
    from glm_lora.artifacts import manifest as artifacts
    m = artifacts.read_manifest(stage_dir)
    artifacts.write_manifest(stage_dir, m["stage"], config=m["config"], metrics=m["metrics"],
                             inputs=[artifacts.ArtifactRef.from_dict(r) for r in m["inputs"]])


def _stage(workdir: Path, cfg: Path, stage: str, *args: str):
    return run_cli("stage", stage, "--config", str(cfg), *args, cwd=workdir)


def _allowed(path: str) -> bool:
    return path.endswith("/.lock")


def _flip_byte(path: Path, offset: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- stale data

def test_user_file_edited_after_the_data_stage_is_not_tokenised_under_the_old_hash(run):
    workdir, cfg = run
    with open(workdir / "chat.jsonl", "a") as f:          # edited in place after the data stage
        f.write(json.dumps(CHAT[0]) + "\n")
    before = snapshot(workdir)
    proc = _stage(workdir, cfg, "sft")
    assert proc.returncode == USER_ERROR_EXIT
    line = error_line(proc)
    assert "data.sft" in line and "chat.jsonl changed after the data stage read it" in line
    assert [p for p in changed(before, snapshot(workdir)) if not _allowed(p)] == []   # no token store made


def test_file_edited_while_it_is_being_tokenised(tmp_path):
    """The hash is checked before the first row and after the last: a mid-read edit is caught too."""
    from glm_lora.data.formats import DataError
    from glm_lora.data.prepare import unchanged_rows
    from glm_lora.artifacts.manifest import sha256_file
    path = _jsonl(tmp_path / "chat.jsonl", CHAT)
    sha = sha256_file(path)

    def rows():
        yield 1
        path.write_text("edited\n")
        yield 2
    with pytest.raises(DataError, match="changed after the data stage read it"):
        list(unchanged_rows(rows(), path, sha, "sft"))


# ---------------------------------------------------------------- weights and checkpoints

def _sft_checkpoints(workdir: Path) -> Path:
    (ckpt,) = (workdir / "runs" / "case" / "checkpoints").glob("sft-*")
    return ckpt


def _train_sft_then_resume_with(workdir: Path, cfg: Path, damage) -> tuple[subprocess.CompletedProcess, dict, dict]:
    proc = _stage(workdir, cfg, "sft")
    assert proc.returncode == 0, proc.stderr[-3000:]
    damage(_sft_checkpoints(workdir))
    before = snapshot(workdir)
    proc = _stage(workdir, cfg, "sft", "--set", "sft.max_steps=8")     # a longer schedule resumes at step 4
    return proc, before, snapshot(workdir)


def test_corrupted_best_weights_stop_the_stage_instead_of_being_carried_forward(run):
    workdir, cfg = run
    proc, before, after = _train_sft_then_resume_with(workdir, cfg, lambda c: _flip_byte(c / "best" / "model.safetensors"))
    assert proc.returncode == USER_ERROR_EXIT
    line = error_line(proc)
    assert "best/model.safetensors" in line and "fail verification" in line and "sha256" in line
    assert [p for p in changed(before, after) if not _allowed(p)] == []      # the published sft/ is untouched


def test_no_verified_checkpoint_stops_instead_of_restarting_over_the_best_weights(run):
    workdir, cfg = run

    def corrupt_every_checkpoint(ckpt: Path) -> None:
        for step in ckpt.glob("step-*"):
            _flip_byte(step / "model.safetensors")
    proc, before, after = _train_sft_then_resume_with(workdir, cfg, corrupt_every_checkpoint)
    assert proc.returncode == USER_ERROR_EXIT
    line = error_line(proc)
    assert "none of the 2 checkpoints" in line and "verifies" in line and "corrupted" in line
    assert [p for p in changed(before, after) if not _allowed(p)] == []      # best/ kept, nothing restarted


def test_one_corrupted_checkpoint_falls_back_to_an_older_one(run):
    workdir, cfg = run

    def corrupt_newest(ckpt: Path) -> None:
        _flip_byte(sorted(ckpt.glob("step-*"))[-1] / "model.safetensors")
    proc, _, _ = _train_sft_then_resume_with(workdir, cfg, corrupt_newest)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping checkpoint" in proc.stderr and "resumed from step 2" in proc.stderr


# ---------------------------------------------------------------- one run per directory

HOLD_LOCK = """
import sys, time
from glm_lora.artifacts.lock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_run_on_the_same_directory_fails_naming_the_holder(run):
    workdir, cfg = run
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(workdir / "runs" / "case")], cwd=REPO,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(workdir)
        proc = _stage(workdir, cfg, "sft")
        assert proc.returncode == USER_ERROR_EXIT
        line = error_line(proc)
        assert "runs/case is in use by another glm-lora run" in line and f"pid {holder.pid}" in line
        assert changed(before, snapshot(workdir)) == []
    finally:
        holder.kill()
        holder.wait()
    assert _stage(workdir, cfg, "sft").returncode == 0      # the kernel dropped the dead holder's lock


def test_leftovers_of_a_crashed_run_are_cleaned_and_a_half_published_artifact_restored(run):
    workdir, cfg = run
    run_dir = workdir / "runs" / "case"
    (run_dir / ".sft.tmp-999999-1").mkdir()                      # a stage build that died
    (run_dir / ".sft.tmp-999999-1" / "half.bin").write_bytes(b"x")
    os.replace(run_dir / "pretrain", run_dir / ".pretrain.old-999999-2")   # killed between the publish renames
    proc = _stage(workdir, cfg, "sft")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restored pretrain from .pretrain.old-999999-2" in proc.stderr
    assert not list(run_dir.glob(".*.tmp-*")) and not list(run_dir.glob(".*.old-*"))
    assert (run_dir / "pretrain" / "manifest.json").is_file()


def test_clean_scratch_never_touches_entries_that_are_not_ours(tmp_path):
    from glm_lora.artifacts.lock import clean_scratch
    for name in (".sft.tmp", ".notes", "sft.tmp-1-2", ".sft.tmp-x-1"):
        (tmp_path / name).mkdir()
    (tmp_path / ".data.old-1-2").write_text("a file, not a directory we made")
    assert clean_scratch(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".sft.tmp", ".notes", "sft.tmp-1-2", ".sft.tmp-x-1", ".data.old-1-2"])


def test_checkpoint_scratch_of_dead_writers_is_removed(tmp_path):
    from glm_lora.engine.checkpoint import CheckpointManager
    for name in (".tmp-best-999999", ".old-best-999999", ".tmp-step-00000004-999999"):
        (tmp_path / name).mkdir()
    (tmp_path / "notes").mkdir()
    assert CheckpointManager(tmp_path).latest() is None
    assert [p.name for p in tmp_path.iterdir()] == ["notes"]


ENGINE_WITHOUT_PREFECT = """
import runpy, sys
sys.argv = ["engine", *sys.argv[1:]]
try:
    runpy.run_module("glm_lora.engine", run_name="__main__")
except SystemExit:
    assert "prefect" not in sys.modules, "the stage imported Prefect"
    raise
"""


def test_a_training_stage_runs_as_a_plain_process_without_prefect(run, tmp_path):
    """`python -m glm_lora.engine sft` (what a multi-process launcher starts): inputs named explicitly, the
    stage's files written into --out, metrics printed; Prefect is never imported."""
    workdir, cfg = run
    run_dir, out = workdir / "runs" / "case", tmp_path / "sft-out"
    out.mkdir()
    inputs = [a for name, stage in (("base", "pretrain"), ("tokenizer", "tokenizer"), ("data", "data"))
              for a in ("--input", f"{name}={run_dir / stage}")]
    proc = subprocess.run([sys.executable, "-c", ENGINE_WITHOUT_PREFECT, "sft", "--config", str(cfg), "--out", str(out),
                           *inputs], cwd=workdir, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    assert metrics["trainable_params"] > 0 and len(metrics["val_losses"]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["adapter.json", "adapter.safetensors", "losses.json",
                                                     "metrics.jsonl"]
