"""engine/gate.py: the promotion gate refuses worse or unmeasured models, naming metric and numbers."""
from __future__ import annotations

import math

from glm_lora.engine.gate import lookup, promotion_gate

SERVED = {"sft": {"exact_match": 0.97, "per_family": {"add_en": 0.95}}, "dpo": {"implicit_reward_accuracy": 0.91},
          "pretrain": {"perplexity": 2.1}}
THRESHOLDS = {"sft.exact_match": 0.9, "dpo.implicit_reward_accuracy": 0.9}
NO_REGRESSION = ["sft.exact_match", "sft.per_family.add_en"]


def candidate(em=0.98, add=0.96, ira=0.92, ppl=2.0) -> dict:
    return {"sft": {"exact_match": em, "per_family": {"add_en": add}}, "dpo": {"implicit_reward_accuracy": ira},
            "pretrain": {"perplexity": ppl}}


def test_passes_when_better_than_served_and_thresholds():
    r = promotion_gate(candidate(), SERVED, thresholds=THRESHOLDS, no_regression=NO_REGRESSION)
    assert r.ok and r.reasons == []
    assert r.table.startswith("| metric | candidate | served | rule | result |")
    assert r.table.count("| pass |") == 4 and "FAIL" not in r.table


def test_fails_on_threshold_naming_metric_and_numbers():
    r = promotion_gate(candidate(ira=0.8), None, thresholds=THRESHOLDS, no_regression=NO_REGRESSION)
    assert not r.ok
    assert r.reasons == ["dpo.implicit_reward_accuracy: candidate 0.8 is not ≥ 0.9 (threshold)"]
    assert "| dpo.implicit_reward_accuracy | 0.8 | — | ≥ 0.9 | **FAIL** |" in r.table
    assert "did not apply" in r.table   # no served model: only thresholds


def test_refuses_a_worse_model_than_the_served_one():
    r = promotion_gate(candidate(em=0.95, add=0.90), SERVED, thresholds=THRESHOLDS, no_regression=NO_REGRESSION)
    assert not r.ok and len(r.reasons) == 2
    assert "sft.exact_match" in r.reasons[0] and "0.95" in r.reasons[0] and "0.97" in r.reasons[0]
    assert "sft.per_family.add_en" in r.reasons[1] and "0.9" in r.reasons[1] and "0.95" in r.reasons[1]
    assert "| sft.exact_match | 0.95 | 0.97 | ≥ served | **FAIL** |" in r.table


def test_missing_or_unmeasured_metric_fails():
    cand = candidate()
    del cand["dpo"]
    cand["sft"]["per_family"]["add_en"] = None
    r = promotion_gate(cand, SERVED, thresholds=THRESHOLDS, no_regression=NO_REGRESSION)
    assert not r.ok
    assert any(x.startswith("dpo.implicit_reward_accuracy: candidate metric is missing") for x in r.reasons)
    assert any(x.startswith("sft.per_family.add_en: candidate metric is None") for x in r.reasons)
    # NaN counts as unmeasured; a served model lacking the metric can't be compared either.
    r = promotion_gate(candidate(em=math.nan), {"sft": {}}, thresholds={}, no_regression=["sft.exact_match"])
    assert not r.ok and "candidate metric is nan" in r.reasons[0]
    r = promotion_gate(candidate(), {"sft": {}}, thresholds={}, no_regression=["sft.exact_match"])
    assert not r.ok and "served model's metric is missing" in r.reasons[0]


def test_tolerance_allows_small_regressions_only():
    kw = dict(thresholds={}, no_regression=["sft.exact_match"])
    assert promotion_gate(candidate(em=0.965), SERVED, tolerance=0.01, **kw).ok
    assert promotion_gate(candidate(em=0.97), SERVED, **kw).ok                # equal is not a regression
    r = promotion_gate(candidate(em=0.955), SERVED, tolerance=0.01, **kw)
    assert not r.ok and "tolerance 0.01" in r.reasons[0] and "≥ served − 0.01" in r.table


def test_lower_is_better_metrics():
    kw = dict(thresholds={"pretrain.perplexity": 3.0}, no_regression=["pretrain.perplexity"])
    assert promotion_gate(candidate(ppl=2.0), SERVED, **kw).ok
    r = promotion_gate(candidate(ppl=3.5), SERVED, **kw)
    assert not r.ok and len(r.reasons) == 2
    assert "not ≤ 3 (threshold)" in r.reasons[0] and "higher by 1.4" in r.reasons[1]


def test_lookup_dotted_and_flat_keys():
    assert lookup({"a": {"b.c": {"d": 1}}}, "a.b.c.d") == 1
    assert lookup({"sft.exact_match": 0.5}, "sft.exact_match") == 0.5
    assert promotion_gate({"sft.exact_match": 0.5}, None, thresholds={"sft.exact_match": 0.5}, no_regression=[]).ok
