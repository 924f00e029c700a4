"""The config part of every stage's cache key is what it was at deefde7 (before the Config stopped being
passed around as a dict): a run directory published by that version is reused for its config and data
whenever the code packages are unchanged. A change here is a deliberate schema change, not a refactor: the
keys added since are listed in ADDED (a new key changes the config part of the key of the stages it belongs to)."""
import json
from pathlib import Path

import pytest

from glm_lora.configs.load import load_config
from glm_lora.tasks.cache import key_parts
from glm_lora.tasks.table import STAGES

GOLDEN = json.loads((Path(__file__).parent / "data" / "key_parts_deefde7.json").read_text())
ADDED = {"router_aux_loss",        # TrainConfig (every training section), for MoE router health (issue 25)
         "loss", "simpo_gamma", "orpo_lambda", "kto_desirable_weight", "kto_undesirable_weight",   # dpo.loss (26)
         "harness",                # serve.gate.harness (27; eval.harness is the harness stage's, not in export's key)
         "share_prompt",           # dpo.share_prompt (28: a pair's prompt placed once; changes dpo's batches)
         "cuda_graphs",            # TrainConfig (28: the blocks replayed as CUDA graphs on a GPU)
         "mtp", "mtp_weight", "mtp_layers",   # sft/dpo.mtp, <stage>.mtp_weight, model.mtp_layers: the MTP layer
         "path"}                   # tokenizer.path (59: pretraining with a tokenizer the user has)
# Values of a preset changed on purpose since deefde7 (they change the key of the stages whose sections hold them):
# 28: fewer SFT steps (4500 → 4000 at lr 3e-3, then 3500 with the arithmetic families weighted up in the SFT mix),
# then DPO 300 → 150 steps and back to 300 (150 left held-out reward accuracy under 90 %); sft.compile true → auto (a
# shortened SFT stage, fewer than 400 steps, runs eager: the cold compile would only add time); small's pretraining
# compiled (1.39x its eager step on an H100)
ARITHMETIC_MIX = {"add_en": 3.0, "add_zh": 3.0, "sub_en": 3.0, "sub_zh": 3.0, "units_en": 2.0, "units_zh": 2.0}
RETUNED = {"tiny": {"sft": {"max_steps": 3500, "lr": 3e-3, "min_lr_ratio": 0.0, "compile": "auto"},
                    "data": {"synthetic": {"sft_weights": ARITHMETIC_MIX}}},
           "small": {"pretrain": {"compile": True}}}


def _merged(old: dict, new: dict) -> dict:
    return {k: _merged(old[k], v) if isinstance(v, dict) and v and isinstance(old.get(k), dict) else v
            for k, v in {**old, **new}.items()}


def _retuned(preset: str, expected: dict) -> dict:
    config = dict(expected["config"])
    for section, values in RETUNED.get(preset, {}).items():
        if section in config:
            config[section] = _merged(config[section], values)
    return {**expected, "config": config}


def _without_added(node):
    if isinstance(node, dict):
        return {k: _without_added(v) for k, v in node.items() if k not in ADDED}
    return node


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_config_sections_of_the_key_are_unchanged(case):
    preset_overrides, stage = case.rsplit(":", 1)
    preset, overrides = preset_overrides.split("{", 1)
    cfg = load_config(preset, json.loads("{" + overrides))
    parts = key_parts(stage, cfg, [], Path("/x"))
    got = {"config": _without_added(parts["config"]), "user_files": parts["user_files"]}
    assert got == _retuned(preset, GOLDEN[case])


NEW_STAGES = {"rl", "gguf", "harness"}   # stages added since deefde7 (GRPO, GGUF, lm-eval): no published key to keep


def test_harness_settings_are_the_harness_stages_alone():
    """eval.harness sits in the eval section the export's key holds, but changes only the harness stage's key."""
    plain, benched = load_config("tiny"), load_config("tiny", {"eval.harness.tasks": ["glm_lora_arithmetic"]})
    for stage in set(STAGES) - {"harness"}:
        assert key_parts(stage, plain, [], Path("/x"))["config"] == key_parts(stage, benched, [], Path("/x"))["config"]
    assert key_parts("harness", benched, [], Path("/x"))["config"]["eval.harness"]["tasks"] == ["glm_lora_arithmetic"]


def test_every_stage_is_covered():
    assert {c.rsplit(":", 1)[1] for c in GOLDEN} == set(STAGES) - NEW_STAGES
