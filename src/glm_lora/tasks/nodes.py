"""What a node other than node 0 does for each stage of a run on several machines (dist.node_rank > 0).

Node 0 builds and publishes every artifact of the run (global rank 0, which writes a training stage's files, runs
there: tasks/launch.py). The other nodes run the same flow on the same runs_dir and publish nothing: a stage
node 0 will reuse is reused; a training stage is trained along (this node's ranks under torchrun) and then
node 0's publication of it is waited for; any other stage (data, tokenizer, import_base) is only waited for. A
publication counts once its manifest carries the stage's cache key and is not the one that was there before.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

from glm_lora.artifacts import manifest as artifacts
from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import Config
from glm_lora.tasks.table import DISTRIBUTED

POLL_S = 0.25       # a stat of the manifest: cheap, also on a network filesystem


class NodeZeroMissing(UserError):
    """Node 0 did not publish a stage this node needs within dist.node_timeout_s."""


def follows(cfg: Config) -> bool:
    """Whether this process is a node other than node 0 of a run on several machines."""
    return cfg.dist.nnodes > 1 and cfg.dist.node_rank > 0


def follow(name: str, cfg: Config, dirs: dict[str, Path], out: Path, key: str, *, force: bool,
           reusable, log: logging.Logger) -> tuple[artifacts.ArtifactRef, bool]:
    """This node's part of stage `name` (published by node 0 at `out` under `key`): (ref, reused) as build_stage
    returns them; `reusable(out, key)` is build_stage's own test, so both nodes decide alike."""
    before = _stamp(out)
    if not force and reusable(out, key):       # node 0 reuses it too: nobody trains
        return artifacts.ref_for(out), True
    trained = name in DISTRIBUTED
    if trained:
        from glm_lora.tasks.launch import torchrun_stage
        with tempfile.TemporaryDirectory(prefix=f"glm-lora-{name}-node{cfg.dist.node_rank}-") as unused:
            torchrun_stage(name, cfg, dirs, Path(unused), log=log)     # only rank 0 (node 0) writes the files
    log.info("%s: waiting for node 0 to publish %s", name, out)
    deadline, seen = time.monotonic() + cfg.dist.node_timeout_s, before
    while True:
        stamp = _stamp(out)
        if stamp != seen:               # a new publication: verified once, not at every poll
            if reusable(out, key):
                break
            seen = stamp
        if time.monotonic() > deadline:
            raise NodeZeroMissing(
                f"{name}: node 0 published no {out} for this config within dist.node_timeout_s "
                f"({cfg.dist.node_timeout_s} s); is node 0's run going, with the same config and runs_dir?")
        time.sleep(POLL_S)
    return artifacts.ref_for(out), not trained


def _stamp(out: Path) -> tuple | None:
    """Which publication `out` holds: each one is a new directory renamed into place, so a new manifest file."""
    try:
        st = os.stat(Path(out) / artifacts.MANIFEST)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns
