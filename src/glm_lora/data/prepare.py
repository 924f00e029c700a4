"""The data and tokenizer stages as plain functions: `fn(cfg, inputs, out_dir) -> metrics`."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator

from glm_lora.artifacts.manifest import sha256_path
from glm_lora.configs.schema import Config, DataConfig
from glm_lora.data import formats, synthetic
from glm_lora.data.cleaning import CleanReport
from glm_lora.data.formats import MAX_LINE_BYTES, DataError
from glm_lora.data.heldout_split import holdout_ids, write_held_out
from glm_lora.data.tokenizer import load_tokenizer, train_tokenizer

SPLITS = {"pretrain": formats.read_pretrain, "pretrain_eval": formats.read_pretrain,
          "sft": formats.read_sft, "sft_eval": formats.read_sft,
          "dpo": formats.read_preferences, "dpo_eval": formats.read_preferences}   # pairs or KTO rows
SOURCES = "sources.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def data_stage(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    """The data stage (tasks/table.py): generate / validate every split, hold out eval rows."""
    return prepare_data(cfg.data, out_dir, eval_rows=cfg.eval.max_rows)


def tokenizer_stage(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    """The tokenizer stage: train the BPE on the pretraining text, or take the base model's or tokenizer.path's."""
    return prepare_tokenizer(inputs["data"], cfg.tokenizer.vocab_size, out_dir, base_model=cfg.base_model,
                             path=cfg.tokenizer.path)


def check_user_paths(cfg: DataConfig) -> dict[str, Path]:
    """Every user-supplied split exists and is readable (checked before anything is generated)."""
    user = {}
    for split in SPLITS:
        path = getattr(cfg, split)
        if path is None:
            continue
        path = Path(path).expanduser().resolve()
        if not path.exists():
            raise DataError(f"data.{split}: {path} does not exist")
        readable = os.access(path, os.R_OK) and (path.is_file() or os.access(path, os.X_OK))
        if not readable:
            raise DataError(f"data.{split}: {path} is not readable by this user")
        if path.is_file() and path.stat().st_size == 0:
            raise DataError(f"data.{split}: {path} is empty")
        user[split] = path
    return user


def base_tokenizer_files(source: Path, key: str = "base_model") -> list[str]:
    """The tokenizer files a directory has (a base model's, or tokenizer.path); it needs tokenizer.json or
    tokenizer.model."""
    source = Path(source)
    if not source.is_dir():
        raise DataError(f"{key} {source}: not a directory")
    found = [f for f in TOKENIZER_FILES if (source / f).is_file()]
    if "tokenizer.json" not in found and "tokenizer.model" not in found:
        raise DataError(f"{key} {source}: no tokenizer.json or tokenizer.model")
    return found


def prepare_data(cfg: DataConfig, out_dir: Path, *, eval_rows: int = 200) -> dict:
    """Generate the synthetic splits the user didn't supply; validate every split by reading it.

    User files stay where they are; `sources.json` records each split's path, sha256 and the
    cleaning settings, so the artifact digest changes whenever a user file or a setting does.
    A user split without its own `*_eval` file gets rows held out of the same file (data/heldout_split.py,
    at most `eval_rows`), written into the artifact and excluded from training.
    With on_bad_row=skip, malformed rows are counted per split (nothing is dropped silently).
    """
    out_dir = Path(out_dir)
    user = check_user_paths(cfg)
    generated: dict[str, Path] = {}
    if len(user) < len(SPLITS):
        syn = cfg.synthetic
        generated = synthetic.generate(out_dir, seed=syn.seed, n_pretrain=syn.n_pretrain, n_sft=syn.n_sft,
                                       n_dpo=syn.n_dpo, n_eval=syn.n_eval, sft_weights=syn.sft_weights,
                                       held_out_prompts=syn.held_out_prompts)
        for s in user:
            generated.pop(s, None)
            (out_dir / f"{s}.jsonl").unlink(missing_ok=True)
    sources, metrics = {}, {}
    read_settings = {"on_bad_row": cfg.on_bad_row, "max_line_bytes": cfg.max_line_bytes}
    for split, reader in SPLITS.items():     # each training split before its eval split
        base = split.removesuffix("_eval")
        held_out = split != base and base in user and split not in user
        if held_out:
            ids = holdout_ids(sources[base]["good_rows"], cfg.holdout, eval_rows, split)
            if not ids:
                raise DataError(f"data.{base}: {user[base]} has {sources[base]['good_rows']} usable rows, too few to "
                                f"hold out an evaluation set (data.holdout); give data.{split} a file of its own")
            generated[split] = out_dir / f"{split}.jsonl"
            rows = reader(user[base], report=CleanReport(max_examples=0), **{**read_settings, "on_bad_row": "skip"})
            write_held_out(rows, ids, base, generated[split])
            sources[base]["held_out"] = {"split": split, "rows": len(ids), "ids": ids}
            metrics[f"held_out_{base}"] = len(ids)
        path = user[split] if split in user else Path(generated[split]).resolve()
        report = CleanReport(max_examples=cfg.report_examples)
        good = sum(1 for _ in reader(path, report=report, **read_settings))
        if good == 0:
            raise DataError(f"data.{split}: {path} has no usable rows ({report})")
        report.check_drop_fraction(split, cfg.max_drop_fraction)
        sources[split] = {"path": path.name if split not in user else str(path), "sha256": sha256_path(path),
                          "rows": report.rows, "good_rows": good, "bad_rows": report.dropped.get("bad_row", 0),
                          "user": split in user}
        if held_out:
            sources[split]["held_out_from"] = {"split": base, "path": str(user[base]), "sha256": sources[base]["sha256"]}
        metrics[f"rows_{split}"] = report.rows
        if report.dropped:
            metrics[f"bad_rows_{split}"] = report.dropped.get("bad_row", 0)
    settings = {k: getattr(cfg, k) for k in ("on_bad_row", "dedup", "min_tokens", "overlong", "max_line_bytes")}
    (out_dir / SOURCES).write_text(json.dumps({"splits": sources, "cleaning": settings}, indent=2))
    return metrics


def held_out_ids(data_dir: Path, split: str) -> list[int]:
    """Row ids (reading order) of `split` that the data stage held out for evaluation: not for training."""
    entry = json.loads((Path(data_dir) / SOURCES).read_text())["splits"][split]
    return entry.get("held_out", {}).get("ids", [])


def split_provenance(data_dir: Path, split: str, rows: int | None = None) -> dict:
    """Where an eval split's rows came from, recorded beside every metric computed on them."""
    entry = json.loads((Path(data_dir) / SOURCES).read_text())["splits"][split]
    origin = entry.get("held_out_from")
    source = ("held out of " + origin["path"]) if origin else entry["path"] if entry["user"] else "synthetic"
    return {"split": split, "source": source, "user_data": bool(entry["user"] or origin),
            "sha256": entry["sha256"], "rows": entry["good_rows"] if rows is None else rows}


def split_source(data_dir: Path, split: str) -> tuple[Path, str]:
    """Where a prepared split's rows live (inside the artifact, or the user's own file) and the sha256
    the data stage recorded; raises DataError if the content there is no longer what was recorded."""
    entry = json.loads((Path(data_dir) / SOURCES).read_text())["splits"][split]
    path = Path(entry["path"]) if entry["user"] else Path(data_dir) / entry["path"]
    check_unchanged(path, entry["sha256"], split)
    return path, entry["sha256"]


def split_path(data_dir: Path, split: str) -> Path:
    return split_source(data_dir, split)[0]


def check_unchanged(path: Path, sha256: str, split: str) -> None:
    """Everything downstream (token stores, evals) is keyed by the data stage's hash: reading other
    bytes under that key would cache stale tokens. So a file edited since then is an error."""
    now = sha256_path(path) if Path(path).exists() else "(missing)"
    if now != sha256:
        raise DataError(f"data.{split}: {path} changed after the data stage read it (sha256 {sha256[:12]}… then, "
                        f"{now[:12]}… now); re-run the flow so the data stage takes the new content")


def unchanged_rows(rows: Iterable, path: Path, sha256: str, split: str) -> Iterator:
    """`rows` (read lazily from `path`), checked against the recorded hash before the first row and
    after the last one: what was read is what was hashed, even if the file is edited meanwhile."""
    check_unchanged(path, sha256, split)
    yield from rows
    check_unchanged(path, sha256, split)


def prepare_tokenizer(data_dir: Path, vocab_size: int, out_dir: Path, base_model: Path | None = None,
                      seed: int = 0, path: Path | None = None) -> dict:
    """Train a sentencepiece BPE on the pretraining text, or take a base model's tokenizer, or the one at `path`
    (tokenizer.path)."""
    source, key = (base_model, "base_model") if base_model is not None else (path, "tokenizer.path")
    if source is not None:
        source = Path(source).expanduser().resolve()
        found = base_tokenizer_files(source, key)
        for f in found:
            shutil.copy2(source / f, Path(out_dir) / f)
        try:
            tok = load_tokenizer(out_dir)
        except Exception as e:      # noqa: BLE001 -- transformers' many parse errors: one message naming the files
            raise DataError(f"{key} {source}: transformers cannot load its tokenizer files ({type(e).__name__}: "
                            f"{str(e)[:300]})") from None
        if not tok.chat_template:
            raise DataError(f"{key} {source}: its tokenizer has no chat_template; SFT/DPO need one "
                            "(add chat_template.jinja to the directory)")
        if tok.eos_token_id is None:
            raise DataError(f"{key} {source}: tokenizer defines no eos_token")
        return {"source": str(source), "files": len(found), "vocab_size": len(tok)}
    settings = json.loads((Path(data_dir) / SOURCES).read_text())["cleaning"]
    train_tokenizer([split_path(data_dir, "pretrain")], Path(out_dir), vocab_size=vocab_size, seed=seed,
                    max_line_bytes=settings.get("max_line_bytes", MAX_LINE_BYTES))
    return {"vocab_size": len(load_tokenizer(out_dir)), "requested_vocab_size": vocab_size}
