"""tokenizer.path: pretraining from scratch with a tokenizer the user already has (MiniMind's, a Llama's or a Qwen's)
instead of training one. Its files are copied into the run, the model's vocabulary is its size, bad directories are
refused before anything runs, and an edited tokenizer file re-runs the tokenizer stage."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from glm_lora.configs.errors import UserError
from glm_lora.configs.load import ConfigError, load_config
from glm_lora.data.tokenizer import chat_tokens, load_tokenizer
from glm_lora.engine.preflight import preflight
from glm_lora.flows.cli import run_one_stage
from glm_lora.tasks.cache import stage_key
from tests.chat_templates import build_tokenizer, labelled_spans

SMALL = {"data.synthetic.n_pretrain": 200, "data.synthetic.n_sft": 100, "data.synthetic.n_dpo": 10,
         "data.synthetic.n_eval": 10, "serve.enabled": False}


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE with Qwen3's specials and template: the layout of MiniMind's `model/` tokenizer."""
    return build_tokenizer(tmp_path_factory.mktemp("mine"), "qwen3", generation_config=False)


def _cfg(tmp_path: Path, path, **more):
    return load_config("tiny", {"runs_dir": str(tmp_path / "runs"), "tokenizer.path": str(path), **SMALL, **more})


def test_the_tokenizer_is_copied_and_the_model_takes_its_vocabulary(tmp_path: Path, qwen3_tokenizer: Path) -> None:
    cfg = _cfg(tmp_path, qwen3_tokenizer, **{"pretrain.max_steps": 2, "pretrain.batch_size": 2, "pretrain.log_every": 1})
    preflight(cfg)
    run_one_stage("data", cfg)
    ref = run_one_stage("tokenizer", cfg)
    theirs, ours = load_tokenizer(qwen3_tokenizer), load_tokenizer(ref.path)
    assert ref.manifest()["metrics"]["vocab_size"] == len(theirs) == len(ours)
    text = "What is 417 + 4? 答：421"
    assert ours(text).input_ids == theirs(text).input_ids
    # SFT rows render with the user's template and label what it puts after the generation prompt, to the end of turn
    ids, labels, _ = chat_tokens(ours, [{"role": "user", "content": "add 2 and 3"},
                                        {"role": "assistant", "content": "5"}])
    assert [ours.decode(s) for s in labelled_spans(ids, labels)] == ["<think>\n\n</think>\n\n5<|im_end|>"]
    run_one_stage("pretrain", cfg)
    hf_config = json.loads((cfg.stage_dir("pretrain") / "config.json").read_text())
    assert hf_config["vocab_size"] == len(theirs)


def test_an_edited_tokenizer_file_changes_the_stage_key(tmp_path: Path, qwen3_tokenizer: Path) -> None:
    mine = build_tokenizer(tmp_path / "copy", "qwen3", generation_config=False)
    cfg = _cfg(tmp_path, mine)
    data = [{"digest": "d" * 64}]
    before = stage_key("tokenizer", cfg, data, tmp_path / "out")
    vocab = mine / "tokenizer.json"
    edited = json.loads(vocab.read_text())
    edited["added_tokens"][0]["content"] = "<|endoftext_edited|>"
    vocab.write_text(json.dumps(edited))
    assert stage_key("tokenizer", cfg, data, tmp_path / "out") != before


def test_bad_directories_are_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"tokenizer.path .*missing.*not a directory"):
        preflight(_cfg(tmp_path, tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"tokenizer.path .*empty.*no tokenizer.json or tokenizer.model"):
        preflight(_cfg(tmp_path, tmp_path / "empty"))


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    mine = build_tokenizer(tmp_path / "plain", "qwen3", generation_config=False)
    config = json.loads((mine / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (mine / "tokenizer_config.json").write_text(json.dumps(config))
    (mine / "chat_template.jinja").unlink(missing_ok=True)
    cfg = _cfg(tmp_path, mine)
    run_one_stage("data", cfg)
    with pytest.raises(UserError, match=r"tokenizer.path .*plain.*no chat_template"):
        run_one_stage("tokenizer", cfg)


def test_not_with_base_model(tmp_path: Path, qwen3_tokenizer: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer.path is for pretraining from scratch"):
        _cfg(tmp_path, qwen3_tokenizer, base_model=str(tmp_path))
