"""Command line: `python -m glm_lora.flows.cli run` runs the whole flow in-process (Prefect, no deployment);
`python -m glm_lora.flows.cli status` says, per stage, whether the next run reuses it and if not, why;
`python -m glm_lora.flows.cli stage NAME` runs one stage's plain function without Prefect, reading its
inputs from the run directory (the stage table, tasks/table.py, says which) — for debugging; it
imports no Prefect. `python -m glm_lora.flows.cli serve status|stop|promote` manages the configured run's served
endpoint (serve/deploy.py): `promote --export DIR` (or `--previous`) puts an export on it through the
blue/green path, e.g. to go back to yesterday's model. `harness --url URL --model NAME --tasks T` runs
lm-evaluation-harness tasks against a served endpoint (evaluation/harness.py). `relocate EXPORT_DIR` points a copied
export's adapters at the copy's own base models (they name their bases by absolute path, so PEFT's one-liners load
them from anywhere). `config [KEY]` prints every config key with its default, or one key's (or section's) type,
allowed values, default and description (`config --markdown` writes docs/config.md).

Overrides use dotted keys: `--set sft.max_steps=50 --set sft.lora.r=32`.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from glm_lora.artifacts import manifest as artifacts
from glm_lora.artifacts.lock import run_lock
from glm_lora.configs.load import ConfigError, load_config, parse_value
from glm_lora.configs.errors import UserError
from glm_lora.engine import progress
from glm_lora.tasks.table import STAGES

def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        out[key] = parse_value(value)
    return out


def run_one_stage(stage: str, cfg, force: bool = True) -> artifacts.ArtifactRef:
    """Build one stage from its inputs in the run directory, without Prefect (the stage table says
    which); the artifact carries the same cache key the flow would give it, so the flow reuses it."""
    from glm_lora.tasks.cache import build_stage
    from glm_lora.tasks.table import upstream

    inputs = {}
    for key, name in upstream(stage, cfg).items():
        d = cfg.stage_dir(name)
        if not artifacts.is_complete(d):
            raise UserError(f"stage {stage} needs the {name} stage's output, and {d} is missing or incomplete; "
                            f"run `python -m glm_lora.flows.cli stage {name}` (or the whole flow) first")
        inputs[key] = artifacts.ref_for(d).to_dict()
    return build_stage(stage, cfg, inputs, force=force)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="glm-lora", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "stage", "status"):
        p = sub.add_parser(name)
        if name == "stage":
            p.add_argument("name", choices=list(STAGES))
        p.add_argument("--config", default="tiny", help="preset name (configs/*.yaml) or a path to a YAML file")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
        if name == "run":
            p.add_argument("--refresh", action="append", default=[], metavar="STAGE", help="rebuild this stage")
    p = sub.add_parser("config", help="the config keys: defaults, types, allowed values, descriptions")
    what = p.add_mutually_exclusive_group()
    what.add_argument("key", nargs="?", help="a dotted key (sft.max_steps) or a section (sft); none: every key")
    what.add_argument("--markdown", action="store_true", help="the whole reference as Markdown (docs/config.md)")
    p = sub.add_parser("relocate", help="a copied export: point its adapters at the copy's own base models")
    p.add_argument("export_dir", type=Path)
    p = sub.add_parser("serve", help="the served endpoint of the configured run: status | stop | promote")
    p.add_argument("action", choices=["status", "stop", "promote"])
    p.add_argument("--config", default="tiny", help="preset name (configs/*.yaml) or a path to a YAML file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--export", help="promote: an export directory (a run's export/ or serving/exports/<digest>/)")
    p.add_argument("--previous", action="store_true", help="promote: the export served before the current one")
    p.add_argument("--allow-regression", action="store_true",
                   help="promote: skip the gate's no-regression and harness checks")
    p.add_argument("--all", action="store_true", help="stop: every deployment listed on this machine (scripts/stop.sh)")
    p = sub.add_parser("harness", help="lm-evaluation-harness tasks against a served endpoint (its chat completions)")
    p.add_argument("--url", required=True, help="the endpoint, http://HOST:PORT or http://HOST:PORT/v1")
    p.add_argument("--model", required=True, help="a served model name (e.g. tiny, tiny-sft)")
    p.add_argument("--tasks", required=True, help="comma-separated task names; shipped: glm_lora_arithmetic, "
                                                  "glm_lora_strings")
    p.add_argument("--include-path", action="append", default=[], type=Path, help="a folder of your task YAML files")
    p.add_argument("--limit", type=int, help="samples per task (default: all)")
    p.add_argument("--data", type=Path, help="held-out rows for the shipped tasks (a run's data/sft_eval.jsonl; "
                                             "default: the tiny default's, shipped with them)")
    p.add_argument("--api-key-env", help="environment variable holding the endpoint's key")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--out", type=Path, help="write lm_eval's results (JSON, with every sample) here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        with progress.listening(TerminalBars()):
            return _run(args)
    except (UserError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
        return _user_error(e)


class TerminalBars:
    """A tqdm bar per training stage on stderr (step / max_steps, loss, tokens/s, ETA)."""

    def __init__(self):
        self.bar, self.stage = None, None

    def __call__(self, event: dict) -> None:
        from tqdm import tqdm
        if event.get("stage") != self.stage:
            if self.bar is not None:
                self.bar.close()
            self.stage, self.bar = event.get("stage"), tqdm(total=event.get("max_steps"), desc=event.get("stage"),
                                                            unit="step", dynamic_ncols=True)
        self.bar.n = event["step"]
        self.bar.set_postfix(loss=f"{event.get('loss') or 0:.4g}", tok_s=f"{event.get('tokens_per_s') or 0:,.0f}")
        if event["step"] >= (event.get("max_steps") or 0):
            self.bar.close()
            self.bar, self.stage = None, None


def _user_error(e: BaseException | str) -> int:
    """One line on stderr naming the file / row / key, no traceback: it is the user's to fix."""
    print("error: " + " ".join(str(e).split()), file=sys.stderr)
    return 2


