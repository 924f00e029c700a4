"""Training stages under torchrun (engine/dist.py): 2 CPU processes over gloo against one process.

- pretraining with FSDP2 and LoRA SFT with DDP on 2 ranks give the losses and weights of one process
  with the same global batch (fp32; losses within 1e-5 relative, weights within 1e-5 absolute). The
  runs use padded rows of one example (`packing: false`, `batch_size: 1`, `global_batch_size: 2`), so
  the 2 ranks see exactly the rows the one process sees in each step; packed rows are built from each
  rank's own share of the data and so differ from one process's (what the kill test below trains on).
- a 2-rank checkpoint (FSDP2: sharded DCP files; DDP: rank 0's files) resumes in one plain process;
- a rank that raises exits non-zero with its own message on its own stderr (GLM_LORA_TEST_FAIL);
- kill -9 of one rank, then a restart on 2 ranks, ends bit-identical to an uninterrupted 2-rank run;
- inside an FSDP2 model the kernels receive plain tensors, never DTensors, and DPO's adapter-off
  reference reaches the sharded LoRA layers;
- FSDP2 on a MoE base shards the routed experts and matches one process; under the CUDA bf16 rule (taken on
  the CPU) its frozen shards are bf16 and the adapter's fp32, within bf16 rounding of one process.

Every stage input is built once per module with `python -m glm_lora.flows.cli stage`. The machine has 2 cores:
each torchrun here takes both.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from glm_lora.configs.load import load_config
from glm_lora.configs.errors import UserError

REPO = Path(__file__).resolve().parents[2]
CONFIG = {
    "run_name": "inputs", "device": "cpu", "precision": "fp32", "threads": 1,
    "model": {"arch": "qwen3", "hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
              "intermediate_size": 128, "max_seq_len": 64},
    "tokenizer": {"vocab_size": 600},
    "data": {"synthetic": {"n_pretrain": 300, "n_sft": 80, "n_dpo": 20, "n_eval": 8}},
    "pretrain": {"max_steps": 6, "batch_size": 1, "global_batch_size": 2, "seq_len": 64, "packing": False,
                 "log_every": 2, "warmup_steps": 2, "prefetch": 0},
    "sft": {"max_steps": 6, "batch_size": 1, "global_batch_size": 2, "seq_len": 64, "packing": False,
            "log_every": 2, "warmup_steps": 2, "prefetch": 0, "eval_every": 2, "lora": {"r": 4}},
    "dpo": {"seq_len": 64},
    "checkpoint": {"save_every": 2, "save_optimizer_every": 2, "keep_last": 2, "async_save": False},
    "eval": {"max_rows": 4, "max_new_tokens": 4},
    "serve": {"enabled": False},
}
RTOL = 1e-5          # losses: relative; weights: absolute (sums over 2 ranks are added in another order)
# Pretraining validates every 2 steps and takes only a gain of 100 as an improvement: the first validation's
# weights (step 2) are the best ones, kept (gathered whole on rank 0 under FSDP2) and carried to the output.
PRETRAIN = {"pretrain.eval_every": 2, "pretrain.min_delta": 100.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "runs_dir": str(root / "runs")}))
    for stage in ("data", "tokenizer", "pretrain"):
        p = subprocess.run([sys.executable, "-m", "glm_lora.flows.cli", "stage", stage, "--config", str(config)], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
    runs = root / "runs" / "inputs"
    return {"root": root, "config": config, "runs": root / "runs",
            "inputs": {"pretrain": {"tokenizer": runs / "tokenizer", "data": runs / "data"},
                       "sft": {"base": runs / "pretrain", "tokenizer": runs / "tokenizer", "data": runs / "data"}}}


def _command(prepared, stage: str, run_name: str, out: Path, ranks: int | None, sets: dict,
             log_dir: Path | None = None, inputs: dict | None = None) -> list[str]:
    launcher = [] if ranks is None else [
        "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={_free_port()}",
        *([f"--log-dir={log_dir}", "--redirects=3"] if log_dir else [])]
    out.mkdir(parents=True, exist_ok=True)
    args = [a for k, v in {"run_name": run_name, **sets}.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    inputs = [a for k, v in (inputs or prepared["inputs"][stage]).items() for a in ("--input", f"{k}={v}")]
    return [sys.executable, *launcher, "-m", "glm_lora.engine", stage, "--config", str(prepared["config"]), *args, *inputs,
            "--out", str(out)]


def engine(prepared, stage: str, run_name: str, *, ranks: int | None = None, env: dict | None = None,
           log_dir: Path | None = None, inputs: dict | None = None, **sets) -> subprocess.CompletedProcess:
    """`python -m glm_lora.engine STAGE` (ranks None) or `torchrun --nproc_per_node RANKS -m glm_lora.engine STAGE`."""
    out = prepared["root"] / "out" / f"{run_name}-{time.monotonic_ns()}"
    p = subprocess.run(_command(prepared, stage, run_name, out, ranks, sets, log_dir, inputs), cwd=REPO,
                       capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    p.out = out
    return p


def ok(p: subprocess.CompletedProcess) -> dict:
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])      # rank 0's metrics, the last line of stdout


def losses(p) -> list[float]:
    return json.loads((p.out / "losses.json").read_text())


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a, b))


def same_weights(a: Path, b: Path, atol: float = RTOL) -> None:
    wa, wb = load_file(a), load_file(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0, msg=k)


# ---------------------------------------------------------------- one process vs two

@pytest.fixture(scope="module")
def pretrain_runs(prepared):
    one = engine(prepared, "pretrain", "p-one", **PRETRAIN)
    two = engine(prepared, "pretrain", "p-two", ranks=2, **PRETRAIN, **{"checkpoint.async_save": True})
    shutil.copytree(prepared["runs"] / "p-two" / "checkpoints", prepared["runs"] / "p-rot" / "checkpoints")
    return one, two         # (p-rot: the 2-rank checkpoints as they are now, for the corruption test)


def test_pretrain_with_fsdp2_on_two_ranks_matches_one_process(pretrain_runs):
    one, two = pretrain_runs
    m1, m2 = ok(one), ok(two)
    assert sorted(p.name for p in two.out.iterdir()) == sorted(p.name for p in one.out.iterdir()) == [
        "config.json", "losses.json", "metrics.jsonl", "model.safetensors"]
    assert close(losses(two), losses(one)), (losses(two), losses(one))
    same_weights(two.out / "model.safetensors", one.out / "model.safetensors")
    assert (m2["world_size"], m2["strategy"], m2["grad_accum"], m2["global_batch_size"]) == (2, "fsdp2", 1, 2)
    assert m2["tokens_per_s_per_gpu"] == pytest.approx(m2["tokens_per_s"] / 2)
    assert (m1["best_step"], m2["best_step"], m2["last_step"]) == (2, 2, 6)      # and the output holds step 2's
    assert close([v for _, v in m2["val_losses"]], [v for _, v in m1["val_losses"]])
    assert abs(m2["eval"]["loss"] - m1["eval"]["loss"]) < 1e-4          # rank 0 evaluated the gathered model
    window = [json.loads(line) for line in (two.out / "metrics.jsonl").read_text().splitlines()]
    assert [w["step"] for w in window] == [2, 4, 6]                   # rank 0 alone wrote it
    step = next((two.out.parents[1] / "runs" / "p-two" / "checkpoints").glob("pretrain-*/step-00000006"))
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["format"] == "glm-lora-checkpoint-dcp/1" and manifest["world_size"] == 2
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "ranks.json"} <= manifest["files"].keys()


def test_a_two_rank_fsdp2_checkpoint_resumes_in_one_process(prepared, pretrain_runs):
    one, two = pretrain_runs
    resumed = engine(prepared, "pretrain", "p-two", **PRETRAIN, **{"pretrain.max_steps": 8})   # no process group
    assert ok(resumed)["best_step"] == 2                 # the best weights kept by rank 0 came along
    assert "resumed from step 6" in resumed.stderr
    reference = engine(prepared, "pretrain", "p-one", **PRETRAIN, **{"pretrain.max_steps": 8})  # one process
    ok(reference)
    assert losses(resumed)[:6] == losses(two)
    # Padded rows of one example: the data position carries over exactly here (see data/pipeline.py).
    assert close(losses(resumed), losses(reference)), (losses(resumed), losses(reference))
    same_weights(resumed.out / "model.safetensors", reference.out / "model.safetensors")


def test_a_corrupted_shard_is_skipped_like_any_corrupted_checkpoint(prepared, pretrain_runs):
    newest = max(prepared["runs"].glob("p-rot/checkpoints/pretrain-*/step-*"))
    shard = newest / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    resumed = engine(prepared, "pretrain", "p-rot", **PRETRAIN)
    ok(resumed)
    assert f"{shard}: sha256 does not match the manifest" in resumed.stderr
    assert "resumed from step 4" in resumed.stderr and len(losses(resumed)) == 6


def test_a_one_process_checkpoint_resumes_on_two_fsdp2_ranks(prepared, pretrain_runs):
    """Whole tensors (model.safetensors, an optimizer state numbered by parameter) into a sharded model."""
    newest = max(prepared["runs"].glob("p-one/checkpoints/pretrain-*/step-*"))
    saved = json.loads((newest / "trainer_state.json").read_text())
    assert not (newest / "dcp").exists()
    resumed = engine(prepared, "pretrain", "p-one", ranks=2, **PRETRAIN, **{"pretrain.max_steps": saved["step"] + 2})
    ok(resumed)
    assert f"resumed from step {saved['step']}" in resumed.stderr
    assert losses(resumed)[:saved["step"]] == saved["losses"] and len(losses(resumed)) == saved["step"] + 2


@pytest.fixture(scope="module")
def sft_runs(prepared):
    return engine(prepared, "sft", "s-one"), engine(prepared, "sft", "s-two", ranks=2)


def test_lora_sft_with_ddp_on_two_ranks_matches_one_process(sft_runs):
    one, two = sft_runs
    m1, m2 = ok(one), ok(two)
    assert sorted(p.name for p in two.out.iterdir()) == sorted(p.name for p in one.out.iterdir()) == [
        "adapter.json", "adapter.safetensors", "losses.json", "metrics.jsonl"]
    assert (m2["world_size"], m2["strategy"], m2["grad_accum"], m1["trainable_params"]) == (
        2, "ddp", 1, m2["trainable_params"])
    assert close(losses(two), losses(one))
    assert close([v for _, v in m2["val_losses"]], [v for _, v in m1["val_losses"]])   # validation on both ranks
    same_weights(two.out / "adapter.safetensors", one.out / "adapter.safetensors")
    assert m2["eval"]["answer_loss"] == pytest.approx(m1["eval"]["answer_loss"], rel=1e-4)


def test_a_two_rank_ddp_checkpoint_resumes_in_one_process(prepared, sft_runs):
    one, two = sft_runs
    resumed = engine(prepared, "sft", "s-two", **{"sft.max_steps": 8})
    m = ok(resumed)
    assert "resumed from step 6" in resumed.stderr
    assert losses(resumed)[:6] == losses(two) and len(losses(resumed)) == 8
    assert m["val_losses"][:3] == ok(two)["val_losses"] and m["last_step"] == 8



QLORA = {"sft.lora.quantization": "nf4", "sft.max_steps": 4}


@pytest.fixture(scope="module")
def qlora_one(prepared):
    return engine(prepared, "sft", "q-one", **QLORA)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_qlora_sft_on_two_ranks_matches_one_process(prepared, qlora_one, strategy):
    """Each rank quantises the same base weights itself; DDP averages the adapter's gradients as for a plain LoRA, and
    FSDP2 shards the 4-bit codes and scales (frozen integer parameters) and gathers them bit for bit (the FSDP + QLoRA
    combination); rank 0 gathers the trained model for its held-out evaluation."""
    one, two = qlora_one, engine(prepared, "sft", f"q-two-{strategy}", ranks=2, **QLORA, **{"dist.strategy": strategy})
    m1, m2 = ok(one), ok(two)
    assert (m2["world_size"], m2["strategy"]) == (2, strategy)
    assert close(losses(two), losses(one))
    same_weights(two.out / "adapter.safetensors", one.out / "adapter.safetensors")
    assert json.loads((two.out / "adapter.json").read_text())["quantization"] == "nf4"


RL = {"rl.enabled": True, "rl.max_steps": 2, "rl.batch_size": 2, "rl.group_size": 2, "rl.max_new_tokens": 4,
      "rl.seq_len": 64, "rl.log_every": 1, "rl.warmup_steps": 0, "rl.lora.r": 4}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_the_rl_stage_trains_on_two_ranks(prepared, sft_runs, strategy):
    """GRPO under torchrun: each rank samples answers to its own prompts with the weights being trained (under
    FSDP2 the ranks decode in lockstep: a sharded forward is a collective) and the adapter comes out whole."""
    from glm_lora.artifacts.manifest import write_manifest
    from glm_lora.model.adapters import load_policy
    sft = prepared["root"] / f"rl-{strategy}-sft"          # a stage input: the SFT adapter with its manifest
    shutil.copytree(sft_runs[0].out, sft)
    write_manifest(sft, "sft")
    runs = prepared["runs"] / "inputs"
    inputs = {"base": runs / "pretrain", "sft": sft, "dpo": sft, "tokenizer": runs / "tokenizer", "data": runs / "data"}
    p = engine(prepared, "rl", f"rl-{strategy}", ranks=2, inputs=inputs, **RL, **{"dist.strategy": strategy})
    m = ok(p)
    assert (m["world_size"], m["strategy"], m["global_batch_size"], m["step"]) == (2, strategy, 4, 2), m
    lines = [json.loads(x) for x in (p.out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(np.isfinite(x["loss"]) for x in lines)
    assert {k.rsplit(".", 2)[-2] for k in load_file(p.out / "adapter.safetensors")} == {"lora_A", "lora_B"}
    load_policy(inputs["base"], sft, sft, p.out)          # the adapter goes onto its base


def test_sampling_in_lockstep_takes_every_step_and_changes_no_answer():
    """any_running says another rank is still decoding: this one keeps stepping (a forward per step, as the
    sharded model's collectives need) and its finished rows gain no token."""
    from glm_lora.evaluation.decode import sample_decode
    from glm_lora.model import Decoder, DecoderConfig
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=30, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                  intermediate_size=32, max_seq_len=32)).eval()
    calls = []
    model.hidden_states = (lambda f: lambda *a, **k: calls.append(1) or f(*a, **k))(model.hidden_states)
    prompts = [[1, 2, 3], [4, 5]]
    kw = dict(max_new_tokens=8, eos_id=list(range(30)), temperature=1.0)     # every token ends its answer
    with torch.no_grad():
        alone = sample_decode(model, prompts, generator=torch.Generator().manual_seed(3), **kw)
        n_alone, calls[:] = len(calls), []
        waiting = sample_decode(model, prompts, generator=torch.Generator().manual_seed(3),
                                any_running=lambda mine: True, **kw)
    assert alone == waiting and all(len(a) == 1 for a in alone)
    assert n_alone == 1 and len(calls) == 8       # the prompt forward, then one per step while the others decode


