"""Held-out evaluation: plain functions over a model and a tokenizer (no Prefect here).

- `lm_metrics`: loss, perplexity and bits per byte on plain text (pretraining).
- `task_metrics`: greedy exact match per task family (SFT, and again after DPO).
- `preference_metrics`: DPO implicit-reward accuracy and margin against the reference policy,
  plus the plain log-prob ranking of chosen over rejected.
- `rejected_match_rate`: how often the greedy answer *is* the rejected answer.
- `compare_prompts`: a markdown table of several models' answers to the same prompts.

Every function runs under torch.no_grad() with the model in eval mode (its mode is restored
afterwards) and reuses the training code paths: tokenisation (data.tokenize), batch layout
(data.packing) and the loss heads (engine.losses), so eval numbers mean what training numbers mean.
Held-out files are read by the same readers as training data (data.formats), with the same
bad-row policy and line limit (`read_task_rows`; engine.heldout), and a prompt is cut to
what the model's context can use before it is tokenised.
"""
from __future__ import annotations

import contextlib
import html
import math
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import sacrebleu
import torch

from glm_lora.configs.errors import quote
from glm_lora.data.cleaning import CleanReport
from glm_lora.data.formats import MAX_LINE_BYTES, read_sft_rows
from glm_lora.data.packing import PackedBatches, padded_batches
from glm_lora.data.synthetic import check_answer
from glm_lora.data.tokenize import cut_messages, dpo_examples, kto_examples, lm_examples, sft_examples
from glm_lora.data.tokenizer import end_of_turn_ids
from glm_lora.engine.losses import causal_lm_loss, group_logprobs
from glm_lora.engine.trainer import to_device
from glm_lora.model.lora import lora_disabled, lora_modules
from glm_lora.model.model import KVCache

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


@contextlib.contextmanager
def _evaluating(model):
    """no_grad + eval mode (no LoRA dropout), restoring the caller's mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _device(model) -> torch.device:
    return next(model.parameters()).device


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
    device = _device(model)
    with _evaluating(model):
        for batch in batches:
            loss, m = causal_lm_loss(model, to_device(batch, device))
            count = int(m["target_tokens"])
            nll += float(loss) * count
            tokens += count
    loss = nll / tokens
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": nll / math.log(2) / n_bytes,
            "tokens": tokens, "bytes": n_bytes, "documents": len(examples)}


# ---------------------------------------------------------------- greedy decoding

def _prompt_ids(tok, messages: list[dict]) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def _stop_set(eos_id: "int | Iterable[int] | None") -> set[int]:
    if eos_id is None:
        return set()
    return {int(eos_id)} if isinstance(eos_id, (int, np.integer)) else {int(t) for t in eos_id}


def _generate(model, prompt: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    """Decoder.generate (greedy, no KV cache, the context cropped to max_seq_len) stopping at any of `stop`."""
    ids = torch.tensor([prompt], device=_device(model))
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(model(ids[:, -model.config.max_seq_len:])[0, -1].argmax())
        out.append(nxt)
        if nxt in stop:
            break
        ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
    return out


def _cropped_then_batches(model, prompts: list[list[int]], max_new_tokens: int, stop: set[int],
                          batch_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The answers so far (prompts that would outgrow max_seq_len decoded one token at a time, cropped as
    Decoder.generate crops) and the other prompts' indices in batches, sorted by length."""
    out: list[list[int]] = [[] for _ in prompts]
    short = []
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens - 1 > model.config.max_seq_len:     # the last step's input would be cropped
            out[i] = _generate(model, p, max_new_tokens, stop)
        else:
            short.append(i)
    short.sort(key=lambda i: len(prompts[i]))
    return out, [short[s:s + batch_size] for s in range(0, len(short), batch_size)]


def greedy_decode(model, prompts: list[list[int]], *, max_new_tokens: int, eos_id: "int | Iterable[int] | None",
                  batch_size: int = 32) -> list[list[int]]:
    """Decoder.generate's greedy tokens for many prompts at once, batched, with a KV cache.

    `eos_id`: the token id(s) that end an answer (data.tokenizer.end_of_turn_ids: a chat template may
    end a turn with several, e.g. GLM-4's <|user|> and <|endoftext|>); the stop token is kept as the
    answer's last token. Batches are decoded with a KV cache (_decode_batch); prompts are sorted by
    length so a batch wastes little width. A prompt that would outgrow model.config.max_seq_len is decoded one token at a time
    with the context cropped as Decoder.generate crops it; so the output equals model.generate's, prompt by
    prompt (tests/engine/test_evaluate.py; up to fp32 rounding of the cached attention, which changes no
    argmax there).
    """
    stop = _stop_set(eos_id)
    out, batches = _cropped_then_batches(model, prompts, max_new_tokens, stop, batch_size)
    for idx in batches:
        for i, answer in zip(idx, _decode_batch(model, [prompts[i] for i in idx], max_new_tokens, stop,
                                                lambda logits: logits.argmax(-1))):
            out[i] = answer
    return out


