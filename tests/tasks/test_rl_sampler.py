"""rl.sampler vllm (tasks/rl_sampler.py): the RL stage's answers sampled by a real vLLM server (the CPU build here),
the adapter synced into it after each update without a restart, the server gone when the stage ends or dies."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from glm_lora.artifacts.manifest import write_manifest
from glm_lora.configs.load import load_config
from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import Config, LoRAConfig
from glm_lora.data.prepare import prepare_data, split_path
from glm_lora.data.tokenizer import end_of_turn_ids, load_tokenizer, train_tokenizer
from glm_lora.engine import rl
from glm_lora.evaluation.decode import greedy_decode
from glm_lora.engine.rollouts import Rollouts
from glm_lora.engine.trainer import Runtime
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from glm_lora.model.adapters import load_policy, save_adapter
from glm_lora.model.hf import save_native
from glm_lora.model.lora import lora_modules
from glm_lora.serve import vllm_server as vs
from glm_lora.tasks import rl_sampler


def _vllm_missing() -> str:
    try:
        vs.vllm_python()
    except FileNotFoundError as e:
        return str(e)
    return ""


def NEEDS_VLLM(test):   # noqa: N802 - reads as the marker it is
    return pytest.mark.vllm(pytest.mark.skipif(bool(_vllm_missing()), reason=_vllm_missing())(test))


SMALL = {"serve.enabled": False, "eval.enabled": False, "data.synthetic.n_pretrain": 200, "data.synthetic.n_sft": 60,
         "data.synthetic.n_dpo": 10, "data.synthetic.n_eval": 20, "rl.batch_size": 3, "rl.group_size": 4,
         "rl.max_new_tokens": 6, "rl.seq_len": 96, "rl.log_every": 1, "rl.sampler": "vllm",
         "rl.lora": {"r": 8, "alpha": 16}, "checkpoint.save_every": 2}


def _overrides(d: Path, **over) -> dict:
    return {"runs_dir": str(d / "runs"), **SMALL, **over}


def _cfg(d: Path, **over) -> Config:
    return load_config("tiny", _overrides(d, **over))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run's inputs to the RL stage: data, tokenizer, a random base whose head_dim (32) vLLM's CPU attention takes,
    and empty SFT / DPO adapters."""
    d = tmp_path_factory.mktemp("rl-vllm-run")
    cfg = _cfg(d)
    prepare_data(cfg.data, d / "data")
    tok = load_tokenizer(train_tokenizer([split_path(d / "data", "pretrain")], d / "tokenizer", vocab_size=700))
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                  intermediate_size=128, max_seq_len=128))
    save_native(model, d / "pretrain")
    for stage in ("sft", "dpo"):
        inject_lora(model, LoRAConfig(r=2))
        (d / stage).mkdir()
        save_adapter(model, LoRAConfig(r=2), d / stage)
    for stage in ("data", "tokenizer", "pretrain", "sft", "dpo"):
        write_manifest(d / stage, stage)
    return d


def _inputs(d: Path) -> dict[str, Path]:
    return {"base": d / "pretrain", "sft": d / "sft", "dpo": d / "dpo", "tokenizer": d / "tokenizer", "data": d / "data"}


def test_vllm_sampler_is_wired_only_where_it_can_run(run_dir, tmp_path):
    # python -m glm_lora.engine rl (and torchrun) call engine/rl.py without the sampler: a clear error, no server
    with pytest.raises(UserError, match="rl.sampler vllm runs in one process"):
        rl.run(_cfg(tmp_path), _inputs(run_dir), tmp_path / "out")
    with pytest.raises(UserError, match="runs in one process, and this config runs 2"):
        rl_sampler.sampler_for(_cfg(tmp_path, **{"dist.nproc_per_node": 2}), None, run_dir / "tokenizer")
    with pytest.raises(UserError, match="rl.lora.quantization nf4"):
        rl_sampler.VLLMSampler(_cfg(tmp_path, **{"rl.lora": {"r": 8, "quantization": "nf4"}}), None,
                               run_dir / "tokenizer")
    assert rl_sampler.sampler_for(_cfg(tmp_path, **{"rl.sampler": "ours"}), None, run_dir / "tokenizer") is None


