"""Held-out evaluation: plain functions over a model and a tokenizer (no Prefect here).

- `lm_metrics`: loss, perplexity and bits per byte on plain text (pretraining).
- `task_metrics`: greedy exact match per task family (SFT, and again after DPO).
- `preference_metrics`: DPO implicit-reward accuracy and margin against the reference policy,
  plus the plain log-prob ranking of chosen over rejected.
- `rejected_match_rate`: how often the greedy answer *is* the rejected answer.
- `compare_prompts`: a markdown table of several models' answers to the same prompts.

Decoding (greedy, sampled, graphed) is evaluation.decode.

Every function runs under torch.no_grad() with the model in eval mode (its mode is restored
afterwards) and reuses the training code paths: tokenisation (data.encode), batch layout
(data.packing) and the loss heads (model.heads), so eval numbers mean what training numbers mean.
Held-out files are read by the same readers as training data (data.formats), with the same
bad-row policy and line limit (`read_task_rows`; evaluation.heldout), and a prompt is cut to
what the model's context can use before it is tokenised.
"""
from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import sacrebleu
import torch

from glm_lora.configs.errors import quote
from glm_lora.data.cleaning import CleanReport
from glm_lora.data.encode import dpo_examples, kto_examples, lm_examples, sft_examples
from glm_lora.data.formats import MAX_LINE_BYTES, read_sft_rows
from glm_lora.data.packing import PackedBatches, padded_batches, to_device
from glm_lora.data.synthetic import check_answer
from glm_lora.evaluation.decode import evaluating, greedy_answers, model_device
from glm_lora.model.heads import causal_lm_loss, group_logprobs
from glm_lora.model.lora import lora_disabled, lora_modules

ALL = "all"  # the family of rows without a "task" field
SAMPLE_CHARS = 300  # prompt / reference / answer text kept per sample in the metrics


class _Examples:
    """An in-memory ExampleSource (data.packing) over (ids, labels) lists."""

    def __init__(self, examples: list[tuple[list[int], list[int]]]):
        self.examples = [(np.asarray(i, dtype=np.int64), np.asarray(lab, dtype=np.int64)) for i, lab in examples]

    def __len__(self) -> int:
        return len(self.examples)

    def lengths(self) -> np.ndarray:
        return np.array([len(i) for i, _ in self.examples], dtype=np.int64)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.examples[i]


# ---------------------------------------------------------------- language modelling

def lm_metrics(model, tok, texts: Iterable[str], *, seq_len: int, batch_rows: int = 8) -> dict:
    """Held-out loss (mean NLL per predicted token, nats), perplexity and bits per byte.

    Texts are tokenised exactly as for pretraining (lm_examples: </s> appended, split into
    seq_len chunks) and packed into rows. bits_per_byte = total NLL / ln 2 / UTF-8 bytes of the
    texts, which compares across tokenizers. (The first token of each chunk is context, never a
    target, so its bytes are in the denominator without a loss: a slight underestimate, the same
    for every model evaluated on the same texts with the same tokenizer.)
    """
    n_bytes = 0

    def counted(it: Iterable[str]) -> Iterator[str]:
        nonlocal n_bytes
        for text in it:
            n_bytes += len(text.encode("utf-8"))
            yield text

    examples = list(lm_examples(counted(texts), tok, seq_len=seq_len, min_tokens=1, report=CleanReport()))
    if not examples:
        raise ValueError("lm_metrics: no text to evaluate (every document was empty)")
    batches = PackedBatches(_Examples(examples), iter(range(len(examples))), rows=batch_rows, seq_len=seq_len)
    nll, tokens = 0.0, 0
    device = model_device(model)
    with evaluating(model):
        for batch in batches:
            loss, m = causal_lm_loss(model, to_device(batch, device))
            count = int(m["target_tokens"])
            nll += float(loss) * count
            tokens += count
    loss = nll / tokens
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": nll / math.log(2) / n_bytes,
            "tokens": tokens, "bytes": n_bytes, "documents": len(examples)}


