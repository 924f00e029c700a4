"""Content-addressed stage keys: the same key means the same artifact can be reused.

key = sha256(stage, code version, the config sections the stage reads, upstream digests,
where the artifact is published). The key is stored in the artifact's manifest, so reuse
works with or without Prefect's result store, and a deleted or edited artifact is rebuilt.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from artifacts import is_complete, read_manifest, sha256_json, source_hash

REPO = Path(__file__).resolve().parents[1]
TRAINING_CODE = ("configs", "data", "engine", "kernels", "model")
# The library code each stage's output depends on: editing it invalidates that stage (and so
# everything downstream, through the upstream digests).
STAGE_CODE: dict[str, tuple[str, ...]] = {
    "data": ("data",), "tokenizer": ("data",), "pretrain": TRAINING_CODE, "import_base": TRAINING_CODE,
    "sft": TRAINING_CODE, "dpo": TRAINING_CODE,
    # export runs engine.stages.load_policy (adapter merge) and data.tokenizer, not just model/
    "export": ("export",) + TRAINING_CODE,
}

# The config keys each stage depends on (dotted keys name a single field).
STAGE_INPUTS: dict[str, tuple[str, ...]] = {
    "data": ("data", "eval.max_rows"),
    "tokenizer": ("tokenizer", "base_model"),
    "pretrain": ("model", "pretrain", "device", "precision", "kernels", "attention"),
    "import_base": ("base_model",),
    "sft": ("sft", "device", "precision", "kernels", "attention"),
    "dpo": ("dpo", "device", "precision", "kernels", "attention"),
    "export": ("serve.dtype", "eval"),
}


@lru_cache(maxsize=None)
def code_version(packages: tuple[str, ...]) -> str:
    """Hash of the given packages' Python sources."""
    return source_hash(REPO, packages)


def _pick(cfg: dict, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def _user_paths(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [p for v in node.values() for p in _user_paths(v)]
    return [node] if isinstance(node, str) and Path(node).exists() else []


def fingerprint(path: str) -> list:
    """Cheap change detector for user files/dirs named in the config: (name, size, mtime) per file."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    return [(f.as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def stage_key(stage: str, cfg: dict, upstream: list[dict], out_dir: Path) -> str:
    sections = {k: _pick(cfg, k) for k in STAGE_INPUTS[stage]}
    user_files = {p: fingerprint(p) for p in _user_paths(sections)}
    return sha256_json({"stage": stage, "code": code_version(STAGE_CODE[stage]), "config": sections, "user_files": user_files,
                        "upstream": sorted(r["digest"] for r in upstream), "out": str(out_dir)})


def reusable(out_dir: Path, key: str) -> bool:
    """The published artifact is complete, verifies, and was built for exactly this key."""
    return is_complete(out_dir) and read_manifest(out_dir)["config"].get("cache_key") == key
