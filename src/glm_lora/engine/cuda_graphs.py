"""`<stage>.cuda_graphs`: the decoder blocks' training forward and backward replayed as CUDA graphs.

Why: a small model's step on a fast GPU is bound by the host's kernel launches, not the GPU. The 125M LoRA SFT
step (8 x 2048 packed rows) keeps an H100 busy ~44 ms of a 64-95 ms step, and the gap follows the host's CPU
(bench/RESULTS.md "The 125M LoRA step is launch-bound"). Captured once, the blocks' ~1,400 launches become two
graph launches a step, our Triton kernels and cuDNN's attention as they are (no compile): the step then takes its
GPU time, 43.8-44.1 ms on the same H100s (bench/RESULTS.md "CUDA graphs for a launch-bound LoRA step").

How: `torch.cuda.make_graphed_callables` over `model.hidden_states` on the first training batch's shapes (a
packed stage's rows are always batch_size x seq_len). Parameters stay where they are, so the optimizer's in-place
updates are what the next replay reads; each call copies its batch into the graph's input buffers. A second,
forward-only graph (`torch.cuda.CUDAGraph`) takes the first no_grad forward in training mode: DPO's and GRPO's
reference pass with the adapter off (another ~14 ms of launches in a 125M DPO step). Each graph replays only for
the inputs it was captured with (shapes, which of position_ids / doc_ids / prefix_docs are given, which adapters
are on); validation and decoding (eval mode, a KV cache) and any other shape run eager. The document mask is built
inside the graph from each batch's doc_ids (kernels.document_causal_mask keeps no cached mask while a stream
captures).

Where it can't work it runs eager with a warning: not CUDA, several processes (DDP/FSDP2 hook the gradients),
a mixture-of-experts model (expert batches change size every step), activation checkpointing, gradient
accumulation; and a graph whose capture fails leaves its own pass eager (the training forward or the reference).
Exclusive with `compile: true` (torch.compile's own CUDA graphs are `reduce-overhead`; checked by the config).
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator

import torch

from glm_lora.engine.compile import failure, run_eager, unavailable as compile_unavailable
from glm_lora.model.lora import lora_modules

log = logging.getLogger("glm_lora.engine")


def unavailable(device: torch.device, dist, model: torch.nn.Module, grad_accum: int = 1) -> str | None:
    """Why the blocks can't be graphed here, or None if they can."""
    if device.type != "cuda":
        return f"device {device.type} (CUDA graphs need a CUDA device)"
    why = compile_unavailable(device, dist, model)       # torchrun, mixture of experts: what a compile can't take
    if why:
        return why
    if getattr(model, "gradient_checkpointing", False):
        return "activation_checkpointing (blocks recomputed in backward: not measured under capture)"
    if grad_accum > 1:
        return ("gradient accumulation: the backward graph hands out its own gradient buffers, which autograd may "
                "keep as .grad, and the next micro-batch's replay would overwrite them")
    return None


class _Blocks(torch.nn.Module):
    """The model's eager hidden_states as a module: make_graphed_callables takes a module's parameters as the
    graph's inputs, so the adapter's gradients come out of the backward graph. `given`: the names of the optional
    inputs the captured call had (position_ids, doc_ids, prefix_docs), passed positionally after input_ids."""

    def __init__(self, model: torch.nn.Module, eager, given: tuple[str, ...]):
        super().__init__()
        self.model, self.eager, self.given = model, eager, given

    def forward(self, input_ids, *optional):
        return self.eager(input_ids, **dict(zip(self.given, optional)))


