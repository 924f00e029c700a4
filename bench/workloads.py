"""What the end-to-end benchmarks share: model shapes, random SFT/DPO data, the HF twin of our
decoder, and one timing loop that frees memory between providers.

Precision policy on both sides: fp32 master weights, bf16 autocast, fused AdamW (CUDA).
`--smoke` shrinks everything (h64 L2, vocab 1000, seq 128, fp32, CPU) to check the scripts run.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import time

import numpy as np
import torch

from bench.packing_efficiency import skewed_lengths
from glm_lora.data.packing import IGNORE, to_device
from glm_lora.model import DecoderConfig

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIZES = {
    "125m": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12, intermediate_size=2048),
    "1b": dict(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=5632),
    "smoke": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
}
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
_amp = {"dtype": torch.bfloat16}    # set by setup() from --precision


def precision_note() -> str:
    amp = {torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast + dynamic loss scaling",
           None: "no autocast (fp32)"}[_amp["dtype"]]
    return f"fp32 master weights, {amp}, fused AdamW (both sides)"


class RandomSFT:
    """Random tokens of the given lengths; labels on the answer (last 30%) only."""

    def __init__(self, lengths, vocab, seed=0):
        self._lengths, self.vocab, self.rng = lengths, vocab, np.random.default_rng(seed)
        self.tokens = self.rng.integers(3, vocab, int(lengths.sum()), dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])

    def __len__(self):
        return len(self._lengths)

    def lengths(self):
        return self._lengths

    def example(self, i):
        ids = self.tokens[self.offsets[i]:self.offsets[i + 1]]
        labels = ids.copy()
        labels[: int(len(ids) * 0.7)] = IGNORE
        return ids, labels


class RandomDPO:
    """Pairs i → examples 2i (prompt + chosen), 2i+1 (same prompt + rejected); labels on answers only.

    Prompts follow the skewed mix, capped so a pair (both sequences) fits one `seq_len` row;
    answers are 16–256 tokens (scaled down with seq_len for smoke runs).
    """

    def __init__(self, n_pairs: int, vocab: int, seq_len: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        a_hi = min(256, seq_len // 8)
        answers = rng.integers(min(16, a_hi // 2), a_hi + 1, (n_pairs, 2))
        room = (seq_len - answers.sum(1)) // 2
        self.prompt_len = np.minimum(scaled_lengths(n_pairs, seq_len, seed), room)
        self.prompts = [rng.integers(3, vocab, n, dtype=np.int64) for n in self.prompt_len]
        self.answers = [rng.integers(3, vocab, n, dtype=np.int64) for n in answers.flatten()]
        self._lengths = (self.prompt_len[:, None] + answers).flatten()

    def __len__(self):
        return len(self._lengths)

    def lengths(self):
        return self._lengths

    def example(self, i):
        prompt = self.prompts[i // 2]
        ids = np.concatenate([prompt, self.answers[i]])
        labels = ids.copy()
        labels[: len(prompt)] = IGNORE
        return ids, labels


def scaled_lengths(n: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """The skewed 16–2048 mix, scaled to `seq_len` (identity at 2048)."""
    return np.maximum(skewed_lengths(n, seed) * seq_len // 2048, 8)


def decoder_config(size: str, vocab: int, seq_len: int) -> DecoderConfig:
    return DecoderConfig(vocab_size=vocab, max_seq_len=seq_len, rope_theta=10000.0, rms_norm_eps=1e-5,
                         tie_embeddings=False, **SIZES[size])


def hf_model(cfg: DecoderConfig, device: torch.device, checkpointing: bool = False, attn: str = "sdpa",
             use_cache: bool = True):
    """transformers' LlamaForCausalLM with our shapes, random init, fp32 weights; `attn` is its
    attn_implementation (SDPA by default). `use_cache=False` as trainers set it: no KV cache in training."""
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, attn_implementation=attn,
        use_cache=use_cache)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(hf_cfg).float().train()
    if checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def our_model(cfg: DecoderConfig, device: torch.device, checkpointing: bool = False):
    from glm_lora.model import Decoder
    torch.manual_seed(0)
    with torch.device(device):
        model = Decoder(cfg).train()
    if checkpointing:
        if not hasattr(model, "gradient_checkpointing"):
            raise NotImplementedError("Decoder has no `gradient_checkpointing` attribute yet")
        model.gradient_checkpointing = True
    return model


def hf_peft(cfg: DecoderConfig, device: torch.device, checkpointing: bool = False, base=None):
    """PEFT LoRA r64 α128 on the 7 projections of `base` (default: hf_model(cfg, device, checkpointing))."""
    from peft import LoraConfig, get_peft_model
    lora = LoraConfig(r=64, lora_alpha=128, target_modules=TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM")
    return get_peft_model(base if base is not None else hf_model(cfg, device, checkpointing), lora)


@contextlib.contextmanager
def siblings_stacked(on: bool):
    """kernels' "auto" stacking of sibling projections (q/k/v, gate/up) on CUDA, on or off in the block."""
    from glm_lora.kernels import ops as kernels
    before = kernels.STACK_SIBLINGS["cuda"]
    kernels.STACK_SIBLINGS["cuda"] = on
    try:
        yield
    finally:
        kernels.STACK_SIBLINGS["cuda"] = before


