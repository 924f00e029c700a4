"""The config reference, generated from the schema: every key's type, allowed values, default (and each preset's
value where it differs) and description, as docs/config.md (`markdown`) or for `glm-lora config [KEY]`."""
from __future__ import annotations

import difflib
import inspect
import json
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from glm_lora.configs.load import PRESETS, ConfigError, get_dotted, load_config
from glm_lora.configs.schema import Config, Section

COMMAND = "glm-lora config --markdown > docs/config.md"   # what regenerates the committed page
BOUNDS = ((annotated_types.Ge, "ge", "≥"), (annotated_types.Gt, "gt", ">"), (annotated_types.Le, "le", "≤"),
          (annotated_types.Lt, "lt", "<"))


@dataclass(frozen=True)
class Entry:
    """One key of the schema: a value (`field`), or a section when `model` is set."""

    key: str                                # dotted: sft.lora.r
    field: FieldInfo
    model: type[BaseModel] | None = None    # the section's model

    @property
    def description(self) -> str:
        return self.field.description or ""

    @property
    def paragraphs(self) -> list[str]:
        """The description, then a section's docstring (the nearest in its model's bases) by paragraph."""
        models = [c for c in (self.model or Section).__mro__ if issubclass(c, Section) and c is not Section]
        doc = next((c.__doc__ for c in models if c.__doc__), None)
        return [self.description, *(inspect.cleandoc(doc).split("\n\n") if doc else [])]


def entries(model: type[BaseModel] = Config, prefix: str = "") -> list[Entry]:
    """Every key under `model`, depth first in declaration order: a section, then its keys."""
    out = []
    for name, field in model.model_fields.items():
        sub = field.annotation if _is_section(field.annotation) else None
        out.append(Entry(prefix + name, field, sub))
        if sub:
            out += entries(sub, f"{prefix}{name}.")
    return out


