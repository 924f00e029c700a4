"""evaluation/gate.py: the promotion gate refuses worse or unmeasured models, naming metric and numbers."""
from __future__ import annotations

import math

from glm_lora.evaluation.gate import lookup, promotion_gate

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


def _scored(score, higher_is_better=True) -> dict:
    """Metrics with an lm-evaluation-harness score (evaluation/harness.py's shape) for the task `arith`."""
    return {"harness": {"arith": {"metric": "exact_match", "exact_match": score, "score": score,
                                  "higher_is_better": higher_is_better}}}


def test_harness_score_must_beat_the_served_models_by_min_delta():
    kw = dict(thresholds={}, no_regression=[])
    assert promotion_gate(_scored(0.62), _scored(0.60), harness={"arith": 0.02}, **kw).ok
    r = promotion_gate(_scored(0.61), _scored(0.60), harness={"arith": 0.02}, **kw)
    assert not r.ok and r.reasons == ["harness.arith: candidate 0.61 does not beat the served model's 0.6 by "
                                      "min_delta 0.02"]
    assert "| harness.arith | 0.61 | 0.6 | ≥ served + 0.02 | **FAIL** |" in r.table
    # a negative min_delta allows that much loss, no more
    assert promotion_gate(_scored(0.55), _scored(0.60), harness={"arith": -0.05}, **kw).ok
    r = promotion_gate(_scored(0.54), _scored(0.60), harness={"arith": -0.05}, **kw)
    assert not r.ok and "regresses against the served model's 0.6 (lower by 0.06, min_delta -0.05)" in r.reasons[0]
    # a lower-is-better metric (e.g. perplexity) moves the other way
    assert promotion_gate(_scored(9.0, False), _scored(10.0, False), harness={"arith": 0.5}, **kw).ok
    assert not promotion_gate(_scored(9.8, False), _scored(10.0, False), harness={"arith": 0.5}, **kw).ok


def test_harness_reference_is_the_base_model_where_the_served_one_has_no_score():
    kw = dict(thresholds={}, no_regression=[], harness={"arith": 0.1})
    r = promotion_gate(_scored(0.5), None, base=_scored(0.45), **kw)      # nothing served: vs the base
    assert not r.ok and "does not beat the base model's 0.45 by min_delta 0.1" in r.reasons[0]
    assert "| harness.arith | 0.5 | 0.45 (base) | ≥ base + 0.1 | **FAIL** |" in r.table
    assert promotion_gate(_scored(0.56), {"sft": {}}, base=_scored(0.45), **kw).ok   # served before the task was
    assert not promotion_gate(_scored(0.56), _scored(0.5), base=_scored(0.1), **kw).ok   # the served one decides
    r = promotion_gate(_scored(0.0), None, **kw)                           # no reference: only measured
    assert r.ok and "| harness.arith | 0 | — | measured | pass |" in r.table


def test_a_missing_harness_score_fails():
    kw = dict(thresholds={}, no_regression=[], harness={"arith": -1.0})
    for cand in ({}, {"harness": {}}, _scored(None), _scored(math.nan)):
        for served, base in ((None, None), (_scored(0.5), None), (None, _scored(0.5))):
            r = promotion_gate(cand, served, base=base, **kw)
            assert not r.ok and r.reasons[0].startswith("harness.arith: candidate score is "), (cand, served, base)
            assert "the harness stage must measure this export" in r.reasons[0]
    assert promotion_gate({}, None, thresholds={}, no_regression=[], harness={}).ok      # not asked for: not checked
