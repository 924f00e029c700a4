"""The promotion gate: a candidate model is exported/served only if its held-out metrics clear
fixed thresholds and do not regress against the model being served now.

Metric names are dotted paths into the nested metrics dict ("sft.exact_match",
"sft.per_family.add_en"); a key that itself contains dots is found too. Higher is better,
except for metrics in `lower_is_better` (matched by full name or by the last name part: loss,
perplexity, ...), where a threshold is a maximum and a regression is an increase.
A missing or non-numeric (None, NaN) metric fails the gate: nothing is promoted on an unknown.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection

from glm_lora.configs.load import MISSING

LOWER_IS_BETTER = ("loss", "perplexity", "bits_per_byte", "rejected_match_rate")
_MISSING = MISSING    # the one "no such key" sentinel (configs.get_dotted)


@dataclass
class GateResult:
    ok: bool
    reasons: list[str]   # one line per failed check, naming the metric and the numbers
    table: str           # markdown: metric, candidate, served, rule, pass/fail


def lookup(metrics: dict, name: str) -> Any:
    """The value at dotted path `name` (a key containing dots is tried whole first); _MISSING if none."""
    if not isinstance(metrics, dict):
        return _MISSING
    if name in metrics:
        return metrics[name]
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):      # longest key prefix first
        head = ".".join(parts[:i])
        if head in metrics:
            found = lookup(metrics[head], ".".join(parts[i:]))
            if found is not _MISSING:
                return found
    return _MISSING


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def _fmt(value: Any) -> str:
    if value is _MISSING:
        return "missing"
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def promotion_gate(candidate: dict, served: dict | None, *, thresholds: dict[str, float],
                   no_regression: list[str], tolerance: float = 0.0, harness: dict[str, float] | None = None,
                   base: dict | None = None, lower_is_better: Collection[str] = LOWER_IS_BETTER) -> GateResult:
    """Check `candidate`'s metrics against `thresholds` and, when `served` is given, against the
    served model's on every `no_regression` metric (allowing `tolerance`, in the metric's units).

    With served=None (nothing served yet) only the thresholds apply. A served model that lacks a
    no_regression metric fails the check: re-evaluate it on the current eval set first (the two
    models must be measured on the same data for the comparison to mean anything).

    `harness` (task → min_delta, serve.gate.harness): the candidate's lm-evaluation-harness score
    (`harness.<task>.score`, evaluation/harness.py) must be present and beat the served model's by min_delta
    (negative: that much loss allowed); where the served model has no score (nothing served, or served before
    the task was), `base`'s (the export's base model, scored by the same stage); with neither, presence only.
    """
    rows: list[tuple[str, str, str, str, bool]] = []
    reasons: list[str] = []

    def lower(name: str) -> bool:
        return name in lower_is_better or name.rsplit(".", 1)[-1] in lower_is_better

    def check(name: str, rule: str, ok: bool, cand: Any, base: Any, reason: str) -> None:
        rows.append((name, _fmt(cand), _fmt(base), rule, ok))
        if not ok:
            reasons.append(reason)

    def against(name: str, raw: Any, ref_raw: Any, who: str, margin: float, low: bool, knob: str) -> None:
        """candidate ≥ reference + margin (≤ reference − margin where lower is better): the one comparison with
        another model's number, for no_regression (margin −tolerance) and harness (margin min_delta)."""
        value, ref = _number(raw), _number(ref_raw)
        offset = -margin if low else margin
        rule = f"{'≤' if low else '≥'} {who}"
        if offset:
            rule += f" {'+' if offset > 0 else '−'} {abs(offset):g}"
        shown = _fmt(ref_raw) + ("" if who == "served" else f" ({who})")      # the table's column is "served"
        if value is None:
            check(name, rule, False, raw, shown, f"{name}: candidate metric is {_fmt(raw)}; cannot compare "
                                                f"with the {who} model's {_fmt(ref_raw)}")
        elif ref is None:
            check(name, rule, False, raw, shown, f"{name}: {who} model's metric is {_fmt(ref_raw)}; "
                                                "re-evaluate it on the current eval set to compare")
        else:
            ok = value <= ref + offset if low else value >= ref + offset
            how = (f"regresses against the {who} model's {ref:.4g} ({'higher' if low else 'lower'} by "
                   f"{abs(value - ref):.4g}, {knob})" if (value > ref if low else value < ref) else
                   f"does not beat the {who} model's {ref:.4g} by {knob}")
            check(name, rule, ok, raw, shown, f"{name}: candidate {value:.4g} {how}")

    for name, limit in thresholds.items():
        raw = lookup(candidate, name)
        value, low = _number(raw), lower(name)
        rule = f"{'≤' if low else '≥'} {limit:g}"
        if value is None:
            check(name, rule, False, raw, "", f"{name}: candidate metric is {_fmt(raw)}; needs {rule}")
            continue
        ok = value <= limit if low else value >= limit
        check(name, rule, ok, raw, "", f"{name}: candidate {value:.4g} is not {rule} (threshold)")

    for name in no_regression if served is not None else ():
        against(name, lookup(candidate, name), lookup(served, name), "served", -tolerance, lower(name),
                f"tolerance {tolerance:g}")

    for task, min_delta in (harness or {}).items():
        name, score = f"harness.{task}", f"harness.{task}.score"
        raw = lookup(candidate, score)
        refs = [(who, lookup(m, score)) for who, m in (("served", served), ("base", base)) if m is not None]
        ref = next(((who, r) for who, r in refs if _number(r) is not None), None)
        if ref is None or _number(raw) is None:       # nothing to compare with, or nothing measured
            check(name, "measured", _number(raw) is not None, raw, "",
                  f"{name}: candidate score is {_fmt(raw)}; the harness stage must measure this export")
            continue
        low = lookup(candidate, f"harness.{task}.higher_is_better") is False
        against(name, raw, ref[1], ref[0], min_delta, low, f"min_delta {min_delta:g}")

    table = ["| metric | candidate | served | rule | result |", "|---|---|---|---|---|"]
    table += [f"| {n} | {c} | {b or '—'} | {r} | {'pass' if ok else '**FAIL**'} |" for n, c, b, r, ok in rows]
    if served is None and no_regression:
        table.append(f"\nNo served model yet: the no-regression checks ({', '.join(no_regression)}) did not apply.")
    return GateResult(ok=not reasons, reasons=reasons, table="\n".join(table) + "\n")
