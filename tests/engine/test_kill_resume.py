"""kill -9 anywhere, lose nothing: a pretrain stage killed at random steps (also mid-save) and
resumed must end with bit-identical weights and per-step losses to an uninterrupted run.

CI runs a few kill points; the documented long run uses GLM_LORA_KILL_POINTS=20.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
KILLS = int(os.environ.get("GLM_LORA_KILL_POINTS", "3"))
STEPS = 24
SMALL = {
    "threads": 1, "serve.enabled": False, "tokenizer.vocab_size": 600,
    "data.synthetic.n_pretrain": 300, "data.synthetic.n_sft": 50, "data.synthetic.n_dpo": 20, "data.synthetic.n_eval": 10,
    "model.hidden_size": 64, "model.num_layers": 2, "model.num_heads": 2, "model.num_kv_heads": 1,
    "model.intermediate_size": 128, "model.max_seq_len": 64,
    "pretrain.max_steps": STEPS, "pretrain.batch_size": 4, "pretrain.seq_len": 64, "pretrain.log_every": 4,
    "pretrain.warmup_steps": 2, "sft.seq_len": 64, "dpo.seq_len": 64, "checkpoint.save_every": 2, "checkpoint.save_optimizer_every": 2,
    "checkpoint.keep_last": 2,
}


def _args(runs: Path, run_name: str, extra: dict | None = None) -> list[str]:
    sets = {**SMALL, "runs_dir": str(runs), "run_name": run_name, **(extra or {})}
    return [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}")]


def _stage(name: str, runs: Path, run_name: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    return subprocess.Popen([sys.executable, "-m", "glm_lora.flows.cli", "stage", name, *_args(runs, run_name)],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **popen)


def _run(name: str, runs: Path, run_name: str) -> None:
    p = _stage(name, runs, run_name)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()[-3000:]


def _result(run_dir: Path) -> tuple[dict, list]:
    return load_file(run_dir / "pretrain" / "model.safetensors"), json.loads((run_dir / "pretrain" / "losses.json").read_text())


def _newest_step(run_dir: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in run_dir.glob("checkpoints/pretrain-*/step-*")]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    runs = tmp_path_factory.mktemp("kill")
    for stage in ("data", "tokenizer"):
        _run(stage, runs, "reference")
    _run("pretrain", runs, "reference")
    return runs


def _copy_inputs(runs: Path, run_name: str) -> None:
    import shutil
    for stage in ("data", "tokenizer"):
        shutil.copytree(runs / "reference" / stage, runs / run_name / stage)


def test_kill_minus_9_then_resume_is_bit_identical(prepared):
    runs = prepared
    ref_weights, ref_losses = _result(runs / "reference")
    assert len(ref_losses) == STEPS
    rng = random.Random(int(os.environ.get("GLM_LORA_KILL_SEED", "0")))
    survived = 0
    for i in range(KILLS):
        name = f"killed-{i}"
        _copy_inputs(runs, name)
        kill_after = rng.randint(1, STEPS - 4)      # a checkpoint step to wait for, then a random extra delay
        p = _stage("pretrain", runs, name)
        deadline = time.time() + 120
        while _newest_step(runs / name) < kill_after and p.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(rng.random() * 0.3)              # lands mid-step or mid-save
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
        _run("pretrain", runs, name)                # resume: auto (or nothing left to do)
        weights, losses = _result(runs / name)
        assert losses == ref_losses, f"kill point {i}: loss sequence differs"
        assert weights.keys() == ref_weights.keys()
        for k in weights:
            assert weights[k].equal(ref_weights[k]), f"kill point {i}: {k} differs"
        survived += 1
    assert survived == KILLS


def test_sigterm_saves_and_exits_then_resumes(prepared):
    runs = prepared
    name = "sigterm"
    _copy_inputs(runs, name)
    p = _stage("pretrain", runs, name)
    deadline = time.time() + 120
    while _newest_step(runs / name) < 4 and p.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0 and b"stopped by signal" in err
    stopped_at = _newest_step(runs / name)
    assert stopped_at >= 4
    _run("pretrain", runs, name)
    weights, losses = _result(runs / name)
    assert losses == _result(runs / "reference")[1]
