"""The metrics a training stage reports at its end on the held-out splits (evaluation.metrics), read from the data
artifact like training data (`data.on_bad_row`, `data.max_line_bytes`), each result naming the rows it came from
(`data`).
"""
from __future__ import annotations

import itertools
import logging
from pathlib import Path

from glm_lora.configs.schema import Config
from glm_lora.data import formats
from glm_lora.data.cleaning import CleanReport
from glm_lora.data.prepare import split_path, split_provenance
from glm_lora.data.encode import lm_examples
from glm_lora.evaluation.metrics import (
    answer_examples, answer_metrics, kto_metrics, lm_metrics, preference_metrics, read_task_rows, rejected_match_rate,
    task_metrics,
)
from glm_lora.evaluation.mtp import acceptance
from glm_lora.model import mtp
from glm_lora.model.lora import lora_disabled

log = logging.getLogger("glm_lora.heldout")


def eval_lm(cfg: Config, model, tok, data_dir: Path) -> dict:
    """Held-out LM metrics on pretrain_eval, read like training data (data.on_bad_row, data.max_line_bytes):
    with on_bad_row=skip a bad row is counted in `bad_rows_pretrain_eval` instead of failing the stage."""
    dc, report = cfg.data, CleanReport(max_examples=cfg.data.report_examples)
    rows = formats.read_pretrain(split_path(data_dir, "pretrain_eval"), on_bad_row=dc.on_bad_row, report=report,
                                 max_line_bytes=dc.max_line_bytes)
    texts = list(itertools.islice(rows, cfg.eval.max_rows))
    metrics = lm_metrics(model, tok, texts, seq_len=cfg.pretrain.seq_len)
    if mtp.has_mtp(model):          # model.mtp_layers: the MTP layer's drafts on the same text
        examples = lm_examples(texts, tok, seq_len=cfg.pretrain.seq_len, min_tokens=1, report=CleanReport())
        metrics |= acceptance(model, list(examples), seq_len=cfg.pretrain.seq_len)
    if report.dropped.get("bad_row"):
        log.warning("pretrain_eval: skipped %d bad rows, e.g. %s", report.dropped["bad_row"],
                    report.examples.get("bad_row", []))
    return {**metrics, "bad_rows_pretrain_eval": report.dropped.get("bad_row", 0),
            "data": {"pretrain_eval": split_provenance(data_dir, "pretrain_eval", len(texts))}}


def eval_mtp(cfg: Config, model, tok, data_dir: Path, examples: list | None = None) -> dict:
    """A model with an MTP layer: its draft acceptance on sft_eval's answers (evaluation/mtp.py; `examples`: those
    rows tokenised already, `answer_examples`); {} without one."""
    if not mtp.has_mtp(model):
        return {}
    if examples is None:
        dc = cfg.data
        rows = read_task_rows(split_path(data_dir, "sft_eval"), limit=cfg.eval.max_rows, on_bad_row=dc.on_bad_row,
                              report=CleanReport(max_examples=0), max_line_bytes=dc.max_line_bytes)
        examples = answer_examples(tok, rows, seq_len=cfg.sft.seq_len)
    return acceptance(model, examples, seq_len=cfg.sft.seq_len)


def eval_tasks(cfg: Config, model, tok, data_dir: Path) -> dict:
    """Exact match on sft_eval; bad rows as in eval_lm (counted in `bad_rows_sft_eval`); the MTP layer's draft
    acceptance where the model has one (`eval_mtp`)."""
    dc, report = cfg.data, CleanReport(max_examples=cfg.data.report_examples)
    rows = read_task_rows(split_path(data_dir, "sft_eval"), limit=cfg.eval.max_rows,
                                   on_bad_row=dc.on_bad_row, report=report, max_line_bytes=dc.max_line_bytes)
    if report.dropped.get("bad_row"):
        log.warning("sft_eval: skipped %d bad rows, e.g. %s", report.dropped["bad_row"],
                    report.examples.get("bad_row", []))
    metrics = task_metrics(model, tok, rows, max_new_tokens=cfg.eval.max_new_tokens)
    examples = answer_examples(tok, rows, seq_len=cfg.sft.seq_len)          # tokenised once for both
    answers = answer_metrics(model, examples, seq_len=cfg.sft.seq_len)
    return {**metrics, **answers, **eval_mtp(cfg, model, tok, data_dir, examples),
            "bad_rows_sft_eval": report.dropped.get("bad_row", 0),
            "data": {"sft_eval": split_provenance(data_dir, "sft_eval", len(rows))}}


def eval_preferences(cfg: Config, model, tok, data_dir: Path) -> dict:
    """Preference metrics on dpo_eval (+ exact match on sft_eval); bad rows as in eval_lm (`bad_rows_dpo_eval`).
    Pairs: implicit-reward and likelihood ranking, rejected-answer rates; unpaired KTO rows: kto_accuracy."""
    dc, report = cfg.data, CleanReport(max_examples=cfg.data.report_examples)
    rows = formats.read_preferences(split_path(data_dir, "dpo_eval"), on_bad_row=dc.on_bad_row, report=report,
                                    max_line_bytes=dc.max_line_bytes)
    rows = list(itertools.islice(rows, cfg.eval.max_rows))
    if report.dropped.get("bad_row"):
        log.warning("dpo_eval: skipped %d bad rows, e.g. %s", report.dropped["bad_row"],
                    report.examples.get("bad_row", []))
    pairs = [r for r in rows if not isinstance(r, formats.KTORow)]
    if len(pairs) < len(rows):          # unpaired rows: KTO's view (pairs among them count as two rows)
        unpaired = [k for r in rows for k in ([r] if isinstance(r, formats.KTORow) else
                                              [formats.KTORow(r[0], r[1], True), formats.KTORow(r[0], r[2], False)])]
        prefs, rejected, sft_rejected = kto_metrics(model, tok, unpaired, seq_len=cfg.dpo.seq_len,
                                                             beta=cfg.dpo.beta), None, None
    else:
        prefs = preference_metrics(model, tok, pairs, seq_len=cfg.dpo.seq_len, beta=cfg.dpo.beta)
        rejected = rejected_match_rate(model, tok, pairs, max_new_tokens=cfg.eval.max_new_tokens)
        with lora_disabled(model):      # the SFT model, for "DPO must lower the rejected-answer rate"
            sft_rejected = rejected_match_rate(model, tok, pairs, max_new_tokens=cfg.eval.max_new_tokens)
    tasks = eval_tasks(cfg, model, tok, data_dir)
    kept = ("exact_match", "min_family", "per_family", "chrf", "answer_loss", "answer_perplexity", "samples",
            "bad_rows_sft_eval", *(k for k in tasks if k.startswith("mtp_")))
    return {**prefs, **{k: tasks[k] for k in kept}, "rejected_match_rate": rejected,
            "sft_rejected_match_rate": sft_rejected, "bad_rows_dpo_eval": report.dropped.get("bad_row", 0),
            "data": {"dpo_eval": split_provenance(data_dir, "dpo_eval", len(rows)), **tasks["data"]}}
