"""Content-addressed stage keys: the same key means the same artifact can be reused.

key = sha256(stage, code version, the config sections the stage reads, upstream digests,
where the artifact is published); which sections and code a stage depends on is in the stage
table (tasks/table.py). The key is stored in the artifact's manifest: the only cache there is.
Prefect, the CLI and tests all go through `build_stage`, and a deleted or edited artifact is rebuilt.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import Any, Callable, ContextManager

from glm_lora.artifacts import manifest as artifacts
from glm_lora.artifacts.manifest import code_version, is_complete, read_manifest, sha256_json, sha256_path
from glm_lora.configs.load import get_dotted
from glm_lora.configs.schema import Config
from glm_lora.tasks import nodes
from glm_lora.tasks.table import DISTRIBUTED, STAGES, chain, upstream


def _user_paths(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [p for v in node.values() for p in _user_paths(v)]
    return [node] if isinstance(node, str) and Path(node).exists() else []


def fingerprint(path: str) -> str:
    """What a user file or directory named in the config contributes to a key: its content (sha256),
    not its mtime — a touched but unchanged file re-runs nothing, an edited one re-runs its stages."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    return _content_hash(tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns, f.stat().st_ino) for f in files), str(p))


@functools.lru_cache(maxsize=256)
def _content_hash(stats: tuple, path: str) -> str:   # stats: hashed again only when a file's stat changes
    return sha256_path(Path(path))


def key_parts(stage: str, cfg: Config, upstream: list[dict], out_dir: Path) -> dict:
    """Everything a stage's output depends on; the key is their hash, and the manifest keeps them so
    `explain` can say what changed. The config sections enter as JSON: the one place a Config is
    serialised for a key."""
    spec = STAGES[stage]
    tree = cfg.model_dump(mode="json")
    for dotted in spec.ignore:
        parent, _, leaf = dotted.rpartition(".")
        get_dotted(tree, parent).pop(leaf)
    sections = {k: get_dotted(tree, k) for k in spec.config}
    return {"stage": stage, "code": code_version(spec.code), "config": sections,
            "user_files": {p: fingerprint(p) for p in _user_paths(sections)},
            "upstream": sorted(r["digest"] for r in upstream), "out": str(out_dir)}


def stage_key(stage: str, cfg: Config, upstream: list[dict], out_dir: Path) -> str:
    return sha256_json(key_parts(stage, cfg, upstream, out_dir))


def explain(stage: str, cfg: Config, inputs: dict[str, dict], out_dir: Path) -> list[str]:
    """Why `stage` would run instead of being reused: [] when its published artifact matches the key,
    else one line per cause (config key, code package, upstream artifact, user file)."""
    out_dir = Path(out_dir)
    if not (out_dir / artifacts.MANIFEST).is_file():
        return ["not built yet"]
    if not is_complete(out_dir):
        return [f"{out_dir}: published files do not match its manifest (edited or corrupted)"]
    manifest = read_manifest(out_dir)
    new = key_parts(stage, cfg, list(inputs.values()), out_dir)
    if manifest["config"].get("cache_key") == sha256_json(new):
        return []
    old = manifest["config"].get("key_parts")
    if old is None:
        return ["built without a recorded key (by an older version)"]
    why = [f"config {k}: {_short(a)} → {_short(b)}" for k, a, b in _leaf_changes(old["config"], new["config"], "")]
    if old["code"] != new["code"]:
        why.append(f"code changed in {', '.join(STAGES[stage].code)}")
    why += [f"user file {p} changed" for p in sorted(old["user_files"].keys() | new["user_files"].keys())
            if old["user_files"].get(p) != new["user_files"].get(p)]
    before = {r["stage"]: r["digest"] for r in manifest.get("inputs", [])}
    why += [f"upstream {r['stage']} changed ({before.get(r['stage'], 'none')[:12]} → {r['digest'][:12]})"
            for r in inputs.values() if before.get(r["stage"]) != r["digest"]]
    if old["out"] != new["out"]:
        why.append(f"published elsewhere before ({old['out']})")
    return why or ["key changed"]


