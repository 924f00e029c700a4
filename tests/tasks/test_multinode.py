"""Two nodes on one machine (docs/multi-gpu.md "Several machines"): dist.nnodes 2, one process per node, gloo.

Each node is a thread running a Prefect flow of the stage tasks themselves (tasks/stages.py, with their retries),
called in order as the glm-lora flow's run_chain calls them, with its own config (dist.node_rank 0 or 1, rendezvous
on 127.0.0.1); the whole glm-lora flow would add DPO and the export to CI for no other code. Node 0 builds the inputs
while node 1 waits for them, then each node's torchrun agent (tasks/launch.py) starts its rank and the two meet. The
stage is LoRA SFT under FSDP2 on a tiny GLM-4.5-style mixture of experts, on padded rows of one example
(`packing: false`, `batch_size: 1`, `global_batch_size: 2`), so the two ranks see the rows one process sees in each
step (tests/engine/test_dist.py).

- the two nodes' losses equal one process's within 1e-6 relative, and only node 0 publishes;
- kill -9 of node 1's rank fails the stage on both nodes; each node's task retries it, and the retries meet again and
  resume from the last checkpoint to the adapter and losses of an uninterrupted two-node run.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from prefect import flow
from safetensors.torch import load_file

from glm_lora.configs.load import load_config
from glm_lora.tasks.cache import build_stage
from glm_lora.tasks.table import upstream
from tests.engine.test_dist import _rank_pid
from tests.test_dag import _free_port, _glm45_base, _user_files

RTOL = 1e-6
SFT = {"max_steps": 8, "batch_size": 1, "global_batch_size": 2, "seq_len": 64, "packing": False, "log_every": 1,
       "warmup_steps": 2, "prefetch": 0, "eval_every": 0, "compile": "off", "lora": {"r": 4, "modules_to_save": []}}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The data, tokenizer and base stages of run `two-nodes`, built by node 0 while node 1 waits for them."""
    from prefect.testing.utilities import prefect_test_harness
    root = tmp_path_factory.mktemp("multinode")
    sft, dpo = _user_files(root)
    base, _ = _glm45_base(root / "base")
    overrides = {"runs_dir": str(root / "runs"), "base_model": str(base), "data.sft": str(sft), "data.dpo": str(dpo),
                 "device": "cpu", "precision": "fp32", "threads": 1, "serve.enabled": False, "sft": SFT,
                 "dpo.seq_len": 64, "eval.enabled": False, "dist.strategy": "fsdp2",
                 "checkpoint": {"save_every": 2, "save_optimizer_every": 2, "keep_last": 2, "async_save": False}}
    with prefect_test_harness(server_startup_timeout=120):
        refs = ok(on_two_nodes(overrides, "two-nodes", ("data", "tokenizer", "import_base"), {}))
        assert refs[0] == refs[1]
        yield {"overrides": overrides, "root": root, "inputs": refs[0]}


def node_config(overrides: dict, run_name: str, node_rank: int, port: int):
    return load_config("tiny", {"dist.nnodes": 2, "dist.rdzv_endpoint": f"127.0.0.1:{port}", "dist.node_timeout_s": 120,
                                **overrides, "run_name": run_name, "dist.node_rank": node_rank})


@flow(name="glm-lora-node-stages")
def node_stages(cfg, stages: tuple[str, ...], refs: dict) -> dict:
    """One node's stage tasks, in order: what run_chain (flows/glm_lora.py) does for them."""
    from glm_lora.tasks.stages import TASKS
    mine = dict(refs)
    for name in stages:
        state = TASKS[name](cfg, {key: mine[stage] for key, stage in upstream(name, cfg).items()}, return_state=True)
        mine[name] = state.result()
    return mine


def on_two_nodes(overrides: dict, run_name: str, stages: tuple[str, ...], refs: dict) -> list:
    """Both nodes' `node_stages` at once; per node: its refs by stage name, or what it raised."""
    port, results = _free_port(), [None, None]

    def node(rank: int) -> None:
        try:
            results[rank] = node_stages(node_config(overrides, run_name, rank, port), stages, refs)
        except Exception as e:      # noqa: BLE001 -- the test looks at it
            results[rank] = e

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (1, 0)]     # node 1 first: it must wait
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


def ok(results: list) -> list[dict]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def losses(run_dir: Path) -> list[float]:
    return json.loads((run_dir / "sft" / "losses.json").read_text())


@pytest.fixture(scope="module")
def two_nodes(prepared):
    return ok(on_two_nodes(prepared["overrides"], "two-nodes", ("sft",), prepared["inputs"]))