# ---------------------------------------------------------------- task exact match

def _family(task) -> str:
    if task is None or task == "":
        return ALL
    return task if isinstance(task, str) else quote(task, 60)


def read_task_rows(path: str | Path, *, limit: int | None = None, on_bad_row: str = "error",
                   report: CleanReport | None = None, max_line_bytes: int = MAX_LINE_BYTES) -> list[dict]:
    """Rows for task_metrics from any SFT-format file: {"conversations": [...], "task": family}.

    The conversation comes from data.formats (chat, ShareGPT or Alpaca rows, read_sft's checks,
    `on_bad_row` / `report` / `max_line_bytes` as there); the family from the row's "task" field,
    "all" where there is none. `limit` counts good rows.
    """
    rows = []
    if limit is not None and limit <= 0:
        return rows
    for conv, raw in read_sft_rows(path, on_bad_row=on_bad_row, report=report, max_line_bytes=max_line_bytes):
        rows.append({"conversations": conv, "task": _family(raw.get("task"))})
        if limit is not None and len(rows) == limit:
            break
    return rows


def clip_sample(text: str) -> str:
    return text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS - 1] + "…"


def prompt_and_answer(conv: list[dict], where: str) -> tuple[list[dict], str]:
    if not conv or conv[-1]["role"] != "assistant":
        raise ValueError(f"{where}: the conversation must end with the assistant's reference answer")
    return conv[:-1], conv[-1]["content"]