# ---------------------------------------------------------------- failures

@pytest.mark.parametrize("kind", ["bug", "user"])
def test_a_rank_that_fails_exits_nonzero_with_its_own_message(prepared, tmp_path, kind):
    spec = "1:3" + (":user" if kind == "user" else "")
    p = engine(prepared, "pretrain", f"fail-{kind}", ranks=2, log_dir=tmp_path,
               env={"GLM_LORA_TEST_FAIL": spec})
    assert p.returncode != 0
    stderr = {int(f.parent.name): f.read_text() for f in tmp_path.rglob("stderr.log")}
    message = f"injected failure on rank 1 at step 3 (GLM_LORA_TEST_FAIL={spec})"
    if kind == "user":       # one line, no traceback, exit status 2 (torchrun names the rank and its status)
        assert [ln for ln in stderr[1].splitlines() if ln.startswith("error: ")] == ["error: " + message]
        assert "Traceback" not in stderr[1]
        assert "exitcode  : 2" in p.stderr
    else:
        assert "Traceback" in stderr[1] and "RuntimeError: " + message in stderr[1]
    assert message not in stderr[0]
    assert not (p.out / "model.safetensors").exists()


# ---------------------------------------------------------------- kill -9 of one rank

KILL = {"pretrain.max_steps": 16, "pretrain.packing": True, "pretrain.batch_size": 2, "pretrain.global_batch_size": None,
        "pretrain.prefetch": 2, "pretrain.eval_every": 6, "checkpoint.async_save": True, "eval.enabled": False}


