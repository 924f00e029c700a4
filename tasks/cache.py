"""Content-addressed stage keys: the same key means the same artifact can be reused.

key = sha256(stage, code version, the config sections the stage reads, upstream digests,
where the artifact is published); which sections and code a stage depends on is in the stage
table (tasks/table.py). The key is stored in the artifact's manifest: the only cache there is.
Prefect, the CLI and tests all go through `build_stage`, and a deleted or edited artifact is rebuilt.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import artifacts
import kernels
from artifacts import code_version, is_complete, read_manifest, sha256_json
from configs import get_dotted
from tasks.table import STAGES


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
    spec = STAGES[stage]
    sections = {k: get_dotted(cfg, k) for k in spec.config}
    user_files = {p: fingerprint(p) for p in _user_paths(sections)}
    return sha256_json({"stage": stage, "code": code_version(spec.code), "config": sections, "user_files": user_files,
                        "upstream": sorted(r["digest"] for r in upstream), "out": str(out_dir)})


def reusable(out_dir: Path, key: str) -> bool:
    """The published artifact is complete, verifies, and was built for exactly this key."""
    return is_complete(out_dir) and read_manifest(out_dir)["config"].get("cache_key") == key


def build_stage(name: str, cfg, inputs: dict[str, dict], *, force: bool = False) -> tuple[artifacts.ArtifactRef, bool]:
    """The one cache mechanism: reuse `name`'s published artifact if it was built for this key, else run
    the stage's function and publish atomically (the key in its manifest). Returns (ref, reused).

    `inputs`: input name → the upstream stage's ArtifactRef dict. The flow, the CLI and tests call this.
    """
    cfg_dict = cfg.model_dump(mode="json")
    out = cfg.stage_dir(name)
    key = stage_key(name, cfg_dict, list(inputs.values()), out)
    if STAGES[name].cached and not force and reusable(out, key):
        return artifacts.ref_for(out), True
    fn = STAGES[name].function()
    dirs = {k: Path(r["path"]) for k, r in inputs.items()}
    with kernels.using(cfg.kernels, cfg.attention):     # the ops every stage runs: kernels/__init__.py
        ref = artifacts.build(out, name, lambda tmp: fn(cfg, dirs, tmp), config={"cache_key": key, "run": cfg_dict},
                              inputs=[artifacts.ArtifactRef.from_dict(r) for r in inputs.values()])
    return ref, False
