"""Load a YAML preset (by name or path), apply dotted overrides, validate."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import ValidationError

from configs.schema import Config

PRESETS = Path(__file__).parent


class ConfigError(ValueError):
    pass


def preset_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ConfigError(f"config file {p} not found")
        return p
    candidate = PRESETS / f"{name_or_path}.yaml"
    if not candidate.is_file():
        names = sorted(q.stem for q in PRESETS.glob("*.yaml"))
        raise ConfigError(f"unknown config preset {name_or_path!r}; presets: {names}, or pass a path to a .yaml file")
    return candidate


def parse_value(text: str) -> Any:
    """CLI override values are YAML scalars/lists: `5`, `1e-3`, `true`, `[q_proj, v_proj]`, `null`."""
    return yaml.safe_load(text)


def apply_overrides(raw: dict, overrides: Mapping[str, Any]) -> dict:
    out = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        node = out
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
        node[leaf] = value
    return out


def _explain(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "literal_error":
            msg = f"got {e.get('input')!r}; {msg.lower()}"
        lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def load_config(name_or_path: str | Path = "tiny", overrides: Mapping[str, Any] | None = None) -> Config:
    path = preset_path(name_or_path)
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    raw = apply_overrides(raw, overrides or {})
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_explain(err, f"{path} + overrides {json.dumps(dict(overrides or {}), default=str)}")) from None


def section_dict(cfg: Config, *keys: str) -> dict:
    """JSON-able dict of the named sections (used in cache keys and manifests)."""
    full = cfg.model_dump(mode="json")
    return {k: full[k] for k in keys}