def _rank_pid(root: int, rank: int) -> int | None:
    """The process below process `root` that runs as `rank` (torchrun's RANK)."""
    for child in psutil.Process(root).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child.pid
        except psutil.Error:
            continue
    return None


def _newest_step(runs: Path, run_name: str) -> int:
    return max((int(p.name.split("-")[1]) for p in (runs / run_name).glob("checkpoints/pretrain-*/step-*")),
               default=0)


def test_kill_minus_9_of_one_rank_then_restart_is_bit_identical(prepared):
    reference = engine(prepared, "pretrain", "kill-ref", ranks=2, **KILL)
    ok(reference)
    rng = random.Random(int(os.environ.get("GLM_LORA_KILL_SEED", "0")))
    kill_after = rng.randint(2, 10)
    out = prepared["root"] / "out" / "killed"
    launcher = subprocess.Popen(_command(prepared, "pretrain", "killed", out, 2, KILL), cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while _newest_step(prepared["runs"], "killed") < kill_after and launcher.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(rng.random() * 0.2)                     # mid-step or mid-save
    victim = _rank_pid(launcher.pid, 1)
    assert victim is not None and launcher.poll() is None, "the run ended before the kill"
    os.kill(victim, signal.SIGKILL)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode != 0, err.decode()[-2000:]
    restarted = engine(prepared, "pretrain", "killed", ranks=2, **KILL)
    ok(restarted)
    assert "resumed from step" in restarted.stderr
    assert losses(restarted) == losses(reference)
    same_weights(restarted.out / "model.safetensors", reference.out / "model.safetensors", atol=0)


# ---------------------------------------------------------------- what the kernels see under FSDP2

KERNEL_CHECK = r'''
import copy, torch, torch.distributed as tdist
from glm_lora.kernels import ops as kernels
from glm_lora.engine import dist
from glm_lora.model.heads import causal_lm_loss, group_logprobs
from glm_lora.engine.trainer import Runtime
from glm_lora.configs.schema import LoRAConfig
from glm_lora.model import Decoder, DecoderConfig, inject_lora, lora_disabled
from torch.distributed.tensor import DTensor

d = dist.init("cpu")
seen = []
def spy(name, fn):
    def wrapped(*args, **kwargs):
        seen.extend((name, type(a).__name__) for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor))
        return fn(*args, **kwargs)
    return wrapped
for name in ("rms_norm", "apply_rope", "swiglu", "lora_linear", "linear_cross_entropy", "linear_token_logprobs",
             "attention", "document_causal_mask"):
    setattr(kernels, name, spy(name, getattr(kernels, name)))
torch.manual_seed(0)
model = Decoder(DecoderConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                              intermediate_size=128, arch="qwen3"))
inject_lora(model, LoRAConfig(target_modules="all-linear", r=4, alpha=8))
for n, p in model.named_parameters():
    if n.endswith("lora_B.weight"):
        torch.nn.init.normal_(p, std=0.05)           # an adapter that changes the output
plain = copy.deepcopy(model)
rt = Runtime(torch.device("cpu"), torch.float32, d)
dist.parallelize(model, causal_lm_loss, "fsdp2", rt)
ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(1))
doc_ids = torch.tensor([[1] * 6 + [2] * 6, [3] * 5 + [4] * 7])
batch = {"input_ids": ids, "labels": ids.clone(), "doc_ids": doc_ids, "packed": True,
         "group_docs": torch.tensor([[1, 2], [3, 4]])}
loss, _ = causal_lm_loss(model, batch)
loss.backward()
assert seen and not [s for s in seen if s[1] == "DTensor"], [s for s in seen if s[1] == "DTensor"]
with torch.no_grad():
    on, _ = group_logprobs(model, batch)
    with lora_disabled(model):
        off, _ = group_logprobs(model, batch)
    plain_on, _ = group_logprobs(plain, batch)
    with lora_disabled(plain):
        plain_off, _ = group_logprobs(plain, batch)
torch.testing.assert_close(on, plain_on, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(off, plain_off, atol=1e-5, rtol=1e-5)
assert (on - off).abs().max() > 1e-3
import json, sys
open(f"{sys.argv[1]}/rank{d.rank}.json", "w").write(json.dumps(sorted({s[0] for s in seen})))
dist.end_rank(0)
'''


def _on_two_ranks(tmp_path, script_text: str, *args: str) -> None:
    """Run a check script under torchrun on two CPU ranks (gloo) with tmp_path and `args` as its arguments; it writes
    rank<N>.json into tmp_path."""
    script = tmp_path / "check.py"
    script.write_text(script_text)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={_free_port()}", str(script), str(tmp_path), *args], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]


def test_kernels_get_plain_tensors_and_the_adapter_switch_reaches_fsdp2_layers(tmp_path):
    _on_two_ranks(tmp_path, KERNEL_CHECK)
    for rank in (0, 1):           # every op the model and losses dispatch was seen, with plain tensors only
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [
            "apply_rope", "attention", "document_causal_mask", "linear_cross_entropy", "linear_token_logprobs",
            "lora_linear", "rms_norm", "swiglu"]


MOE_FSDP2_CHECK = r'''
import copy, json, sys, torch
from glm_lora.engine import dist
from glm_lora.engine.adapter_stage import _frozen_gemm_weights_in_compute_dtype
from glm_lora.model.heads import causal_lm_loss
from glm_lora.engine.trainer import Runtime
from glm_lora.configs.schema import LoRAConfig
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from torch.distributed.tensor import DTensor

d = dist.init("cpu")
dtype = getattr(torch, sys.argv[2])
if dtype == torch.bfloat16:     # the CUDA bf16 rule, on the CPU: frozen weights cast, all-gathers in bf16
    Runtime.weights_in_compute_dtype = property(lambda rt: rt.dtype != torch.float32)
rt = Runtime(torch.device("cpu"), dtype, d)
torch.manual_seed(0)
model = Decoder(DecoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=24,
                              intermediate_size=48, arch="glm4_moe", n_routed_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                              topk_group=1, qk_norm=True, attention_bias=True))
quantization = sys.argv[3]                      # "nf4": the experts in 4 bits, their codes and scales sharded
inject_lora(model, LoRAConfig(target_modules="all-linear", r=4, alpha=8, quantization=quantization))
for n, p in model.named_parameters():
    if n.endswith("lora_B.weight"):
        torch.nn.init.normal_(p, std=0.05)
_frozen_gemm_weights_in_compute_dtype(model, rt)        # as the adapter stage does before fit() shards the model
plain = copy.deepcopy(model)
dist.parallelize(model, causal_lm_loss, "fsdp2", rt)
experts = model.model.layers[1].mlp.experts
shards = (list(experts.base_layer.gate_up_proj.parameters()) if quantization == "nf4"
          else [experts.base_layer.gate_up_proj])
assert len(shards) == (6 if quantization == "nf4" else 1)
for stacked in shards:                          # experts split over ranks (the code tables: 16 and 256 entries)
    assert isinstance(stacked, DTensor), stacked.shape
frozen = {n: p.to_local().dtype for n, p in model.named_parameters() if not p.requires_grad}
if quantization == "nf4":
    assert shards[0].to_local().shape[0] == 8 // d.world_size and frozen[
        "model.layers.1.mlp.experts.base_layer.down_proj.packed"] == torch.uint8
else:
    assert shards[0].to_local().shape[0] == 8 // d.world_size
    assert frozen["model.layers.1.mlp.experts.base_layer.down_proj"] == frozen["lm_head.weight"] == dtype, frozen
assert frozen["model.embed_tokens.weight"] == torch.float32                 # not a GEMM weight: kept fp32
assert {p.to_local().dtype for p in model.parameters() if p.requires_grad} == {torch.float32}   # the adapter's shards
ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(1))
batch = {"input_ids": ids, "labels": ids.clone(), "doc_ids": torch.tensor([[1] * 6 + [2] * 6, [3] * 5 + [4] * 7]),
         "packed": True}
for m in (model, plain):
    with rt.autocast():
        loss, _ = causal_lm_loss(m, batch)
    loss.backward()
    m.loss = loss
grad = experts.down_proj.lora_A.weight.grad.full_tensor()
plain_grad = plain.model.layers[1].mlp.experts.down_proj.lora_A.weight.grad
if dtype == torch.bfloat16:     # bf16 rounding apart: FSDP2 gathers norms, router and embeddings in bf16 too
    torch.testing.assert_close(model.loss, plain.loss, atol=0, rtol=1e-3)
    torch.testing.assert_close(grad, plain_grad, atol=2 ** -5 * float(plain_grad.abs().max()), rtol=0)
else:
    torch.testing.assert_close(model.loss, plain.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, plain_grad, atol=1e-5, rtol=1e-4)
assert all(p.grad is None for p in experts.base_layer.parameters())
open(f"{sys.argv[1]}/rank{d.rank}.json", "w").write(json.dumps({"loss": float(model.loss)}))
dist.end_rank(0)
'''


@pytest.mark.parametrize("dtype, quantization", [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "nf4")])
def test_fsdp2_shards_the_routed_experts_and_matches_one_process(tmp_path, dtype, quantization):
    """A GLM-4.5-style MoE with LoRA on every projection under FSDP2 on two ranks: each rank holds half the
    experts (the stacked expert weights — with nf4 their 4-bit codes and scales — shard on the expert dim), and the
    loss and the experts' LoRA gradients equal one process's. bfloat16: the CUDA bf16 rule taken on the CPU (frozen
    GEMM weights sharded in bf16, the adapter's shards fp32, all-gathers in bf16)."""
    _on_two_ranks(tmp_path, MOE_FSDP2_CHECK, dtype, quantization)
    losses = [json.loads((tmp_path / f"rank{r}.json").read_text())["loss"] for r in (0, 1)]
    assert losses[0] == losses[1]