def test_two_nodes_train_as_one_process_and_only_node_0_publishes(prepared, two_nodes):
    runs = prepared["root"] / "runs"
    node_stages(load_config("tiny", {**prepared["overrides"], "run_name": "one"}), ("sft",), prepared["inputs"])
    assert two_nodes[0]["sft"] == two_nodes[1]["sft"]
    manifest = json.loads((runs / "two-nodes" / "sft" / "manifest.json").read_text())
    assert (manifest["metrics"]["world_size"], manifest["metrics"]["strategy"]) == (2, "fsdp2")
    assert manifest["config"]["run"]["dist"]["node_rank"] == 0
    two, single = losses(runs / "two-nodes"), losses(runs / "one")
    assert len(two) == len(single) == SFT["max_steps"]
    assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(two, single)), (two, single)
    w2, w1 = (load_file(runs / r / "sft" / "adapter.safetensors") for r in ("two-nodes", "one"))
    assert w2.keys() == w1.keys() and any(".experts." in k for k in w2)
    for k in w2:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=0, msg=k)
    logs = sorted(p.name.split("-")[1] for p in (runs / "two-nodes" / "logs").glob("sft-node*"))
    assert logs == ["node0", "node1"]                          # each node's ranks' logs apart
    assert not [p.name for p in (runs / "two-nodes").iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def _newest_step(run_dir: Path) -> int:
    return max((int(p.name.split("-")[1]) for p in run_dir.glob("checkpoints/sft-*/step-*")), default=0)


def test_a_killed_node_fails_the_stage_on_both_and_their_retries_resume_to_the_same_adapter(prepared, two_nodes):
    run_dir, results = prepared["root"] / "runs" / "killed", []
    runner = threading.Thread(target=lambda: results.extend(
        on_two_nodes(prepared["overrides"], "killed", ("sft",), prepared["inputs"])))
    runner.start()
    deadline = time.time() + 120
    while _newest_step(run_dir) < 2 and runner.is_alive() and time.time() < deadline:
        time.sleep(0.01)
    victim = _rank_pid(os.getpid(), 1)         # below node 1's torchrun agent
    assert victim is not None and runner.is_alive(), "the run ended before the kill"
    os.kill(victim, signal.SIGKILL)
    runner.join(timeout=300)
    assert ok(results)[0]["sft"] == results[1]["sft"]
    for node in (0, 1):         # two attempts on each node, node 0's second one resumed
        ranks = [p.read_text() for p in (run_dir / "logs").glob(f"sft-node{node}-*/*/attempt_0/0/stderr.log")]
        assert len(ranks) == 2 and sum("resumed from step" in text for text in ranks) == (node == 0), node
    reference = prepared["root"] / "runs" / "two-nodes"
    assert losses(run_dir) == losses(reference)
    w, ref = (load_file(d / "sft" / "adapter.safetensors") for d in (run_dir, reference))
    assert w.keys() == ref.keys() and all(torch.equal(w[k], ref[k]) for k in w)


# ---------------------------------------------------------------- no processes

def test_node_1_waits_for_node_0_at_most_node_timeout_s(tmp_path):
    from glm_lora.tasks.nodes import NodeZeroMissing
    cfg = node_config({"runs_dir": str(tmp_path), "dist.node_timeout_s": 1}, "alone", 1, _free_port())
    start = time.monotonic()
    with pytest.raises(NodeZeroMissing, match=r"data: node 0 published no .* within dist.node_timeout_s \(1 s\)"):
        build_stage("data", cfg, {})
    assert 1 <= time.monotonic() - start < 5 and not (tmp_path / "alone" / "data").exists()


def test_every_rank_must_run_rank_0s_config():
    """engine/dist.py check_same_config, with the all-gather of two ranks played here."""
    from glm_lora.configs.errors import UserError
    from glm_lora.engine.dist import check_same_config

    class TwoRanks:
        def __init__(self):
            self.first = None

        def all_gather(self, obj):
            self.first = self.first or obj
            return [self.first, obj]

    ranks = TwoRanks()
    check_same_config(node_config({}, "same", 0, 1), ranks)                 # rank 0
    check_same_config(node_config({}, "same", 1, 1), ranks)                 # only dist.node_rank differs
    with pytest.raises(UserError, match=r"rank 1 runs another config than rank 0 \(sft.seed: 7 there, 0 on rank 0\)"):
        check_same_config(node_config({"sft.seed": 7}, "same", 1, 1), ranks)


def test_each_node_takes_a_lock_of_its_own_and_only_node_0_cleans_the_run_directory(tmp_path):
    from glm_lora.artifacts.lock import run_lock, take_flock
    scratch = tmp_path / ".sft.tmp-999999-1"          # left by a dead writer
    scratch.mkdir()
    with run_lock(tmp_path, node_rank=1):
        assert scratch.is_dir()
        second, holder = take_flock(tmp_path / ".lock-node1")        # another node-1 run of this directory
        assert second is None and f"pid {os.getpid()}" in holder
        with run_lock(tmp_path):                                    # node 0's run is not kept out
            assert not scratch.exists()