@contextlib.contextmanager
def norms_fused(on: bool):
    """The residual adds fused into the RMSNorms that read them, and the norms before matrix products written in
    autocast's dtype (model.Block, kernels.add_rms_norm); off: each add its own op and the norms in fp32, cast by
    autocast at each product (before 2026-12-04, afternoon)."""
    from glm_lora.kernels import ops as kernels
    from glm_lora.model import model as m
    fused, dtype = kernels.add_rms_norm, m._matmul_input_dtype
    if not on:
        def unfused(x, residual, weight, eps, out_dtype=None):
            s = x + residual
            return s, kernels.rms_norm(s, weight, eps, out_dtype)
        kernels.add_rms_norm, m._matmul_input_dtype = unfused, lambda x, read_once: None
    try:
        yield
    finally:
        kernels.add_rms_norm, m._matmul_input_dtype = fused, dtype


def autocast(device: torch.device):
    if device.type != "cuda" or _amp["dtype"] is None:
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=_amp["dtype"])


def pinned(batches: list[dict], device: torch.device) -> list[dict]:
    """Host batches in page-locked memory, as the engine's prefetcher (and a DataLoader with pin_memory)
    hands them over: the step's copy is then truly asynchronous, so the host can queue the step's kernels
    while it runs. Done once before timing, for every provider alike."""
    if device.type != "cuda":
        return batches
    return [{k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def train_step(loss_of, opt, device: torch.device):
    """One optimizer step on a batch: autocast forward, backward (loss-scaled in fp16), step."""
    scaler = torch.amp.GradScaler(device.type, enabled=_amp["dtype"] == torch.float16 and device.type == "cuda")

    def step(b):
        with autocast(device):
            loss = loss_of(b)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return step


def timed(step, batches: list[dict], warmup: int, device: torch.device) -> dict:
    """Run `step(batch)` over pre-built batches: the first `warmup` untimed, the rest timed.

    Host batches are built (and pinned) before timing, so the figures are the step itself (with its H2D copy).
    """
    batches = pinned(batches, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for b in batches[:warmup]:
        step(to_device(b, device))
    sync()
    warmup_s = time.perf_counter() - t0
    measured = batches[warmup:]
    real = sum(int(b["num_tokens"]) for b in measured)
    slots = sum(int(b["capacity"]) for b in measured)
    t0 = time.perf_counter()
    for b in measured:
        step(to_device(b, device))
    sync()
    dt = time.perf_counter() - t0
    return {"real_tokens_per_s": real / dt, "token_efficiency": real / slots, "step_ms": 1000 * dt / len(measured),
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
            "steps": len(measured), "warmup_s": warmup_s}


WARMUP_RULE = ("warm-up: synchronised steps until the last 3 step times lie within 5% of their median "
               "(at least 2 and at most 8 warm-up steps, or 25 s after the first; padded anchors: at most 4 or 10 s); then the measured steps, each timed between "
               "CUDA events at the step boundaries with no host sync in between")


def _stable(times: list[float], window: int, tol: float) -> bool:
    if len(times) < window:
        return False
    last = sorted(times[-window:])
    med = last[window // 2]
    return all(abs(t - med) <= tol * med for t in last)


def timed_steps(step, batches: list[dict], device: torch.device, steps: int, *, min_warmup: int = 2,
                max_warmup: int = 8, max_warmup_s: float = 25.0, window: int = 3, tol: float = 0.05,
                max_measure_s: float | None = None, min_steps: int = 4) -> dict:
    """Warm up by the rule in WARMUP_RULE, then time up to `steps` steps one by one.

    `batches` must hold max_warmup + steps pre-built host batches; warm-up takes them from the front,
    the measured steps from what follows. `max_measure_s` stops measuring early (after `min_steps`)
    for slow providers. Returns p20/p50/p80 step times, real tokens/s (all measured real tokens over
    the measured time) and peak memory (warm-up included).
    """
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    batches = pinned(batches, device)
    warm: list[float] = []
    t_start = time.perf_counter()
    i = 0
    while i < max_warmup and i < len(batches) - min(min_steps, steps):
        t0 = time.perf_counter()
        step(to_device(batches[i], device))
        sync()
        warm.append(time.perf_counter() - t0)
        if i == 0:
            t_start = time.perf_counter()       # the time cap counts after the first (compiling) step
        i += 1
        if i >= min_warmup and (_stable(warm, window, tol) or time.perf_counter() - t_start > max_warmup_s):
            break
    stable = _stable(warm, window, tol)
    measured = batches[i:i + steps]
    ends, real, slots = [], [], []

    def mark() -> None:     # a step boundary: a CUDA event (no host sync) or the host clock
        if cuda:
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record()
        else:
            ends.append(time.perf_counter())

    mark()
    t0 = time.perf_counter()
    for n, b in enumerate(measured):
        step(to_device(b, device))
        real.append(int(b["num_tokens"]))
        slots.append(int(b["capacity"]))
        mark()
        if max_measure_s is not None and n + 1 >= min_steps and time.perf_counter() - t0 > max_measure_s:
            break
    sync()
    if cuda:
        dts = [a.elapsed_time(b) / 1000 for a, b in zip(ends, ends[1:])]
    else:
        dts = [b - a for a, b in zip(ends, ends[1:])]
    ms = np.array(dts) * 1000
    total = float(sum(dts))
    return {"real_tokens_per_s": sum(real) / total, "token_efficiency": sum(real) / sum(slots),
            "step_ms_p20": float(np.percentile(ms, 20)), "step_ms_p50": float(np.percentile(ms, 50)),
            "step_ms_p80": float(np.percentile(ms, 80)), "step_ms_mean": float(ms.mean()),
            "real_tokens_per_step": sum(real) / len(real), "slots_per_step": sum(slots) / len(slots),
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "steps": len(dts), "warmup_steps": len(warm), "warmup_stable": stable,
            "warmup_step_ms": [round(1000 * t, 1) for t in warm], "step_ms": [round(float(t), 1) for t in ms]}


def guarded(fn, device: torch.device, oom: bool = False) -> dict:
    """Run one provider; a failure becomes {"error": ...} (OOM re-raised when `oom`), memory freed either way."""
    free(device)
    try:
        out = fn()
    except torch.OutOfMemoryError:
        if oom:
            raise
        out = {"error": "torch.OutOfMemoryError"}
    except Exception as e:          # a provider failing must not lose the others' figures
        out = {"error": f"{type(e).__name__}: {e}"[:800]}
    free(device)                    # after the except block: the traceback's tensors are gone by now
    return out


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="125m,1b", help="comma list of " + ",".join(s for s in SIZES if s != "smoke"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--providers", default="", help="comma list: run only these providers (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, fp32, 2 steps, no compile")
    ap.add_argument("--precision", choices=list(AMP_DTYPES), default="bf16", help="autocast dtype on the GPU")
    return ap


def setup(args) -> tuple[list[str], torch.device, int, int]:
    """Sizes, device, vocab, seq_len for this run (--smoke overrides all four and the step counts)."""
    _amp["dtype"] = AMP_DTYPES[args.precision]
    if args.smoke:
        args.steps, args.warmup = 2, 1
        torch.set_num_threads(1)    # the CPU smoke machine is shared: 2 threads contend and run ~30x slower
        return ["smoke"], torch.device("cpu"), 1000, 128
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    return args.sizes.split(","), torch.device("cuda"), 32000, 2048


def result_name(base: str, args) -> str:
    """The <name> of bench/results/<name>_<date>_<commit>.json: one per precision (bf16 unsuffixed) and for smoke runs."""
    return base + ("" if args.precision == "bf16" else f"_{args.precision}") + ("_smoke" if args.smoke else "")


def selected(args, providers: tuple[str, ...]) -> list[str]:
    wanted = [p for p in args.providers.split(",") if p]
    unknown = set(wanted) - set(providers)
    if unknown:
        raise SystemExit(f"unknown providers {sorted(unknown)}; choose from {providers}")
    return [p for p in providers if not wanted or p in wanted]


def table(results: dict, cols: list[tuple[str, str]]) -> None:
    """Print `results[size][provider]`, one line per provider, `cols` = (key, format) pairs."""
    for size, rows in results.items():
        print(f"-- {size}")
        for name, r in rows.items():
            if "error" in r or "skipped" in r:
                print(f"  {name:28s} {r.get('error') or r.get('skipped')}")
                continue
            print(f"  {name:28s} " + "  ".join(fmt.format(r[k]) if r.get(k) is not None else f"{k} -"
                                               for k, fmt in cols))


def ratios(rows: dict, base: str) -> None:
    """Add tokens/s and peak-memory ratios vs `base` to each provider's figures, in place."""
    ref = rows.get(base, {})
    for r in rows.values():
        if "real_tokens_per_s" in r and "real_tokens_per_s" in ref:
            r[f"tokens_per_s_vs_{base}"] = r["real_tokens_per_s"] / ref["real_tokens_per_s"]
            if r.get("peak_mem_gb") and ref.get("peak_mem_gb"):
                r[f"peak_mem_vs_{base}"] = r["peak_mem_gb"] / ref["peak_mem_gb"]
