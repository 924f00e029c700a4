import pytest

from glm_lora.configs.load import ConfigError, apply_overrides, load_config, parse_value, preset_path
from glm_lora.configs.schema import LORA_TARGETS, Config

PRESETS = ["tiny", "small", "base"]


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_validates_and_sets_its_run_name(name):
    cfg = load_config(name)
    assert isinstance(cfg, Config)
    assert cfg.run_name == name
    m = cfg.model
    assert m.hidden_size % m.num_heads == 0 and m.num_heads % m.num_kv_heads == 0
    for stage in (cfg.pretrain, cfg.sft, cfg.dpo):
        assert stage.seq_len <= m.max_seq_len


def test_preset_values_come_from_the_yaml_not_the_defaults():
    cfg = load_config("tiny")
    assert (cfg.device, cfg.precision) == ("cpu", "auto")
    assert cfg.sft.lora.r == 32 and cfg.dpo.lora.r == 16
    assert cfg.dpo.lr == 5e-4                      # yaml beats DPOConfig(lr=5e-5) default
    assert load_config("small").model.num_kv_heads == 12
    assert load_config("small").pretrain.compile is True and load_config("small").sft.compile is False


def test_preset_by_path(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("run_name: mine\nmodel: {hidden_size: 64, num_heads: 4, num_kv_heads: 2}\n")
    cfg = load_config(p)
    assert cfg.run_name == "mine" and cfg.model.hidden_size == 64
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_dotted_overrides_apply_nested_and_leave_the_rest():
    cfg = load_config("tiny", {
        "sft.lora.r": parse_value("8"),
        "data.synthetic.n_sft": parse_value("12"),
        "sft.lr": parse_value("1e-4"),
        "serve.enabled": parse_value("false"),
        "sft.lora.target_modules": parse_value("[q_proj, v_proj]"),
        "threads": parse_value("null"),
    })
    assert cfg.sft.lora.r == 8
    assert cfg.sft.lora.alpha == 32              # sibling from the preset untouched
    assert cfg.dpo.lora.r == 16                  # the other stage's lora untouched
    assert cfg.data.synthetic.n_sft == 12
    assert cfg.data.synthetic.n_dpo == 4000      # sibling default kept
    assert cfg.sft.lr == pytest.approx(1e-4) and isinstance(cfg.sft.lr, float)
    assert cfg.serve.enabled is False
    assert cfg.sft.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.threads is None


def test_parse_value_yaml_scalars():
    assert parse_value("5") == 5
    assert parse_value("0.5") == 0.5
    assert parse_value("true") is True
    assert parse_value("null") is None
    assert parse_value("[a, b]") == ["a", "b"]
    assert parse_value("cuda") == "cuda"


def test_exponent_without_dot_still_becomes_a_float_field():
    # PyYAML (YAML 1.1) reads `1e-3` as a string; the typed schema must still coerce it.
    cfg = load_config("tiny", {"sft.lr": parse_value("1e-3"), "dpo.beta": parse_value("2e-1")})
    assert cfg.sft.lr == pytest.approx(1e-3) and isinstance(cfg.sft.lr, float)
    assert cfg.dpo.beta == pytest.approx(0.2)


def test_apply_overrides_does_not_mutate_and_creates_sections():
    raw = {"model": {"hidden_size": 64}}
    out = apply_overrides(raw, {"model.num_heads": 4, "sft.lora.r": 2})
    assert raw == {"model": {"hidden_size": 64}}
    assert out == {"model": {"hidden_size": 64, "num_heads": 4}, "sft": {"lora": {"r": 2}}}


def test_override_through_a_scalar_names_the_key():
    with pytest.raises(ConfigError, match=r"'run_name.x'.*'run_name' is not a section"):
        load_config("tiny", {"run_name.x": 1})


def test_bad_literal_names_key_and_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", {"device": "tpu"})
    msg = str(e.value)
    assert "device: got 'tpu'" in msg
    for allowed in ("'auto'", "'cpu'", "'cuda'"):
        assert allowed in msg


def test_nested_bad_literal_names_dotted_key():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", {"serve.dtype": "int8"})
    msg = str(e.value)
    assert "serve.dtype: got 'int8'" in msg and "'bfloat16'" in msg


def test_unknown_key_names_dotted_key():
    with pytest.raises(ConfigError, match=r"sft\.lora\.rank: unknown key"):
        load_config("tiny", {"sft.lora.rank": 8})


def test_out_of_range_names_dotted_key():
    with pytest.raises(ConfigError, match=r"dpo\.beta: .*greater than 0"):
        load_config("tiny", {"dpo.beta": 0})


def test_lora_quantization_choices_under_any_strategy():
    assert load_config("tiny").sft.lora.quantization == "none"
    assert load_config("tiny", {"sft.lora.quantization": "nf4"}).sft.lora.quantization == "nf4"
    with pytest.raises(ConfigError, match=r"sft\.lora\.quantization: got 'int4'.*'nf4'"):
        load_config("tiny", {"sft.lora.quantization": "int4"})
    for strategy in ("ddp", "fsdp2"):           # FSDP2 shards the 4-bit base (tests/engine/test_dist.py)
        load_config("tiny", {"dpo.lora.quantization": "nf4", "dist.strategy": strategy})


def test_bad_lora_target_names_key_and_allowed_targets():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", {"dpo.lora.target_modules": ["q_proj", "qkv"]})
    msg = str(e.value)
    assert "dpo.lora" in msg and "lora.target_modules" in msg and "'qkv'" in msg
    for t in LORA_TARGETS:
        assert t in msg


def test_empty_lora_targets_rejected():
    with pytest.raises(ConfigError, match=r"lora.target_modules: unknown \(empty\)"):
        load_config("tiny", {"sft.lora.target_modules": []})


@pytest.mark.parametrize("overrides, words", [
    ({"model.hidden_size": 100}, "model.hidden_size (100) must be divisible by model.num_heads (6)"),
    ({"model.num_kv_heads": 4}, "model.num_heads (6) must be divisible by model.num_kv_heads (4)"),
    ({"model.hidden_size": 18, "model.num_heads": 6, "model.num_kv_heads": 1}, "head dim"),
])
def test_heads_not_dividing_names_the_keys(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides)
    assert words in str(e.value)


def test_error_mentions_source_file_and_overrides():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", {"device": "tpu"})
    assert "tiny.yaml" in str(e.value) and '"device": "tpu"' in str(e.value)


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError) as e:
        load_config("huge")
    msg = str(e.value)
    assert "'huge'" in msg
    for name in PRESETS:
        assert f"'{name}'" in msg
    with pytest.raises(ConfigError):
        preset_path("huge")


def test_stage_dir_layout(tmp_path):
    cfg = load_config("tiny", {"runs_dir": str(tmp_path / "runs"), "run_name": "exp-1"})
    assert cfg.run_dir == (tmp_path / "runs" / "exp-1").resolve()
    assert cfg.stage_dir("sft") == cfg.run_dir / "sft"
    assert cfg.stage_dir("export").parent == cfg.stage_dir("dpo").parent


def test_relative_runs_dir_resolves_against_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny")
    assert cfg.stage_dir("data") == tmp_path.resolve() / "runs" / "tiny" / "data"


def test_bad_run_name_rejected():
    with pytest.raises(ConfigError, match="run_name"):
        load_config("tiny", {"run_name": "a/b"})

