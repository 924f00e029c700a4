"""serve.api_key_env / serve.api_key_secret: only names are configured; a missing key fails before
any server is touched, naming the option."""
from __future__ import annotations

import pytest

from glm_lora.configs.load import ConfigError, load_config
from glm_lora.configs.errors import UserError
from glm_lora.serve.stage import api_key, serve


def test_both_sources_are_refused() -> None:
    with pytest.raises(ConfigError, match="serve.api_key_env and serve.api_key_secret") as e:
        load_config("tiny", {"serve.api_key_env": "GLM_KEY", "serve.api_key_secret": "glm-key"})
    assert isinstance(e.value, UserError)


def test_env_name_must_be_a_variable_name() -> None:
    with pytest.raises(ConfigError, match="serve.api_key_env"):
        load_config("tiny", {"serve.api_key_env": "not a name"})


@pytest.mark.parametrize("value", [None, ""])
def test_unset_or_empty_env_var_fails_naming_it(monkeypatch, tmp_path, value) -> None:
    monkeypatch.delenv("GLM_LORA_NO_SUCH_KEY", raising=False)
    if value is not None:
        monkeypatch.setenv("GLM_LORA_NO_SUCH_KEY", value)
    cfg = load_config("tiny", {"serve.api_key_env": "GLM_LORA_NO_SUCH_KEY", "runs_dir": str(tmp_path)})
    with pytest.raises(UserError, match="serve.api_key_env: the environment variable GLM_LORA_NO_SUCH_KEY is unset or empty"):
        serve(cfg, tmp_path / "no-export", tmp_path / "out")   # fails before reading the export or any server


def test_key_comes_from_the_named_env_var(monkeypatch) -> None:
    monkeypatch.setenv("GLM_LORA_TEST_KEY", "s3cret")
    cfg = load_config("tiny", {"serve.api_key_env": "GLM_LORA_TEST_KEY"})
    assert api_key(cfg.serve) == ("s3cret", "environment variable GLM_LORA_TEST_KEY")
    assert "s3cret" not in cfg.model_dump_json()
    assert api_key(load_config("tiny").serve) == (None, None)