def _run(args) -> int:
    if args.cmd == "relocate":
        from glm_lora.export.hf_peft import relocate
        print(json.dumps(relocate(args.export_dir), indent=2))
        return 0

    if args.cmd == "harness":
        return _harness(args)
    if args.cmd == "config":
        from glm_lora.configs import reference
        print(reference.markdown() if args.markdown else reference.describe(args.key) if args.key
              else reference.listing(), end="")
        return 0
    overrides = _overrides(args.set)
    cfg = load_config(args.config, overrides)
    if args.cmd == "serve":
        return _serve(args, cfg)
    if args.cmd == "status":
        from glm_lora.tasks.cache import status
        for stage, why in status(cfg):
            print(f"{stage:12s} {'cached' if not why else 'runs: ' + '; '.join(why)}")
        return 0
    from glm_lora.engine.preflight import preflight     # imported here: a config error is reported without torch
    preflight(cfg)
    if args.cmd == "stage":
        with run_lock(cfg.run_dir, cfg.dist.node_rank):
            ref = run_one_stage(args.name, cfg)
        print(json.dumps({**ref.to_dict(), "metrics": ref.manifest()["metrics"]}, indent=2, ensure_ascii=False))
        return 0
    from glm_lora.flows.glm_lora import glm_lora
    from glm_lora.tasks.stages import is_user_error
    state = glm_lora(config=args.config, overrides=overrides, refresh=args.refresh, return_state=True)
    if state.is_failed():
        return _user_error(state.message) if is_user_error(state) else 1   # a bug: Prefect logged its traceback
    print(json.dumps(state.result(), indent=2, ensure_ascii=False))
    return 0


def _serve(args, cfg) -> int:
    """`serve status|stop|promote`: the deployment in the configured run directory (serve/deploy.py); no Prefect."""
    from glm_lora.serve import deploy

    dep = deploy.Deployment.of(cfg)
    if args.action == "status":
        print(json.dumps(deploy.status(dep), indent=2, ensure_ascii=False))
        return 0
    if args.action == "stop":        # --all: what the index lists (any runs_dir), not just this run
        for root in sorted(set(deploy.indexed())) if args.all else [dep.root]:
            if (root / deploy.RECORD).is_file():
                print(f"[serve stop] {root}: stopped pids {deploy.stop(deploy.Deployment.at(root))}")
        stage_dirs = Path(cfg.runs_dir).glob("*/serve") if args.all else [cfg.stage_dir("serve")]
        for rec in filter(None, map(deploy.legacy_server, stage_dirs)):    # servers of the pre-blue/green stage
            deploy.vs.stop_server(rec["pid"])
            print(f"[serve stop] stopped the old serve stage's server pid {rec['pid']}")
        return 0
    if bool(args.export) == bool(args.previous):
        raise UserError("serve promote: give one of --export DIR and --previous")
    from glm_lora.serve.stage import promote_export
    export = deploy.previous_export(dep) if args.previous else Path(args.export)
    result = promote_export(cfg, export, allow_regression=args.allow_regression or args.previous)
    print(json.dumps(result, indent=2, ensure_ascii=False))
    return 0


def _harness(args) -> int:
    """`harness --url`: lm_eval's local-chat-completions model on a served name; prints the scores' table."""
    import os
    from pydantic import ValidationError
    from glm_lora.configs.schema import HarnessConfig
    from glm_lora.evaluation import harness

    try:
        hc = HarnessConfig(tasks=[t for t in args.tasks.split(",") if t], include_path=args.include_path,
                           limit=args.limit)
    except ValidationError as e:
        raise ConfigError(f"harness: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}") from None
    key = None
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            raise UserError(f"--api-key-env: the environment variable {args.api_key_env} is unset or empty")
    results = harness.endpoint(args.url, args.model, hc, key=key, data=args.data, concurrency=args.concurrency)
    if args.out:
        artifacts.atomic_write_text(args.out, harness.dump(results))
    print(harness.table(harness.scores(results)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