@contextlib.contextmanager
def graphed_training(model: torch.nn.Module, enabled: bool, *, device: torch.device, dist=None,
                     grad_accum: int = 1, name: str = "train") -> Iterator[dict]:
    """Inside the block, `model.hidden_states` replays CUDA graphs for training forwards (see the module doc).
    Yields a dict the stage reports: cuda_graphs (bool: used), cuda_graphs_capture_s, cuda_graphs_fallback (why
    eager, if asked for and not used); where a reference pass ran, the same as cuda_graphs_reference*."""
    info: dict = {"cuda_graphs": False}
    why = unavailable(device, dist, model, grad_accum) if enabled else None
    if not enabled or why:
        if why:
            run_eager(info, "cuda_graphs", name, why)
        yield info
        return
    eager = model.hidden_states
    adapters = list(lora_modules(model).values())
    graphs: dict = {}       # kind -> (key, replay): the inputs its graph was captured for, and the replay

    def hidden_states(input_ids, position_ids=None, doc_ids=None, cache=None, prefix_docs=None):
        if not model.training or cache is not None:
            return eager(input_ids, position_ids, doc_ids, cache=cache, prefix_docs=prefix_docs)
        kind = "train" if torch.is_grad_enabled() else "reference"
        setting = REPORTED_AS[kind]
        optional = {"position_ids": position_ids, "doc_ids": doc_ids, "prefix_docs": prefix_docs}
        given = tuple(k for k, v in optional.items() if v is not None)
        args = (input_ids, *(optional[k] for k in given))
        key = (given, tuple(a.shape for a in args), tuple(m.enabled for m in adapters))
        captured = graphs.get(kind)
        if f"{setting}_fallback" in info or (captured and captured[0] != key):
            return eager(input_ids, position_ids, doc_ids, prefix_docs=prefix_docs)
        if captured is None:
            t = time.perf_counter()
            try:
                graphs[kind] = key, CAPTURE[kind](_Blocks(model, eager, given), args)
            except Exception as e:
                run_eager(info, setting, name, failure(e, "capture"))
                return eager(input_ids, position_ids, doc_ids, prefix_docs=prefix_docs)
            info.update({setting: True, f"{setting}_capture_s": round(time.perf_counter() - t, 3)})
            log.info("%s.%s: blocks captured in %.1f s for rows %s", name, setting, info[f"{setting}_capture_s"],
                     tuple(input_ids.shape))
        return graphs[kind][1](*args)

    model.hidden_states = hidden_states             # an instance attribute shadows the method
    try:
        yield info
    finally:
        del model.hidden_states


def _capture(blocks: _Blocks, args: tuple):
    """Warm up and capture on copies of the first batch (make_graphed_callables runs three warm-up passes: Triton
    autotuning happens there, outside the capture)."""
    sample = tuple(t.clone() for t in args)
    with _uncached_autocast():
        return torch.cuda.make_graphed_callables(blocks, sample, allow_unused_input=True)


def _capture_forward(blocks: _Blocks, args: tuple):
    """A no_grad forward: three warm-up passes on a side stream (as make_graphed_callables does), then one capture
    on static copies of the inputs. Each call copies its inputs in, replays, and returns a copy of the output (the
    graph writes every replay into the same buffer). Its memory pool is its own: the training graph's saved
    activations stay live across this replay (policy forward, reference forward, then the policy's backward)."""
    static = tuple(t.clone() for t in args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with _uncached_autocast(), torch.cuda.stream(side):
        for _ in range(3):
            blocks(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with _uncached_autocast(), torch.cuda.graph(graph):
        out = blocks(*static)

    def replay(*inputs):
        for buf, x in zip(static, inputs):
            buf.copy_(x)
        graph.replay()
        return out.clone()
    return replay


# A training forward (gradients on) replays forward and backward; a no_grad one in training mode (the reference
# pass) a forward graph of its own. Each reports as its own setting: used, capture seconds, or why it runs eager.
CAPTURE = {"train": _capture, "reference": _capture_forward}
REPORTED_AS = {"train": "cuda_graphs", "reference": "cuda_graphs_reference"}


def _uncached_autocast():
    """The caller's autocast with its cast cache off: a cast cached outside a capture would be baked into it."""
    amp = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    return torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None, cache_enabled=False)
