"""Load a YAML preset (by name or path), apply dotted overrides, validate."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import ValidationError

from glm_lora.configs.errors import UserError, quote
from glm_lora.configs.schema import Config

PRESETS = Path(__file__).parent


class ConfigError(UserError, ValueError):
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
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"override value {quote(text)} is not valid YAML: {getattr(e, 'problem', None) or e}") from None


MISSING = object()


def get_dotted(tree: Mapping, dotted: str, default: Any = MISSING) -> Any:
    """`tree["a"]["b"]` for "a.b"; `default` where a part is missing (KeyError if none is given)."""
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is MISSING:
                raise KeyError(dotted)
            return default
        node = node[part]
    return node


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
    """One line: `source: key: problem; key: problem`."""
    problems = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "literal_error":
            msg = f"got {quote(e.get('input'))}; {msg.lower()}"
        problems.append(f"{key}: {msg}" if key else msg)
    return f"invalid config {source}: " + "; ".join(problems)


def _read_yaml(path: Path) -> dict:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys (e.g. `sft: {{max_steps: 100}}`), "
                          f"got a YAML {type(raw).__name__}")
    return raw


def load_config(name_or_path: str | Path = "tiny", overrides: Mapping[str, Any] | None = None) -> Config:
    path = preset_path(name_or_path)
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError(f"overrides: expected a mapping of dotted keys to values, got {quote(overrides)}")
    raw = apply_overrides(_read_yaml(path), overrides or {})
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        given = f" + overrides {json.dumps(dict(overrides), default=str)[:300]}" if overrides else ""
        raise ConfigError(_explain(err, f"({path}{given})")) from None