def _is_section(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def presets() -> dict[str, dict]:
    """Each preset's config as JSON values, smallest model first."""
    configs = {p.stem: load_config(p.stem) for p in PRESETS.glob("*.yaml")}
    order = sorted(configs, key=lambda n: (configs[n].model.hidden_size * configs[n].model.num_layers, n))
    return {name: configs[name].model_dump(mode="json") for name in order}


def _literals(annotation) -> list:
    """The values of every Literal in an annotation (through unions, lists and dicts)."""
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    return [v for arg in typing.get_args(annotation) for v in _literals(arg)]


def _constraints(metadata: list, quote: str = "`") -> list[str]:
    out = []
    for m in metadata:
        out += [f"{sign} {_number(getattr(m, attr))}" for kind, attr, sign in BOUNDS if isinstance(m, kind)]
        if isinstance(m, annotated_types.MinLen):
            out.append("non-empty" if m.min_length == 1 else f"length ≥ {m.min_length}")
        if getattr(m, "pattern", None):
            out.append(f"matches {quote}{m.pattern}{quote}")
    return out


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def type_text(annotation) -> str:
    """A readable type: `int`, `list of str`, `map str → float > 0`, `path or null`, `section`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Literal:
        return " or ".join(dict.fromkeys(type(a).__name__ for a in args))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(type_text(a) for a in args))
    if origin is typing.Annotated:
        inner = [c for m in args[1:] for c in _constraints(m.metadata if isinstance(m, FieldInfo) else [m])]
        return " ".join([type_text(args[0]), *inner])
    if origin is list:
        return f"list of {type_text(args[0])}"
    if origin is dict:
        return f"map {type_text(args[0])} → {type_text(args[1])}"
    if _is_section(annotation):
        return "section"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def allowed_text(field: FieldInfo, quote: str = "`") -> str:
    """The Literal values and the field's bounds, e.g. `auto`, `cpu`, `cuda` or ≥ 1 (values in `quote`); '' where
    any value of the type goes."""
    values = [f"{quote}{value_text(v)}{quote}" for v in _literals(field.annotation)]
    return ", ".join(values + _constraints(field.metadata, quote))


def value_text(value: Any) -> str:
    """A JSON value as one writes it in YAML: strings bare, null / true / false, lists and maps as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def find(key: str) -> Entry:
    """The entry of a dotted key or section; ConfigError naming close matches if there is none."""
    known = {e.key: e for e in entries()}
    if key in known:
        return known[key]
    close = [k for k in known if k.endswith("." + key)] + difflib.get_close_matches(key, list(known), n=5)
    hint = f"; did you mean {', '.join(dict.fromkeys(close[:5]))}?" if close else ""
    raise ConfigError(f"unknown config key {key!r}{hint} (`glm-lora config` lists every key)")


# ---- text for the terminal: `glm-lora config [KEY]`

def listing(under: str = "") -> str:
    """Every value key (below `under`, a section) with its default, one a line."""
    default = Config().model_dump(mode="json")
    keys = [e.key for e in entries() if not e.model and e.key.startswith(under)]
    width = max(map(len, keys))
    return "".join(f"{k:{width}}  {value_text(get_dotted(default, k))}\n" for k in keys)


def describe(key: str) -> str:
    """One key's type, allowed values, default, the presets' values where they differ, and description; for a
    section, its description and its keys' defaults."""
    e = find(key)
    if e.model:
        return "\n\n".join([f"{e.key} (section)", *map(_wrap, e.paragraphs), listing(e.key + ".")])
    default = get_dotted(Config().model_dump(mode="json"), e.key)
    differing = {name: v for name, cfg in presets().items() if (v := get_dotted(cfg, e.key)) != default}
    rows = [("type", type_text(e.field.annotation)), ("allowed", allowed_text(e.field, quote="")),
            ("default", value_text(default)),
            ("presets", ", ".join(f"{name} {value_text(v)}" for name, v in differing.items()))]
    lines = [e.key, *(f"  {name + ':':9}{text}" for name, text in rows if text), "", _wrap(e.description)]
    return "\n".join(lines) + "\n"


def _wrap(text: str) -> str:
    return textwrap.fill(text, 100, initial_indent="  ", subsequent_indent="  ")


# ---- Markdown: docs/config.md

def markdown() -> str:
    default, preset = Config().model_dump(mode="json"), presets()
    columns = ["Key", "Type", "Allowed", "Default", *preset, "Description"]
    head = [f"| {' | '.join(columns)} |", f"|{'---|' * len(columns)}"]

    def row(e: Entry) -> str:
        value = get_dotted(default, e.key)
        cells = [f"`{e.key}`", type_text(e.field.annotation), allowed_text(e.field), _code(value_text(value)),
                 *(_code(value_text(v)) if (v := get_dotted(cfg, e.key)) != value else "" for cfg in preset.values()),
                 _text(e.description)]
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    def section(title: str, intro: list[str], keys: list[Entry]) -> list[str]:
        return [title, "", *(p for text in intro if text for p in (_text(text), "")),
                *head, *map(row, keys), ""]

    all_entries = entries()

    def values_in(section: str) -> list[Entry]:
        return [e for e in all_entries if not e.model and e.key.rpartition(".")[0] == section]

    lines = ["# Configuration reference", "",
             f"Generated from `src/glm_lora/configs/schema.py` by `{COMMAND}`: do not edit it by hand.", "",
             "A config is a YAML file of these keys: a preset (`--config " + "`, `".join(preset) + "`, in "
             "`src/glm_lora/configs/`) or your own file (`--config path/to/file.yaml`); `--set KEY=VALUE` overrides "
             "one key, e.g. `--set sft.max_steps=50`. A key left out takes its default. The preset columns show a "
             "preset's value where it differs from the default. `glm-lora config KEY` prints one key's entry.", ""]
    lines += section("## Top level", [Config.__doc__ or ""], values_in(""))
    for e in (e for e in all_entries if e.model):
        lines += section(f"{'#' * (e.key.count('.') + 2)} `{e.key}`", e.paragraphs, values_in(e.key))
    return "\n".join(lines).rstrip() + "\n"


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _text(text: str) -> str:
    """Prose for Markdown: one line; a `<` outside code spans escaped, so `<run>` is not taken for an HTML tag."""
    parts = " ".join(text.split()).split("`")
    return "`".join(p.replace("<", "&lt;") if i % 2 == 0 else p for i, p in enumerate(parts))