MTP_FSDP2_CHECK = r'''
import copy, json, sys, torch
from glm_lora.engine import dist
from glm_lora.engine.losses import WithMTP
from glm_lora.engine.trainer import Runtime
from glm_lora.configs.schema import LoRAConfig
from glm_lora.model import Decoder, DecoderConfig, inject_lora, mtp
from glm_lora.model.heads import causal_lm_loss

d = dist.init("cpu")
torch.manual_seed(0)
model = Decoder(DecoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                              intermediate_size=48, num_nextn_predict_layers=1))
mtp.attach(model, fresh=True)
inject_lora(model, LoRAConfig(target_modules="all-linear", r=4, alpha=8))
for n, p in model.named_parameters():
    if n.endswith("lora_B.weight"):
        torch.nn.init.normal_(p, std=0.05)
plain = copy.deepcopy(model)
loss_fn = WithMTP(causal_lm_loss, 0.3)
dist.parallelize(model, loss_fn, "fsdp2", Runtime(torch.device("cpu"), torch.float32, d))
ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(1))
batch = {"input_ids": ids, "labels": ids.clone(), "doc_ids": torch.tensor([[1] * 6 + [2] * 6, [3] * 5 + [4] * 7]),
         "position_ids": torch.tensor([list(range(6)) * 2, list(range(5)) + list(range(7))]), "packed": True}
for m in (model, plain):
    loss, _ = loss_fn(m, batch)
    loss.backward()
    m.loss = loss
torch.testing.assert_close(model.loss, plain.loss, atol=1e-5, rtol=1e-5)
for path in ("mtp.2.eh_proj", "mtp.2.self_attn.q_proj", "model.layers.0.self_attn.q_proj"):
    grad = model.get_submodule(path).lora_B.weight.grad
    torch.testing.assert_close(grad.full_tensor(), plain.get_submodule(path).lora_B.weight.grad, atol=1e-5, rtol=1e-4)
open(f"{sys.argv[1]}/rank{d.rank}.json", "w").write(json.dumps({"loss": float(model.loss)}))
dist.end_rank(0)
'''


