"""tasks/report.py: the tables and the loss curve a stage shows in the Prefect UI."""
from __future__ import annotations

import json

from glm_lora.tasks import report

EVAL = {"exact_match": 0.5, "chrf": 0.7, "per_family": {"add_en": 0.25, "copy_en": 0.75},
        "chrf_per_family": {"add_en": 0.5, "copy_en": 0.9}, "n_per_family": {"add_en": 4, "copy_en": 4},
        "data": {"sft_eval": {"source": "held out of /d/chat.jsonl", "rows": 8}},
        "samples": [{"task": "add_en", "prompt": "1+1", "reference": "2", "answer": "3", "correct": False}]}


def test_metric_rows_have_units_and_skip_non_scalars():
    rows = report.metric_rows({"loss": 1.25, "tokens_per_s": 1000.0, "elapsed_s": 3.0, "eval": EVAL, "stopped": True})
    assert rows == [{"metric": "loss", "value": "1.25", "unit": "nats/token"},
                    {"metric": "tokens_per_s", "value": "1000", "unit": "tokens/s"},
                    {"metric": "elapsed_s", "value": "3", "unit": "s"}]


def test_eval_rows_name_their_data_and_families_are_one_row_each():
    assert all(r["held-out data"] == "sft_eval: held out of /d/chat.jsonl (8 rows)" for r in report.eval_rows(EVAL))
    assert report.family_rows(EVAL) == [{"family": "add_en", "exact_match": "0.25", "chrf": "0.5", "rows": 4},
                                        {"family": "copy_en", "exact_match": "0.75", "chrf": "0.9", "rows": 4}]


def test_the_mtp_table_shows_draft_acceptance_before_and_after_the_stage():
    ev = {"mtp_acceptance": 0.61, "mtp_acceptance_sft": 0.6, "mtp_positions": 298}
    assert report.mtp_rows("dpo", ev) == [
        {"model": "before DPO (the SFT model)", "mtp_acceptance": "0.6", "held-out positions": 298},
        {"model": "after dpo", "mtp_acceptance": "0.61", "held-out positions": 298}]
    assert report.mtp_rows("sft", EVAL) == [] and report.unit("mtp_acceptance_sft") == "fraction"
    assert {r["metric"]: r["unit"] for r in report.eval_rows(ev)}["mtp_positions"] == "tokens"


def test_cleaning_rows_count_by_reason():
    clean = {"dropped": {"bad_row": 2, "overlong": 1}, "examples": {"bad_row": ["chat.jsonl:3: ..."]}, "kept": 10,
             "truncated": 3}
    assert report.cleaning_rows(clean) == [
        {"reason": "bad_row", "rows": 2, "example": "chat.jsonl:3: ..."}, {"reason": "overlong", "rows": 1, "example": ""},
        {"reason": "truncated", "rows": 3, "example": ""}, {"reason": "kept", "rows": 10, "example": ""}]


def test_loss_curve_is_a_png_with_the_best_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 / s}) + "\n" for s in (1, 2, 3)))
    png = report.loss_curve("sft", tmp_path, {"val_losses": [[2, 1.4], [3, 1.2]], "best_step": 3}, tmp_path / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert report.loss_curve("sft", tmp_path / "none", {}, tmp_path / "x.png") is None
