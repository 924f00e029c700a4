"""A tiny model pretrained from scratch with an MTP layer (model.mtp_layers: 1), then fine-tuned with `sft.mtp: carry`
and with `train`: the stages' own held-out MTP draft acceptance before and after. A measured claim, printed: `train`
keeps the acceptance within 2 points of the pretrained model's (or raises it), `carry` lets it fall (the main model
moves, its draft layer does not)."""
import json

import pytest
from pydantic import ValidationError
from safetensors.torch import load_file

from glm_lora.artifacts.manifest import read_manifest
from glm_lora.configs.errors import UserError
from glm_lora.configs.load import load_config
from glm_lora.configs.schema import Config
from glm_lora.engine.checkpoint import _dir_key
from glm_lora.engine.preflight import _check_mtp
from glm_lora.flows.cli import run_one_stage
from glm_lora.model import DecoderConfig
from glm_lora.model.hf import load_native, save_hf

SMALL = {"threads": 1, "serve.enabled": False, "eval.max_rows": 64, "eval.max_new_tokens": 4, "eval.compare_prompts": [],
         "tokenizer.vocab_size": 600, "data.synthetic.n_pretrain": 400, "data.synthetic.n_sft": 400,
         "data.synthetic.n_dpo": 8, "data.synthetic.n_eval": 64,
         "model.hidden_size": 64, "model.num_layers": 2, "model.num_heads": 2, "model.num_kv_heads": 1,
         "model.intermediate_size": 128, "model.max_seq_len": 128, "model.mtp_layers": 1, "serve.max_model_len": 128,
         "pretrain.max_steps": 60, "pretrain.batch_size": 8, "pretrain.seq_len": 64, "pretrain.lr": 5e-3,
         "pretrain.warmup_steps": 5, "sft.max_steps": 40, "sft.batch_size": 8, "sft.seq_len": 64, "sft.warmup_steps": 2,
         "dpo.seq_len": 64, "checkpoint.save_every": 1000, "checkpoint.save_optimizer_every": 1000}


def test_sft_mtp_train_keeps_the_drafts_acceptance_and_carry_loses_it(tmp_path):
    acceptance = {}
    for mode in ("carry", "train"):
        cfg = load_config("tiny", {**SMALL, "runs_dir": str(tmp_path), "sft.mtp": mode})
        for stage in ("data", "tokenizer", "pretrain", "sft"):      # the first three built once, then cached
            run_one_stage(stage, cfg)
        ev = read_manifest(cfg.stage_dir("sft"))["metrics"]["eval"]
        acceptance[mode], acceptance["pretrained"] = ev["mtp_acceptance"], ev["mtp_acceptance_base"]
        assert ev["mtp_positions"] > 200                            # the held-out answers' tokens t+2
    print("MTP draft acceptance on held-out SFT answers:", json.dumps(acceptance))
    assert acceptance["train"] >= acceptance["pretrained"] - 0.02, acceptance
    assert acceptance["carry"] < acceptance["pretrained"] - 0.02, acceptance

    pretrained = cfg.stage_dir("pretrain")
    assert read_manifest(pretrained)["metrics"]["eval"]["mtp_acceptance"] > 0.3     # it learned, on pretraining text
    carried = load_file(pretrained / "carried.safetensors")
    assert "model.layers.2.eh_proj.weight" in carried and not any(k.startswith("mtp.") for k in
                                                                    load_file(pretrained / "model.safetensors"))
    save_hf(load_native(pretrained), tmp_path / "hf", bos_id=None, eos_id=None, pad_id=None)   # a llama layout:
    assert not any(".layers.2." in k for k in load_file(tmp_path / "hf" / "model.safetensors"))  # no MTP in HF's class


def test_the_mtp_keys_change_the_checkpoint_directory_only_where_they_change_training():
    """Checkpoints made before the MTP keys existed are still found: at carry / mtp_layers 0 they are not hashed."""
    plain = Config()
    key = lambda cfg, stage: _dir_key(cfg, stage, getattr(cfg, stage), [])          # noqa: E731
    weighted = plain.model_copy(update={"sft": plain.sft.model_copy(update={"mtp_weight": 0.1}),
                                        "pretrain": plain.pretrain.model_copy(update={"mtp_weight": 0.1})})
    assert key(weighted, "sft") == key(plain, "sft") and key(weighted, "pretrain") == key(plain, "pretrain")
    mtp = Config(model={"mtp_layers": 1}, sft={"mtp": "train"})
    assert key(mtp, "sft") != key(Config(model={"mtp_layers": 1}), "sft") != key(plain, "sft")
    assert key(mtp, "pretrain") != key(plain, "pretrain")


def test_mtp_train_without_an_mtp_layer_is_refused_naming_the_key_and_where_the_model_comes_from():
    with pytest.raises(ValidationError, match=r"dpo.mtp: train needs a model with an MTP .* model.mtp_layers is 0"):
        Config(dpo={"mtp": "train"})
    cfg = Config(base_model="bases/glm", sft={"mtp": "train"})
    no_mtp = DecoderConfig(vocab_size=10, hidden_size=16, num_heads=2, num_kv_heads=1)
    with pytest.raises(UserError, match=r"sft.mtp: train .* bases/glm/config.json declares none \(num_nextn_predict"):
        _check_mtp(cfg, no_mtp)
    _check_mtp(cfg, DecoderConfig(vocab_size=10, hidden_size=16, num_heads=2, num_kv_heads=1,
                                  num_nextn_predict_layers=1))
