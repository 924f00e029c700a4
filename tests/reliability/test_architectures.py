"""Bad input about model architectures, through the real CLI: a base model whose config.json asks for
what our decoder cannot reproduce exactly (experts outside glm4_moe, sliding windows, rope scaling, a bias or partial rotary
where the layout has none) and model settings of the from-scratch layouts. Each must exit 2 with one
line naming config.json (or the config key) and what is supported, before anything is written.
A GLM-4-0414 base model itself imports through the CLI."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.reliability.conftest import run_cli, tiny_hf_base, write_config
from tests.reliability.test_bad_input import expect_user_error


@pytest.fixture(scope="module")
def glm4_base(tmp_path_factory) -> Path:
    return tiny_hf_base(tmp_path_factory.mktemp("glm4"), "Glm4ForCausalLM", head_dim=32)


def base_with(workdir: Path, base: Path, **changes) -> Path:
    dest = workdir / "base"
    shutil.copytree(base, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(changes)
    (dest / "config.json").write_text(json.dumps(cfg))
    return write_config(workdir, {"base_model": str(dest), "sft": {"seq_len": 64}, "dpo": {"seq_len": 64}})


@pytest.mark.parametrize("changes, words", [
    ({"n_routed_experts": 64, "num_experts_per_tok": 8}, ["n_routed_experts=64", "mixture of experts",
                                                          "model_type 'glm4'", "supported: experts in glm4_moe"]),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     ["rope_parameters rope type 'yarn'", "supported: 'default'"]),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": True,
      "partial_rotary_factor": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     ["attention_bias=true", "model_type 'llama'", "supported: q/k/v bias in qwen2, glm, glm4"]),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "partial_rotary_factor": None,
      "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "use_sliding_window": True, "sliding_window": 32},
     ["use_sliding_window=true", "supported: full attention"]),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "partial_rotary_factor": 0.5},
     ["partial_rotary_factor 0.5", "model_type 'qwen2'", "supported: partial rotary in glm, glm4"]),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]},
     ["model_type 'mixtral'", "MixtralForCausalLM", "supported:", "Glm4MoeForCausalLM (model_type 'glm4_moe')"]),
    ({"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"]},      # a GLM-4.5 config without its experts
     ["n_routed_experts must be a positive integer for model_type 'glm4_moe'"]),
])
def test_unsupported_base_model_layouts_name_the_key(workdir, glm4_base, changes, words):
    expect_user_error(workdir, base_with(workdir, glm4_base, **changes), "config.json", *words)


@pytest.mark.parametrize("model, words", [
    ({"qk_norm": True}, ["model.qk_norm was replaced by model.arch", "arch: qwen3"]),
    ({"arch": "glm5"}, ["model.arch", "'glm5'", "'glm4'"]),
    ({"arch": "glm4", "hidden_size": 68}, ["model.arch glm4", "head dim", "divisible by 4"]),
])
def test_bad_model_layout_settings_name_the_key(workdir, model, words):
    expect_user_error(workdir, write_config(workdir, {"model": model}), "case.yaml", *words)


def test_a_glm4_base_model_imports(workdir, glm4_base):
    cfg = base_with(workdir, glm4_base)
    proc = run_cli("stage", "import_base", "--config", str(cfg), cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    native = json.loads((workdir / "runs" / "case" / "import_base" / "config.json").read_text())
    assert (native["arch"], native["attention_bias"], native["partial_rotary_factor"]) == ("glm4", True, 0.5)