def test_fsdp2_trains_the_mtp_layer_like_one_process(tmp_path):
    """`mtp: train` under FSDP2 (the MTP layer in the root unit, whose weights stay gathered after the forward): the
    loss with the MTP term and the LoRA gradients of the MTP layer and of the main model equal one process's."""
    _on_two_ranks(tmp_path, MTP_FSDP2_CHECK)
    losses = [json.loads((tmp_path / f"rank{r}.json").read_text())["loss"] for r in (0, 1)]
    assert losses[0] == losses[1]


# ---------------------------------------------------------------- batch math (no processes)

def test_batch_math_derives_grad_accum_and_names_the_keys():
    from glm_lora.engine import dist
    cfg = load_config("tiny", {"sft.batch_size": 4, "sft.global_batch_size": 32, "dist.nproc_per_node": "auto",
                               "device": "cpu"})
    assert dist.nproc_per_node(cfg) == 1 and dist.world_size(cfg) == 1
    assert dist.grad_accum(cfg, "sft", 1) == 8 and dist.grad_accum(cfg, "sft", 4) == 2
    plan = dist.check(cfg, world=4)
    assert plan["sft"] == {"strategy": "ddp", "world_size": 4, "grad_accum": 2, "global_batch_size": 32,
                           "tokens_per_step": 32 * cfg.sft.seq_len}
    assert plan["pretrain"]["strategy"] == "fsdp2" and plan["pretrain"]["grad_accum"] == cfg.pretrain.grad_accum
    with pytest.raises(UserError, match=r"sft.global_batch_size \(32\) is not a multiple of sft.batch_size \(4\) × "
                                        r"world size \(3"):
        dist.check(cfg, world=3)
    with pytest.raises(UserError, match="sft.grad_accum .* sft.global_batch_size"):
        load_config("tiny", {"sft.global_batch_size": 32, "sft.grad_accum": 2})
    with pytest.raises(UserError, match="dpo.global_batch_size"):      # an int nproc_per_node: at load time
        load_config("tiny", {"dist.nproc_per_node": 3, "dpo.global_batch_size": 16, "dpo.batch_size": 8})
    with pytest.raises(UserError, match="precision fp16 .* fsdp2"):
        dist.check(load_config("tiny", {"precision": "fp16"}), world=2)
    assert dist.strategy_for(load_config("tiny", {"dist.strategy": "fsdp2"}), "sft") == "fsdp2"
    assert "rl" not in plan and dist.strategy_for(cfg, "rl") == "ddp"          # a LoRA stage: replicated
    rl = load_config("tiny", {"rl.enabled": True, "rl.batch_size": 4, "rl.global_batch_size": 16})
    assert dist.check(rl, world=2)["rl"]["grad_accum"] == 2
    with pytest.raises(UserError, match="rl.global_batch_size"):
        dist.check(rl, world=3)
