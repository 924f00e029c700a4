"""One training stage as a plain process, without Prefect:

    python -m engine sft --config tiny --set sft.max_steps=50 \
        --input base=runs/tiny/pretrain --input tokenizer=runs/tiny/tokenizer --input data=runs/tiny/data \
        --out /tmp/sft-out

writes the stage's files into --out (an existing, empty directory) and prints its metrics as JSON.
Publishing (manifest, atomic rename, cache key) is the caller's job: `python -m flows.cli stage sft`
and the flow do it through tasks.cache.build_stage, which is what resolves the inputs of a run.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path

import kernels
from configs import load_config, parse_value
from configs.errors import UserError

TRAINING_STAGES = ("pretrain", "import_base", "sft", "dpo")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=TRAINING_STAGES)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--input", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        overrides = {k: parse_value(v) for k, _, v in (s.partition("=") for s in args.set)}
        cfg = load_config(args.config, overrides)
        inputs = {k: Path(v) for k, _, v in (s.partition("=") for s in args.input)}
        run = importlib.import_module(f"engine.{args.stage}").run
        with kernels.using(cfg.kernels, cfg.attention):
            metrics = run(cfg, inputs, args.out)
    except UserError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    print(json.dumps(metrics, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
