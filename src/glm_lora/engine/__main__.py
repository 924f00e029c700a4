"""One training stage as a plain process, without Prefect:

    python -m glm_lora.engine sft --config tiny --set sft.max_steps=50 \
        --input base=runs/tiny/pretrain --input tokenizer=runs/tiny/tokenizer --input data=runs/tiny/data \
        --out /tmp/sft-out

writes the stage's files into --out (an existing, empty directory) and prints its metrics as JSON.
Publishing (manifest, atomic rename, cache key) is the caller's job: `python -m glm_lora.flows.cli stage sft`
and the flow do it through tasks.cache.build_stage, which is what resolves the inputs of a run.

Under torchrun (WORLD_SIZE set; engine/dist.py) every process runs this with the same arguments:

    torchrun --nproc_per_node 2 -m glm_lora.engine pretrain --config run.yaml --input tokenizer=... --input data=... --out DIR

Each joins the process group (NCCL on CUDA, one GPU per rank; gloo on CPU), checks the batch math for
its world size, and runs the stage on its share of the data; only rank 0 writes into --out (exactly the
files one process writes) and prints the metrics, the others wait for it at a barrier. A rank that fails
exits non-zero with its own error: a user error as one `error: ` line and exit status 2, anything else
with its traceback (torchrun then stops the other ranks).
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path

from glm_lora.kernels import ops as kernels
from glm_lora.configs.load import load_config, parse_value
from glm_lora.configs.errors import UserError
from glm_lora.engine import dist, progress
from glm_lora.engine.trainer import Runtime

TRAINING_STAGES = ("pretrain", "import_base", "sft", "dpo", "rl")
ONE_PROCESS = ("import_base",)      # no training loop: under torchrun rank 0 does it, the others wait


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm_lora.engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=TRAINING_STAGES)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--input", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    d = None
    try:
        overrides = {k: parse_value(v) for k, _, v in (s.partition("=") for s in args.set)}
        cfg = load_config(args.config, overrides)
        inputs = {k: Path(v) for k, _, v in (s.partition("=") for s in args.input)}
        if dist.launched():
            d = dist.init(Runtime.resolve(cfg.device, cfg.precision).device.type)
            if not d.main:      # rank 0 speaks for all; the others only warn
                logging.getLogger().setLevel(logging.WARNING)
            dist.check(cfg, d.world_size)
            dist.check_same_config(cfg, d)
        run = importlib.import_module(f"glm_lora.engine.{args.stage}").run
        with kernels.using(cfg.kernels, cfg.attention), progress.listening(lambda e: print(progress.as_line(e),
                                                                                         flush=True)):
            metrics = run(cfg, inputs, args.out) if d is None or d.main or args.stage not in ONE_PROCESS else {}
        if d is not None:
            d.barrier()         # the other ranks wait for rank 0's held-out evaluation and files
    except UserError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        if d is not None:
            dist.end_rank(2)
        return 2
    if d is None or d.main:
        print(json.dumps(metrics, default=str))
    if d is not None:
        dist.end_rank(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
