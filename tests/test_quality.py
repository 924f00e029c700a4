"""The embedded default learns: the whole tiny DAG (default config, no serving) clears stated floors.

These floors sit below what the default reaches (README "Answer quality") so that noise between
machines passes while a regression in learning (data, tokenizer, model, losses, schedule) fails.
"""
import pytest

from glm_lora.configs import load_config
from glm_lora.flows.cli import run_one_stage

pytestmark = pytest.mark.slow

# Measured on the default (README): stated here, checked below.
# The same seed lands differently from run to run on the CPU (bf16 rounding through 4500 steps: the fresh-clone
# flow and this test, both seed 0, gave SFT exact match 0.92 and 0.96), so the floors sit just below the
# lowest of the 9-seed GPU sweep and of the CPU runs, not at their medians.
FLOORS = {
    "pretrain_perplexity_drop": 5.0,        # held-out perplexity at init / after pretraining
    "sft_val_loss_drop": 1.0,               # first → best SFT validation loss (nats per answer token)
    "sft_exact_match": 0.89,                # mean over the 10 families (CPU runs 0.92, 0.96; GPU sweep of the same
                                            # recipe in bf16, median of 9 seeds 0.95, range 0.905–0.975)
    "sft_lowest_family": 0.65,              # the weakest family, add or sub (CPU runs 0.70, 0.85; sweep 0.70–0.90)
    "sft_string_families": 0.95,            # copy/reverse, en + zh (measured 1.0)
    "dpo_implicit_reward_accuracy": 0.86,   # CPU runs 0.945, 0.925; GPU sweep median 0.91 (0.885–0.95)
    "dpo_exact_match_loss": 0.025,          # DPO may cost at most this much exact match (CPU runs +1, −1.5 points;
                                            # sweep −2…+2.5, median 0)
}


@pytest.fixture(scope="module")
def metrics(tmp_path_factory):
    cfg = load_config("tiny", {"runs_dir": str(tmp_path_factory.mktemp("quality")), "serve.enabled": False})
    out = {}
    for stage in ("data", "tokenizer", "pretrain", "sft", "dpo"):
        out[stage] = run_one_stage(stage, cfg).manifest()["metrics"]
    return out


def test_pretraining_cuts_held_out_perplexity(metrics):
    e = metrics["pretrain"]["eval"]
    assert e["init_perplexity"] / e["perplexity"] >= FLOORS["pretrain_perplexity_drop"], e


def test_sft_validation_loss_falls_and_the_best_weights_are_kept(metrics):
    m = metrics["sft"]
    first = m["val_losses"][0][1]
    assert first - m["best_val_loss"] >= FLOORS["sft_val_loss_drop"], m["val_losses"]
    assert m["best_val_loss"] == min(v for _, v in m["val_losses"])


def test_sft_answers_held_out_prompts(metrics):
    e = metrics["sft"]["eval"]
    assert e["exact_match"] >= FLOORS["sft_exact_match"], e["per_family"]
    assert min(e["per_family"].values()) >= FLOORS["sft_lowest_family"], e["per_family"]
    strings = {f: v for f, v in e["per_family"].items() if f.startswith(("copy", "reverse"))}
    assert len(strings) == 4 and min(strings.values()) >= FLOORS["sft_string_families"], strings


def test_dpo_prefers_chosen_answers_on_held_out_pairs(metrics):
    e = metrics["dpo"]["eval"]
    assert e["implicit_reward_accuracy"] >= FLOORS["dpo_implicit_reward_accuracy"], e
    assert e["mean_margin"] > 0, e
    assert e["exact_match"] >= metrics["sft"]["eval"]["exact_match"] - FLOORS["dpo_exact_match_loss"], e