def sample_decode(model, prompts: list[list[int]], *, max_new_tokens: int, eos_id: "int | Iterable[int] | None",
                  temperature: float, generator: torch.Generator, batch_size: int = 64,
                  any_running: Callable[[bool], bool] = bool, cuda_graph: bool = False) -> list[list[int]]:
    """Like greedy_decode, but each token drawn from softmax(logits / temperature) with `generator` (the RL stage's
    rollouts: the same generator state draws the same answers). Every prompt must leave room for max_new_tokens
    within model.config.max_seq_len (no cropping: a sampled answer is scored against its whole prompt).
    `any_running(this process still decoding) -> whether any is`: an FSDP2-sharded model all-gathers its weights in
    every forward, so all ranks must take the same number of decode steps (they stop when every rank is done).
    `cuda_graph`: replay each batch's decode step from a CUDA graph (GraphedDecodeStep; decode_graph_pays says where)."""
    limit = model.config.max_seq_len - max_new_tokens + 1
    if any(len(p) > limit for p in prompts):
        raise ValueError(f"sample_decode: a prompt is longer than {limit} tokens (max_seq_len - max_new_tokens + 1)")

    def draw(logits):
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    stop, out = _stop_set(eos_id), []
    for s in range(0, len(prompts), batch_size):
        out += _decode_batch(model, prompts[s:s + batch_size], max_new_tokens, stop, draw, any_running, cuda_graph)
    return out


def _decode_batch(model, prompts: list[list[int]], max_new_tokens: int, stop: set[int], pick,
                  any_running: Callable[[bool], bool] = bool, cuda_graph: bool = False) -> list[list[int]]:
    """One batch of prompts decoded together with a KV cache; `pick(logits (A, V)) -> (A,)` chooses each token.
    Rows are right-padded: one causal forward over the prompts fills the cache (a real token never sees the
    padding after it) and gives each row's first token at its own last position; then each step feeds every row's
    newest token at its own position (model.KVCache). A finished row stays in the batch (one token a step, cheap)
    until the batch is done."""
    device = _device(model)
    stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=device)
    out: list[list[int]] = [[] for _ in prompts]
    lens = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lens.max())
    buf = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        buf[r, :len(p)] = torch.tensor(p)
    cache = KVCache(width + max_new_tokens)
    positions = torch.arange(width, device=device).expand(len(prompts), width)
    hidden = model.hidden_states(buf, positions, cache=cache)                       # (A, W, C)
    last = hidden[torch.arange(len(prompts), device=device), lens - 1]              # (A, C)
    running = torch.ones(len(prompts), dtype=torch.bool, device=device)
    decode = GraphedDecodeStep(model, cache) if cuda_graph else (
        lambda tokens, positions: model.hidden_states(tokens, positions, cache=cache)[:, 0])
    for step in range(max_new_tokens):
        nxt = pick(model.lm_head(last))                                             # (A,)
        for r, (t, live) in enumerate(zip(nxt.tolist(), running.tolist())):
            if live:
                out[r].append(t)
        running &= ~torch.isin(nxt, stop_ids)
        if step == max_new_tokens - 1 or not any_running(bool(running.any())):
            break
        last = decode(nxt[:, None], lens[:, None])                                      # (A, C)
        lens += 1
    return out


def decode_graph_pays(model) -> bool:
    """Whether sample_decode replays its decode step from a CUDA graph: on CUDA, for a dense model that is not
    sharded. A decode step is ~30 small kernels a layer, so launching them from Python bounds a small model's
    decoding (bench/RESULTS.md, "GRPO step vs TRL"); a graph launches them all at once. Not for FSDP2 (its forward
    all-gathers) nor mixture-of-experts models (not measured)."""
    from glm_lora.engine.dist import is_sharded
    return _device(model).type == "cuda" and not model.config.layout.moe and not is_sharded(model)