def task_metrics(model, tok, rows: list[dict], *, max_new_tokens: int = 24, examples: int = 3,
                 batch_size: int = 32) -> dict:
    """Greedy exact match (data.synthetic.check_answer) against each row's last assistant message.

    exact_match is the mean over families (each family counts the same however many rows it
    has); min_family is the worst family's; samples holds the first `examples` rows per family.
    """
    if not rows:
        raise ValueError("task_metrics: no rows to evaluate")
    prompts, refs, families = [], [], []
    for k, row in enumerate(rows):
        prompt, ref = prompt_and_answer(row["conversations"], f"row {k}")
        prompts.append(prompt)
        refs.append(ref)
        families.append(_family(row.get("task")))
    answers = greedy_answers(model, tok, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    hits: dict[str, list[bool]] = {}
    chrf: dict[str, list[float]] = {}
    samples = []
    for prompt, ref, fam, ans in zip(prompts, refs, families, answers):
        ok = check_answer(fam, ans, ref)
        hits.setdefault(fam, []).append(ok)
        chrf.setdefault(fam, []).append(sacrebleu.sentence_chrf(ans.strip(), [ref.strip()]).score / 100)
        if len(hits[fam]) <= examples:
            samples.append({"task": fam, "prompt": clip_sample(prompt[-1]["content"]), "reference": clip_sample(ref),
                            "answer": clip_sample(ans), "correct": ok, "chrf": round(chrf[fam][-1], 4)})
    per_family = {fam: sum(h) / len(h) for fam, h in sorted(hits.items())}
    chrf_family = {fam: sum(c) / len(c) for fam, c in sorted(chrf.items())}
    return {"exact_match": sum(per_family.values()) / len(per_family), "per_family": per_family,
            "min_family": min(per_family.values()), "chrf": sum(chrf_family.values()) / len(chrf_family),
            "chrf_per_family": chrf_family, "n": len(rows),
            "n_per_family": {fam: len(h) for fam, h in sorted(hits.items())}, "samples": samples}


def answer_examples(tok, rows: list[dict], *, seq_len: int) -> list[tuple[list[int], list[int]]]:
    """The rows' whole conversations tokenised as SFT trains on them (labels on the assistant tokens), each within
    seq_len (the prompt truncated)."""
    report = CleanReport()
    examples = list(sft_examples((r["conversations"] for r in rows), tok, seq_len=seq_len, overlong="truncate_prompt",
                                 min_tokens=1, report=report))
    if not examples:
        raise ValueError(f"answer_metrics: no row left to evaluate ({report.dropped})")
    return examples


def answer_metrics(model, examples: list[tuple[list[int], list[int]]], *, seq_len: int, batch_rows: int = 8) -> dict:
    """Answer-token loss and perplexity: the SFT loss (assistant tokens only) over the rows' whole
    conversations (`answer_examples`), packed as in training. Meaningful on any chat data, task families or not."""
    source, device = _Examples(examples), model_device(model)
    total, count = 0.0, 0
    with evaluating(model):
        for batch in PackedBatches(source, iter(range(len(source))), rows=batch_rows, seq_len=seq_len):
            loss, m = causal_lm_loss(model, to_device(batch, device))
            total += float(loss) * int(m["target_tokens"])
            count += int(m["target_tokens"])
    loss = total / max(count, 1)
    return {"answer_loss": loss, "answer_perplexity": math.exp(min(loss, 50.0)), "answer_tokens": count}


# ---------------------------------------------------------------- preferences

def _pair_logprobs(model, source: _Examples, batch_pairs: int, counts: bool = False):
    """Summed answer log-probs, (pairs, 2) = (chosen, rejected), over padded batches in order (with `counts`:
    and the answer token counts, same shape)."""
    n, out, lengths, device = len(source) // 2, [], [], model_device(model)
    for start in range(0, n, batch_pairs):
        stop = min(start + batch_pairs, n)
        batch = next(padded_batches(source, iter(range(start, stop)), batch_size=stop - start, group_size=2))
        sums, count = group_logprobs(model, to_device(batch, device))
        out.append(sums.float().cpu())
        lengths.append(count.cpu())
    return (torch.cat(out), torch.cat(lengths)) if counts else torch.cat(out)


def _with_reference(model, ref_model, score):
    """score(m) for the policy and for its reference (`ref_model`, else the policy with its LoRA off; None
    without either)."""
    with evaluating(model):
        policy = score(model)
        if ref_model is not None:
            with evaluating(ref_model):
                return policy, score(ref_model)
        if lora_modules(model):
            with lora_disabled(model):
                return policy, score(model)
    return policy, None


def kto_metrics(model, tok, rows: list, *, seq_len: int, beta: float, ref_model=None, batch_pairs: int = 16) -> dict:
    """KTO's held-out view on unpaired rows (data.formats.KTORow): r = β·(log π − log π_ref) of each answer, z₀ the
    same log-ratio on the mismatched (x, y') twins clamped at 0 (as in training); kto_accuracy = share of rows where
    r > β·z₀ exactly when the answer is desirable. None entries without a reference."""
    report, desirable = CleanReport(), []
    examples = list(kto_examples(rows, tok, seq_len=seq_len, overlong="truncate_prompt", report=report,
                                 desirable=desirable))
    if not examples:
        raise ValueError(f"kto_metrics: no row left to evaluate ({report.dropped})")
    source = _Examples(examples)
    policy, ref = _with_reference(model, ref_model, lambda m: _pair_logprobs(m, source, batch_pairs))
    out = {"n": len(policy), "dropped": len(rows) - len(policy), "kto_accuracy": None, "kl": None}
    if ref is not None:
        r = policy[:, 0] - ref[:, 0]
        z0 = float((policy[:, 1] - ref[:, 1]).mean().clamp(min=0))
        label = torch.tensor(desirable)
        out.update(kto_accuracy=float(((r > z0) == label).float().mean()), kl=z0,
                   desirable_reward=float(beta * r[label].mean()) if label.any() else None,
                   undesirable_reward=float(beta * r[~label].mean()) if (~label).any() else None)
    return out


def preference_metrics(model, tok, pairs: list[tuple[list[dict], dict, dict]], *, seq_len: int, beta: float,
                       ref_model=None, batch_pairs: int = 16) -> dict:
    """DPO's held-out view: does the policy rank chosen above rejected, relative to the reference?

    Implicit reward r = beta * (log pi(answer) - log pi_ref(answer)), log-probs summed over the
    answer tokens as in PreferenceLoss; pi_ref is `ref_model` if given, else this model with its LoRA
    adapter disabled. implicit_reward_accuracy = share of pairs with r_chosen > r_rejected
    (strictly: an untrained adapter scores 0), mean_margin = mean(r_chosen - r_rejected).
    logprob_accuracy = share with log pi(chosen) > log pi(rejected), meaningful for any model;
    log_odds_ratio = ORPO's reference-free measure, the mean of log odds(chosen) − log odds(rejected) with the
    odds p / (1 − p) of p = an answer's per-token mean probability (as ORPO's loss and TRL define it).
    Without a reference (no LoRA layers, no ref_model) the implicit-reward entries are None.
    Pairs are tokenised like DPO training data (each answer within seq_len // 2, truncated).
    """
    report = CleanReport()
    examples = list(dpo_examples(pairs, tok, seq_len=seq_len, overlong="truncate_prompt", report=report))
    if not examples:
        raise ValueError(f"preference_metrics: no pair left to evaluate ({report.dropped})")
    source = _Examples(examples)
    (policy, counts), ref = _with_reference(model, ref_model, lambda m: _pair_logprobs(m, source, batch_pairs, True))
    out = {"logprob_accuracy": float((policy[:, 0] > policy[:, 1]).float().mean()), "n": len(policy),
           "dropped": len(pairs) - len(policy), "implicit_reward_accuracy": None, "mean_margin": None,
           "log_odds_ratio": _mean_log_odds_ratio(policy, counts)}
    if ref is not None:
        rewards = beta * (policy - ref[0])
        margin = rewards[:, 0] - rewards[:, 1]
        out.update(implicit_reward_accuracy=float((margin > 0).float().mean()), mean_margin=float(margin.mean()),
                   chosen_reward=float(rewards[:, 0].mean()), rejected_reward=float(rewards[:, 1].mean()))
    return out


def _mean_log_odds_ratio(sums: torch.Tensor, counts: torch.Tensor) -> float:
    """Mean over pairs of log odds(chosen) − log odds(rejected) from summed log-probs and token counts (pairs, 2)."""
    avg = (sums / counts.clamp(min=1)).clamp(max=-1e-6)
    log_odds = avg - torch.log(-torch.expm1(avg))
    return float((log_odds[:, 0] - log_odds[:, 1]).mean())


def rejected_match_rate(model, tok, pairs: list[tuple[list[dict], dict, dict]], *, max_new_tokens: int = 24,
                        batch_size: int = 32) -> float:
    """Share of prompts whose greedy answer equals the rejected answer (check_answer)."""
    if not pairs:
        raise ValueError("rejected_match_rate: no pairs to evaluate")
    answers = greedy_answers(model, tok, [p for p, _, _ in pairs], max_new_tokens=max_new_tokens,
                             batch_size=batch_size)
    return sum(check_answer(ALL, a, r["content"]) for a, (_, _, r) in zip(answers, pairs)) / len(pairs)


# ---------------------------------------------------------------- reports

def _cell(text: str) -> str:
    """Text safe inside a markdown table cell: no raw HTML, no column breaks, one line."""
    text = html.escape(text, quote=False).replace("|", "\\|")
    return text.replace("\r\n", "\n").replace("\n", "<br>")


def compare_prompts(answers: dict[str, list[str]], prompts: list[str]) -> str:
    """A markdown table: one row per prompt, one column per model (in `answers`' order)."""
    for name, column in answers.items():
        if len(column) != len(prompts):
            raise ValueError(f"compare_prompts: {name!r} has {len(column)} answers for {len(prompts)} prompts")
    names = list(answers)
    lines = ["| prompt | " + " | ".join(map(_cell, names)) + " |", "|---" * (len(names) + 1) + "|"]
    for k, prompt in enumerate(prompts):
        lines.append("| " + " | ".join(_cell(c) for c in [prompt] + [answers[n][k] for n in names]) + " |")
    return "\n".join(lines) + "\n"
