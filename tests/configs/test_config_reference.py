"""The config reference: docs/config.md and `glm-lora config [KEY]`, generated from the schema."""
import typing
from pathlib import Path

from pydantic import BaseModel

from glm_lora.configs import reference, schema
from glm_lora.configs.load import load_config
from glm_lora.configs.schema import Config
from glm_lora.flows import cli

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _models() -> list[type[BaseModel]]:
    return [m for m in vars(schema).values()
            if isinstance(m, type) and issubclass(m, BaseModel) and m.__module__ == schema.__name__]


def _value_keys(section: BaseModel, prefix: str = "") -> list[str]:
    """Every dotted key that holds a value (not a section), read off a config instance."""
    out = []
    for name in type(section).model_fields:
        value = getattr(section, name)
        out += _value_keys(value, f"{prefix}{name}.") if isinstance(value, BaseModel) else [prefix + name]
    return out


def test_the_committed_docs_page_is_the_generated_one():
    assert DOCS.read_text(encoding="utf-8") == reference.markdown(), \
        f"docs/config.md is out of date with the schema or the presets: regenerate it with `{reference.COMMAND}`"


def test_every_field_of_every_model_has_a_description():
    models = _models()
    assert len(models) > 10
    missing = [f"{m.__name__}.{name}" for m in models for name, f in m.model_fields.items()
               if not (f.description or "").strip()]
    assert missing == []


def test_the_page_has_a_row_per_key_with_its_default_and_the_presets_values():
    page = reference.markdown()
    rows = {line.split(" | ")[0].removeprefix("| ").strip("`"): line for line in page.splitlines()
            if line.startswith("| `")}
    keys = _value_keys(Config())
    assert len(keys) > 150 and sorted(rows) == sorted(keys)
    for key in ("sft.max_steps", "dpo.lr", "sft.lr"):
        cells = rows[key].split(" | ")
        assert cells[3] == f"`{reference.value_text(reference.get_dotted(Config().model_dump(), key))}`"
        assert f"`{reference.get_dotted(load_config('tiny').model_dump(), key)}`" in cells[4:7], rows[key]


def test_config_key_prints_type_default_presets_and_description(capsys):
    assert cli.main(["config", "sft.max_steps"]) == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())
    assert f"default: {Config().sft.max_steps}" in words
    assert f"tiny {load_config('tiny').sft.max_steps}" in words
    assert " ".join(Config.model_fields["sft"].annotation.model_fields["max_steps"].description.split()) in words


def test_config_key_names_the_allowed_values(capsys):
    assert cli.main(["config", "device"]) == 0
    out = capsys.readouterr().out
    assert all(value in out for value in typing.get_args(Config.model_fields["device"].annotation))


def test_config_section_lists_its_keys_and_no_key_lists_all(capsys):
    assert cli.main(["config", "sft.lora"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sft.lora (section)") and "sft.lora.r " in out and "dpo.lora" not in out
    assert cli.main(["config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == _value_keys(Config())


def test_an_unknown_key_exits_2_naming_close_matches(capsys):
    assert cli.main(["config", "sft.max_step"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'sft.max_step'" in err and "did you mean sft.max_steps" in err
    assert cli.main(["config", "lora.rank"]) == 2
    err = capsys.readouterr().err
    assert all(f"{stage}.lora.r" in err for stage in ("sft", "dpo", "rl")), err
    assert cli.main(["config", "qqq"]) == 2
    err = capsys.readouterr().err
    assert "did you mean" not in err and "`glm-lora config` lists every key" in err