def _leaf_changes(a: Any, b: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [c for k in sorted(a.keys() | b.keys()) for c in _leaf_changes(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [(prefix.rstrip("."), a, b)]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def reusable(out_dir: Path, key: str) -> bool:
    """The published artifact is complete, verifies, and was built for exactly this key."""
    return is_complete(out_dir) and read_manifest(out_dir)["config"].get("cache_key") == key


def build_stage(name: str, cfg: Config, inputs: dict[str, dict], *, force: bool = False,
                log: logging.Logger = logging.getLogger("glm_lora.stages"),
                guard: Callable[[], ContextManager] = contextlib.nullcontext) -> tuple[artifacts.ArtifactRef, bool]:
    """The one cache mechanism: reuse `name`'s published artifact if it was built for this key, else run
    the stage's function and publish atomically (the key in its manifest). Returns (ref, reused).

    `inputs`: input name → the upstream stage's ArtifactRef dict; `guard()` is held while the stage runs
    (not while it is reused): the flow passes a Prefect concurrency slot for training stages.
    The flow, the CLI and tests call this.
    """
    out = cfg.stage_dir(name)
    parts = key_parts(name, cfg, list(inputs.values()), out)
    key = sha256_json(parts)
    dirs = {k: Path(r["path"]) for k, r in inputs.items()}
    # Node 0 of a several-machine run publishes; this node trains along or waits, without `guard`: node 0 holds
    # the training slot for the whole job, and waiting for it here would keep node 0's rendezvous from completing.
    if nodes.follows(cfg):
        return nodes.follow(name, cfg, dirs, out, key, force=force or not STAGES[name].cached, reusable=reusable,
                            log=log)
    if STAGES[name].cached and not force and reusable(out, key):
        return artifacts.ref_for(out), True
    if STAGES[name].cached:
        log.info("%s: running: %s", name, "; ".join(["forced (refresh)"] if force else
                                                    explain(name, cfg, inputs, out)))
    fn = STAGES[name].run
    if name in DISTRIBUTED:
        from glm_lora.engine.dist import world_size
        from glm_lora.tasks.launch import torchrun_stage
        if cfg.dist.launcher == "torchrun" or world_size(cfg) > 1:
            fn = functools.partial(torchrun_stage, name, log=log)      # every rank in its own process
    # imported here, not at the top: reading the cache (`status`, a config error) loads no torch
    from glm_lora.kernels import ops as kernels
    with guard(), kernels.using(cfg.kernels, cfg.attention):     # the ops every stage runs: kernels/ops.py
        ref = artifacts.build(out, name, lambda tmp: fn(cfg, dirs, tmp),
                              config={"cache_key": key, "key_parts": parts, "run": cfg.model_dump(mode="json")},
                              inputs=[artifacts.ArtifactRef.from_dict(r) for r in inputs.values()])
    return ref, False


def status(cfg: Config) -> list[tuple[str, list[str]]]:
    """Per stage of a run of `cfg`: [] if it would be reused as published, else why it would run —
    what `python -m glm_lora.flows.cli status` prints (the stage logs the same reasons when it runs)."""
    published: dict[str, dict] = {}
    stale: set[str] = set()
    report = []
    for name in chain(cfg):
        ups = upstream(name, cfg)
        if not STAGES[name].cached:
            report.append((name, ["runs every time"]))
            continue
        if any(s not in published for s in ups.values()):
            missing = sorted(s for s in ups.values() if s not in published)
            why = [f"waits for {', '.join(missing)} (not built)"]
        else:
            why = explain(name, cfg, {k: published[s] for k, s in ups.items()}, cfg.stage_dir(name))
            why += [f"after {s} re-runs, if its output changes" for s in ups.values() if s in stale and not why]
        if is_complete(cfg.stage_dir(name)):
            published[name] = artifacts.ref_for(cfg.stage_dir(name)).to_dict()
        if why:
            stale.add(name)
        report.append((name, why))
    return report