class GraphedDecodeStep:
    """`model.hidden_states(tokens (A, 1), positions (A, 1), cache)[:, 0]` for one batch's decode steps: the first
    call runs eagerly (which also compiles and tunes every kernel) and captures the step into a CUDA graph; later
    calls copy their inputs into the graph's and replay it. Same kernels, same inputs, so the same numbers as the
    eager step (tests/gpu/test_decode_graph_gpu.py). The cache's buffers exist from the prefill on, so the graph
    writes each step's keys and values where the eager step would. The returned tensor is overwritten by the next
    call. Autocast's weight-cast cache is off inside: the graph casts the (trainable, fp32) adapter weights itself
    at each replay, so it never reads a cast made for other weights."""

    def __init__(self, model, cache: KVCache):
        self.model, self.cache, self.graph = model, cache, None

    def _step(self) -> torch.Tensor:
        device = self.tokens.device.type
        uncached = (torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False)
                    if torch.is_autocast_enabled(device) else contextlib.nullcontext())
        with uncached:
            return self.model.hidden_states(self.tokens, self.positions, cache=self.cache)[:, 0]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.graph is not None:
            self.tokens.copy_(tokens)
            self.positions.copy_(positions)
            self.graph.replay()
            return self.out
        self.tokens, self.positions = tokens.clone(), positions.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            first = self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._step()
        return first


def greedy_answers(model, tok, prompts: list[list[dict]], *, max_new_tokens: int = 24,
                   batch_size: int = 32) -> list[str]:
    """The model's greedy answer to each chat prompt (messages ending with the user's), as text.

    Same tokens as Decoder.generate on the chat template with the generation prompt, stopping at the
    template's end of turn (data.tokenizer.end_of_turn_ids: <|im_end|> for ours, <|eot_id|> for Llama-3,
    <|user|> or eos for GLM-4); special tokens are dropped from the text.
    """
    context = model.config.max_seq_len   # generate() sees at most the prompt's last `context` tokens
    ids = [_prompt_ids(tok, cut_messages(tok, p, context, keep="tail")) for p in prompts]
    with _evaluating(model):
        tokens = greedy_decode(model, ids, max_new_tokens=max_new_tokens, eos_id=end_of_turn_ids(tok),
                               batch_size=batch_size)
    return [tok.decode(t, skip_special_tokens=True) for t in tokens]


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


def _sample(text: str) -> str:
    return text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS - 1] + "…"


def _split(conv: list[dict], where: str) -> tuple[list[dict], str]:
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
        prompt, ref = _split(row["conversations"], f"row {k}")
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
            samples.append({"task": fam, "prompt": _sample(prompt[-1]["content"]), "reference": _sample(ref),
                            "answer": _sample(ans), "correct": ok, "chrf": round(chrf[fam][-1], 4)})
    per_family = {fam: sum(h) / len(h) for fam, h in sorted(hits.items())}
    chrf_family = {fam: sum(c) / len(c) for fam, c in sorted(chrf.items())}
    return {"exact_match": sum(per_family.values()) / len(per_family), "per_family": per_family,
            "min_family": min(per_family.values()), "chrf": sum(chrf_family.values()) / len(chrf_family),
            "chrf_per_family": chrf_family, "n": len(rows),
            "n_per_family": {fam: len(h) for fam, h in sorted(hits.items())}, "samples": samples}


def answer_metrics(model, tok, rows: list[dict], *, seq_len: int, batch_rows: int = 8) -> dict:
    """Answer-token loss and perplexity: the SFT loss (assistant tokens only) over the rows' whole
    conversations, tokenised and packed as in training (each row within seq_len, truncated).
    Meaningful on any chat data, task families or not."""
    report = CleanReport()
    examples = list(sft_examples((r["conversations"] for r in rows), tok, seq_len=seq_len, overlong="truncate_prompt",
                                 min_tokens=1, report=report))
    if not examples:
        raise ValueError(f"answer_metrics: no row left to evaluate ({report.dropped})")
    source, device = _Examples(examples), _device(model)
    total, count = 0.0, 0
    with _evaluating(model):
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
    n, out, lengths, device = len(source) // 2, [], [], _device(model)
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
    with _evaluating(model):
        policy = score(model)
        if ref_model is not None:
            with _evaluating(ref_model):
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