@NEEDS_VLLM
def test_vllm_answers_are_the_policys_and_each_update_is_loaded_without_a_restart(run_dir):
    cfg = _cfg(run_dir)
    tok = load_tokenizer(run_dir / "tokenizer")
    policy = load_policy(run_dir / "pretrain", run_dir / "sft", run_dir / "dpo")
    sampler = rl_sampler.VLLMSampler(cfg, policy, run_dir / "tokenizer")
    pid = sampler.server.pid
    try:
        inject_lora(policy, cfg.rl.lora)
        prompts = [r["ids"] for r in Rollouts(cfg, tok, run_dir / "data", policy,
                                              Runtime(torch.device("cpu"), torch.float32)).rows[:6]]
        stop = end_of_turn_ids(tok)
        seen = []
        for trial in range(2):          # two different policy updates, each loaded in place into the same server
            g = torch.Generator().manual_seed(trial)
            for m in lora_modules(policy).values():
                m.lora_A.weight.data = torch.randn(m.lora_A.weight.shape, generator=g) * 0.5
                m.lora_B.weight.data = torch.randn(m.lora_B.weight.shape, generator=g) * 0.5
            sampler.sync(policy)
            ours = greedy_decode(policy.eval(), prompts, max_new_tokens=6, eos_id=stop)
            theirs = sampler.sample(prompts, n=1, max_new_tokens=6, temperature=0.0, seed=0)
            assert theirs == ours, f"update {trial}: vLLM's greedy answers are not the policy's"
            seen.append(theirs)
        assert seen[0] != seen[1]               # the second update changed what vLLM samples
        assert sampler.server.pid == pid and vs.is_running(pid)
        assert sorted(p.name for p in sampler.work.glob("policy-*")) == ["policy-2"]    # older adapters removed

        a = sampler.sample(prompts[:2], n=4, max_new_tokens=6, temperature=1.0, seed=7)
        b = sampler.sample(prompts[:2], n=4, max_new_tokens=6, temperature=1.0, seed=7)
        assert a == b and len(a) == 8 and len({tuple(x) for x in a}) > 1    # seeded, and not one answer 8 times
        assert all(1 <= len(x) <= 6 and (len(x) == 6 or x[-1] in stop) for x in a)   # a finished answer ends in stop
        assert all(t not in stop for x in a for t in x[:-1])
    finally:
        sampler.close()
    assert not vs.is_running(pid) and not sampler.work.exists()


@NEEDS_VLLM
def test_stage_killed_mid_run_stops_its_server_and_resumes_with_vllm_rollouts(run_dir, tmp_path):
    """The rl stage with vLLM rollouts, killed -9 after its step-2 checkpoint: the watchdog stops its server; run
    again, it removes the dead run's files, resumes, trains to the end and leaves no server or file behind."""
    over = _overrides(tmp_path, **{"rl.max_steps": 5, "checkpoint.save_optimizer_every": 2,
                                   "checkpoint.async_save": False, "threads": 1})
    code = ("import json, logging, sys; from pathlib import Path; from glm_lora.configs.load import load_config; "
            "from glm_lora.tasks.rl_sampler import rl_stage; logging.basicConfig(level=logging.INFO); "
            "d, out = Path(sys.argv[1]), Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True); "
            "m = rl_stage(load_config('tiny', json.loads(sys.argv[3])), "
            "{s: d / s for s in ('data', 'tokenizer', 'sft', 'dpo')} | {'base': d / 'pretrain'}, out); "
            "print(json.dumps({k: m[k] for k in ('step', 'reward_mean', 'sampler')}))")

    def start(name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code, str(run_dir), str(tmp_path / name), json.dumps(over)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    run_root = tmp_path / "runs" / "tiny"
    killed = start("first")
    deadline = time.time() + 240
    while not list(run_root.glob("checkpoints/rl-*/step-00000002")) and time.time() < deadline:
        assert killed.poll() is None, killed.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    [work] = run_root.glob(rl_sampler.WORK_PREFIX + "*")
    server = json.loads((work / "server.json").read_text())["pid"]
    assert vs.is_running(server)
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    deadline = time.time() + 60
    while vs.is_running(server) and time.time() < deadline:
        time.sleep(0.2)
    assert not vs.is_running(server), "the killed stage's vLLM server is still running"

    again = start("second")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err.decode()[-3000:]
    m = json.loads(out.decode().strip().splitlines()[-1])
    assert m["step"] == 5 and m["sampler"] == "vllm" and 0 <= m["reward_mean"] <= 2
    assert "resum" in err.decode().lower()              # it continued from the checkpoint, not from step 0
    assert not list(run_root.glob(rl_sampler.WORK_PREFIX + "*"))   # the dead run's files and its own: removed
    assert (tmp_path / "second" / "adapter.safetensors").is_file()
