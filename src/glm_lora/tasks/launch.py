"""Run a training stage on several processes with PyTorch's own launcher, torchrun.

`torchrun_stage(name, cfg, inputs, out_dir, log)` starts `torchrun ... -m glm_lora.engine NAME` (engine/__main__.py)
with the stage's inputs and `out_dir` (the staging directory that build_stage publishes), streams
rank 0's output into `log` (the Prefect task's logger under Prefect) and keeps every rank's
stdout/stderr in `runs/<run>/logs/<stage>-<time>/`. If any rank fails, the stage fails with that
rank's own message: a user error (exit 2, one `error: ` line) stays a user error (not retried),
anything else carries the rank's traceback (retried by Prefect; the stage resumes from its
checkpoint). Several machines: the same command on every node with `dist.nnodes`, `dist.node_rank` and
`dist.rdzv_endpoint`; node R's ranks are R × nproc_per_node onwards, so global rank 0, which writes the stage's
files and prints its metrics, runs on node 0 (tasks/nodes.py says what the other nodes do; docs/multi-gpu.md).
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from glm_lora.configs.errors import UserError
from glm_lora.engine import progress
from glm_lora.engine.dist import nproc_per_node

_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.MULTILINE)


class RankFailed(RuntimeError):
    """A rank of a torchrun stage failed with something other than a user error."""


class RankUserError(UserError):
    """A rank of a torchrun stage stopped on a user error (bad data, bad config...)."""


def torchrun_command(cfg, stage: str, config_file: Path, inputs: dict[str, Path], out_dir: Path,
                     log_dir: Path) -> list[str]:
    d = cfg.dist
    # Static rendezvous: c10d ignores --node-rank and numbers the nodes in its own order (node 1 could hold rank 0);
    # static makes node R's ranks follow dist.node_rank, node 0 host the store, and MASTER_ADDR the endpoint's host.
    rendezvous = (["--standalone"] if d.nnodes == 1 else
                  [f"--nnodes={d.nnodes}", f"--node-rank={d.node_rank}", "--rdzv-backend=static",
                   f"--rdzv-endpoint={d.rdzv_endpoint}", f"--rdzv-id={cfg.run_name}-{stage}",
                   f"--rdzv-conf=timeout={d.node_timeout_s}"])
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node(cfg)}", *rendezvous,
            f"--log-dir={log_dir}", "--tee=3", "--local-ranks-filter=0", "--max-restarts=0",
            "-m", "glm_lora.engine", stage, "--config", str(config_file), "--out", str(out_dir),
            *[a for k, v in inputs.items() for a in ("--input", f"{k}={v}")]]


def torchrun_stage(stage: str, cfg, inputs: dict[str, Path], out_dir: Path, *,
                   log: logging.Logger = logging.getLogger("glm_lora.launch")) -> dict:
    node = f"-node{cfg.dist.node_rank}" if cfg.dist.nnodes > 1 else ""     # the nodes share runs_dir
    log_dir = cfg.run_dir / "logs" / f"{stage}{node}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    config_file = log_dir / "config.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), allow_unicode=True))
    cmd = torchrun_command(cfg, stage, config_file, inputs, Path(out_dir), log_dir)
    log.info("%s: %s", stage, " ".join(cmd[2:]))
    env = dict(os.environ)      # the ranks import the installed glm_lora package (no repository path: no shadowing)
    lines: list[str] = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,   # our cwd: relative paths
                          bufsize=1) as proc:
        for line in proc.stdout:
            line = _strip(line.rstrip("\n"))
            event = progress.from_line(line)
            if event is not None:           # rank 0's training progress: to whoever listens in this process
                progress.report(event)
                continue
            lines.append(line)
            log.info("%s", line)
    if proc.returncode != 0:
        raise _failure(stage, log_dir, "\n".join(lines), cfg.dist.node_rank * nproc_per_node(cfg))
    if cfg.dist.node_rank > 0:
        return {}               # rank 0 runs on node 0, which publishes the stage
    metrics = next((json.loads(m) for m in reversed(lines) if m.startswith("{")), None)
    if metrics is None:
        raise RankFailed(f"{stage}: torchrun finished but rank 0 printed no metrics; logs in {log_dir}")
    return metrics


def _strip(line: str) -> str:
    return re.sub(r"^\[default\d+\]:", "", line)


def _failure(stage: str, log_dir: Path, launcher_output: str, first_rank: int = 0) -> Exception:
    """The failing rank's own message: torchrun's "first observed failure" if it names one. This node's logs are
    kept by local rank; `first_rank` is the global rank of its local rank 0."""
    logs = {first_rank + int(p.parent.name): p for p in log_dir.rglob("stderr.log") if p.parent.name.isdigit()}
    texts = {rank: logs[rank].read_text(errors="replace") for rank in sorted(logs)}
    for rank, text in texts.items():      # a user error anywhere is the cause (the others saw a closed connection)
        user = [ln for ln in text.splitlines() if ln.startswith("error: ")]
        if user:
            return RankUserError(f"rank {rank}: {user[-1].removeprefix('error: ')}")
    root = _ROOT_CAUSE_RANK.search(launcher_output)
    for rank in sorted(texts, key=lambda r: (r != int(root[1]) if root else 0, r)):
        text = texts[rank]
        if "Traceback" in text:
            tail = "\n".join(text[text.rindex("Traceback"):].splitlines()[-25:])
            return RankFailed(f"{stage}: rank {rank} failed (logs in {log_dir}):\n{tail}")
    return RankFailed(f"{stage}: torchrun failed (logs in {log_dir}):\n" + "\n".join(launcher_output.splitlines()[-25:]))
