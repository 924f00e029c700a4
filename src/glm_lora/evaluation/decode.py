"""Decoding: a model's answers to token prompts, greedy or sampled, batched with a KV cache.

`greedy_decode` gives Decoder.generate's tokens for many prompts at once; `sample_decode` draws them (the RL stage's
rollouts); `GraphedDecodeStep` replays a batch's decode step from a CUDA graph; `greedy_answers` is the chat-level
call (template, context cut, end of turn) that evaluation, export and serving checks share.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import numpy as np
import torch

from glm_lora.data.encode import cut_messages
from glm_lora.data.tokenizer import end_of_turn_ids
from glm_lora.model.model import KVCache


@contextlib.contextmanager
def evaluating(model):
    """no_grad + eval mode (no LoRA dropout), restoring the caller's mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def prompt_ids(tok, messages: list[dict]) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def _stop_set(eos_id: "int | Iterable[int] | None") -> set[int]:
    if eos_id is None:
        return set()
    return {int(eos_id)} if isinstance(eos_id, (int, np.integer)) else {int(t) for t in eos_id}


def _generate(model, prompt: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    """Decoder.generate (greedy, no KV cache, the context cropped to max_seq_len) stopping at any of `stop`."""
    ids = torch.tensor([prompt], device=model_device(model))
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
    prompt (tests/evaluation/test_metrics.py; up to fp32 rounding of the cached attention, which changes no
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
    device = model_device(model)
    stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=device)
    out: list[list[int]] = [[] for _ in prompts]
    lens = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lens.max())
    buf = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        buf[r, :len(p)] = torch.tensor(p)
    cache = KVCache(width + max_new_tokens, lengths=lens.clone())     # linear attention: where each prompt ends
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
    all-gathers) nor mixture-of-experts or linear-attention models (not measured; the latter's cache replaces its
    states each step, where a graph needs them updated in place)."""
    from torch.distributed.fsdp import FSDPModule
    layout = model.config.layout
    return (model_device(model).type == "cuda" and not layout.moe and not layout.linear_attention
            and not isinstance(model, FSDPModule))


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
    ids = [prompt_ids(tok, cut_messages(tok, p, context, keep="tail")) for p in prompts]
    with evaluating(model):
        tokens = greedy_decode(model, ids, max_new_tokens=max_new_tokens, eos_id=end_of_turn_ids(tok),
                               batch_size=batch_size)
    return [tok.decode(t, skip_special_tokens=True) for t in tokens]
