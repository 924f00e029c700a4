"""Command line: `python -m flows.cli run` runs the whole flow in-process (Prefect, no deployment);
`python -m flows.cli stage NAME` runs one stage's plain function without Prefect, reading its
inputs from the run directory — for debugging and for torchrun-launched training.

Overrides use dotted keys: `--set sft.max_steps=50 --set sft.lora.r=32`.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

import artifacts
from artifacts.lock import run_lock
from configs import ConfigError, load_config, parse_value
from configs.errors import UserError

UPSTREAM = {
    "data": [], "tokenizer": ["data"], "pretrain": ["tokenizer", "data"], "import_base": [],
    "sft": ["BASE", "tokenizer", "data"], "dpo": ["BASE", "sft", "tokenizer", "data"],
    "export": ["BASE", "sft", "dpo", "tokenizer"], "serve": ["export"],
}


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        out[key] = parse_value(value)
    return out


def run_one_stage(stage: str, cfg) -> artifacts.ArtifactRef:
    from data.prepare import prepare_data, prepare_tokenizer
    from engine import stages
    from export import export
    from serve.stage import serve

    base = "import_base" if cfg.base_model else "pretrain"
    names = [base if u == "BASE" else u for u in UPSTREAM[stage]]
    dirs = [cfg.stage_dir(n) for n in names]
    for name, d in zip(names, dirs):
        if not artifacts.is_complete(d):
            raise UserError(f"stage {stage} needs the {name} stage's output, and {d} is missing or incomplete; "
                            f"run `python -m flows.cli stage {name}` (or the whole flow) first")
    fns = {
        "data": lambda out: prepare_data(cfg.data, out, eval_rows=cfg.eval.max_rows),
        "tokenizer": lambda out: prepare_tokenizer(dirs[0], cfg.tokenizer.vocab_size, out, base_model=cfg.base_model),
        "pretrain": lambda out: stages.pretrain(cfg, *dirs, out),
        "import_base": lambda out: stages.import_base(cfg, out),
        "sft": lambda out: stages.sft(cfg, *dirs, out),
        "dpo": lambda out: stages.dpo(cfg, *dirs, out),
        "export": lambda out: export(cfg, *dirs, out),
        "serve": lambda out: serve(cfg, *dirs, out),
    }
    inputs = [artifacts.ref_for(d) for d in dirs]
    return artifacts.build(cfg.stage_dir(stage), stage, fns[stage], config={"run": cfg.model_dump(mode="json")},
                           inputs=inputs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="glm-lora", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "stage"):
        p = sub.add_parser(name)
        if name == "stage":
            p.add_argument("name", choices=list(UPSTREAM))
        p.add_argument("--config", default="tiny", help="preset name (configs/*.yaml) or a path to a YAML file")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
        if name == "run":
            p.add_argument("--refresh", action="append", default=[], metavar="STAGE", help="rebuild this stage")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return _run(args)
    except (UserError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
        return _user_error(e)


def _user_error(e: BaseException | str) -> int:
    """One line on stderr naming the file / row / key, no traceback: it is the user's to fix."""
    print("error: " + " ".join(str(e).split()), file=sys.stderr)
    return 2


def _run(args) -> int:
    from engine.preflight import preflight

    overrides = _overrides(args.set)
    cfg = load_config(args.config, overrides)
    preflight(cfg)
    if args.cmd == "stage":
        with run_lock(cfg.run_dir):
            ref = run_one_stage(args.name, cfg)
        print(json.dumps({**ref.to_dict(), "metrics": ref.manifest()["metrics"]}, indent=2, ensure_ascii=False))
        return 0
    from flows.glm_lora import glm_lora
    from tasks.stages import is_user_error
    state = glm_lora(config=args.config, overrides=overrides, refresh=args.refresh, return_state=True)
    if state.is_failed():
        return _user_error(state.message) if is_user_error(state) else 1   # a bug: Prefect logged its traceback
    print(json.dumps(state.result(), indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
