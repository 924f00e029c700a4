"""LoRA SFT step on Qwen3.5 (gated DeltaNet + gated attention): ours vs transformers + PEFT with flash-linear-attention,
one process, the same packed rows; and (`--kernels`) the gated delta rule alone, fla vs our torch reference.

Shapes (`--shape`, random init, stated in every result): the text model of
  4b   Qwen3.5-4B: hidden 2560, 32 layers (every 4th gated full attention, 16 heads × 256, 4 kv heads; the rest gated
       DeltaNet, 16 key heads / 32 value heads of 128, conv 4), intermediate 9216, vocab 248320, tied embeddings
  2b   Qwen3.5-2B: hidden 2048, 24 layers (attention 8 heads × 256, 2 kv heads; DeltaNet 16 / 16 heads of 128),
       intermediate 6144, vocab 248320, tied embeddings
  tiny hidden 64, 4 layers, DeltaNet 2 / 4 heads, vocab 1000, rows 8 × 128 (CPU; `--smoke` runs it, 2 steps)
Rows 8 × 2048 packed from the skewed length mix (several documents a row), labels on the answers (last 30%).
LoRA r16 α32, dropout 0, on every linear projection both sides: q/k/v/o, gate/up/down and the DeltaNet's
in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / out_proj (ours: "all-linear", which is exactly these 12).
bf16 autocast, adapter fp32, fused AdamW lr 2e-4, gradient checkpointing on both sides (the 4B shape's
16k-token step needs it in transformers).

Providers:
  hf_peft      Qwen3_5ForCausalLM, bf16 weights, sdpa, PEFT LoRA, gradient checkpointing
               (use_reentrant False), with flash-linear-attention installed: transformers then runs fla's
               chunk_gated_delta_rule (which function each hook resolved to is recorded: `hf_kernels`). Packing: the
               padding-free path of DataCollatorWithFlattening(return_flash_attn_kwargs=True): the 8 rows flattened
               to one (1, 16384) row, position_ids restarting at each document (full attention finds the documents
               from them), cu_seq_lens_q/k + max_length_q/k (the DeltaNet hands cu_seq_lens_q to fla as cu_seqlens).
               Not isolated: the causal conv1d. transformers sends it to the `causal_conv1d` package (CUDA source
               only on PyPI, not installed) or its torch fallback, and neither gets the documents' bounds, so each
               document's first 3 tokens see the previous document's last ones (`packing_check` measures it).
  ours         our Decoder, kernels "auto" (fla's kernels with each document as its own sequence, the fused LoRA
               and norm kernels, FlexAttention), frozen GEMM weights bf16, gradient checkpointing, our trainer's loss
               (model.heads.causal_lm_loss); the rows as they are, with doc_ids
  ours_nockpt  ours without gradient checkpointing
On CPU (`--smoke`) hf_peft runs on transformers' torch fallbacks (no fla: recorded as `fallback`), to keep the path tested.
Timing: bench.workloads.WARMUP_RULE, then p20/p50/p80 step times, real tokens/s, peak memory (from after the model is
built), and each provider's ratio to hf_peft.

`--kernels`: the gated delta rule alone, forward + backward (triton.testing.do_bench median), at the shape's per-layer
size over one packed batch (8 × 2048 tokens, value heads × 128, bf16 q/k/v, fp32 g/beta): fla's chunk_gated_delta_rule
with cu_seqlens, our torch reference (kernels "reference": the rows with each document moved to a chunk start, the chunked
rule restarting the state there) and torch.compile of the reference's chunked rule (on the already split documents); the causal conv1d too.

    python -m bench.qwen35_gpu [--shape 4b] [--steps 8] [--providers hf_peft,ours] [--kernels] [--no-sft]
                               [--out DIR] [--smoke]
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from bench import dsa_gpu
from bench.common import write_result
from bench.workloads import (WARMUP_RULE, RandomSFT, free, guarded, parser, ratios, scaled_lengths, timed_steps,
                             train_step)
from glm_lora.data.packing import PackedBatches
from glm_lora.data.sampler import EpochSampler
from glm_lora.engine.optim import build_optimizer
from glm_lora.kernels import delta_rule, flash_linear
from glm_lora.kernels import ops as kernels
from glm_lora.model import DecoderConfig

SHAPES = {
    "4b": dict(hidden_size=2560, num_layers=32, num_heads=16, num_kv_heads=4, head_dim=256, intermediate_size=9216,
               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
               tie_embeddings=True),
    "2b": dict(hidden_size=2048, num_layers=24, num_heads=8, num_kv_heads=2, head_dim=256, intermediate_size=6144,
               linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
               tie_embeddings=True),
    "tiny": dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 tie_embeddings=True),
}
VOCAB, SEQ_LEN, ROWS = 248320, 2048, 8
ROPE_THETA, EPS = 1e7, 1e-6
R, ALPHA = 16, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
PROVIDERS = ("hf_peft", "ours", "ours_nockpt")
DEFAULT_PROVIDERS = "hf_peft,ours"


def our_config(shape: str, vocab: int, seq_len: int) -> DecoderConfig:
    return DecoderConfig(vocab_size=vocab, max_seq_len=seq_len, arch="qwen3_5_text", rope_theta=ROPE_THETA,
                         rms_norm_eps=EPS, **SHAPES[shape])


def hf_config(cfg: DecoderConfig, attn: str):
    from transformers import Qwen3_5TextConfig
    c = Qwen3_5TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads, linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim, linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        layer_types=list(cfg.layer_types), max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, use_cache=False,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor})
    c._attn_implementation = attn
    return c


# ---- transformers + PEFT ----------------------------------------------------------------------------------

def hf_kernels() -> dict:
    """What each of Qwen3.5's kernel hooks in transformers resolved to when its module was imported: fla's function
    (flash-linear-attention installed), the `causal_conv1d` package's, or transformers' torch fallback."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    out = {}
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn", "torch_recurrent_gated_delta_rule"):
        fn = getattr(m, name)
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        impl = cells["implementation"].cell_contents if "implementation" in cells else fn
        out[name] = f"{impl.__module__}.{impl.__qualname__}"
    return out


class _Counting:
    """Counts the calls into the function a transformers kernel hook resolved to, and the cu_seqlens they got."""

    def __init__(self, hook_name: str):
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
        fn = getattr(m, hook_name)
        self.cell = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ())).get("implementation")
        self.calls, self.sequences = 0, []

    def __enter__(self):
        if self.cell is not None:
            self.inner = self.cell.cell_contents

            def counted(*args, **kwargs):
                self.calls += 1
                cu = kwargs.get("cu_seqlens")
                self.sequences.append(None if cu is None else len(cu) - 1)
                return self.inner(*args, **kwargs)
            self.cell.cell_contents = counted
        return self

    def __exit__(self, *exc):
        if self.cell is not None:
            self.cell.cell_contents = self.inner


def hf_batch(b: dict) -> dict:
    """A packed (rows, T) batch as transformers' padding-free collator hands it over: one (1, rows·T) row, position
    ids restarting per document, the documents' bounds as cu_seq_lens_q/k (int32) and max_length_q/k. Each row's
    padding tail is a sequence of its own, so no real token sees it."""
    B, T = b["input_ids"].shape
    cu = delta_rule.PackedRows(b["doc_ids"]).cu_seqlens
    longest = int(cu.diff().max())
    flat = {k: b[k].reshape(1, B * T) for k in ("input_ids", "position_ids", "labels")}
    return {**flat, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest,
            "num_tokens": b["num_tokens"], "capacity": b["capacity"]}


HF_KEYS = ("input_ids", "position_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def hf_peft(cfg: DecoderConfig, device):
    from peft import LoraConfig, get_peft_model
    fla = flash_linear.available()       # fla imported before transformers' Qwen3.5 module: its hooks resolve then
    from transformers import Qwen3_5ForCausalLM
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    with torch.device(device):
        attn = "sdpa"       # transformers 5.17 refuses flex_attention for Qwen3_5ForCausalLM
        base = Qwen3_5ForCausalLM._from_config(hf_config(cfg, attn), attn_implementation=attn,
                                               dtype=torch.bfloat16 if cuda else torch.float32).train()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)

    def loss(b):
        return model(**{k: b[k] for k in HF_KEYS}, use_cache=False).loss

    def logits(ids, pos, doc_ids):
        b = hf_batch({"input_ids": ids, "position_ids": pos, "labels": ids, "doc_ids": doc_ids, "num_tokens": 0,
                      "capacity": 0})
        b = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
        with _Counting("torch_chunk_gated_delta_rule") as calls:
            out = model(**{k: b[k] for k in HF_KEYS if k != "labels"}, use_cache=False).logits
        logits.calls = {"chunk_gated_delta_rule_calls": calls.calls, "cu_seqlens_sequences": calls.sequences[:1]}
        return out
    info = {"hf_kernels": hf_kernels(), "fla_installed": fla}
    if not (fla and cuda):
        info["fallback"] = "no fla/CUDA: transformers' torch fallbacks, which ignore cu_seq_lens (not the baseline)"
    return model, loss, logits, info


# ---- ours -----------------------------------------------------------------------------------------------------

def ours(cfg: DecoderConfig, device, checkpointing: bool):
    """bench.dsa_gpu's: LoRA r16 α32 on "all-linear", frozen GEMM weights bf16 on CUDA, causal_lm_loss."""
    assert (dsa_gpu.R, dsa_gpu.ALPHA) == (R, ALPHA)
    model, loss = dsa_gpu.ours(cfg, device)
    model.gradient_checkpointing = checkpointing

    def logits(ids, pos, doc_ids):
        return model(ids, pos, doc_ids)
    return model, loss, logits, {"delta_rule": "fla" if device.type == "cuda" and flash_linear.available()
                                 else "torch reference"}


def packing_check(logits_fn, b: dict, device, max_docs: int = 3) -> dict:
    """The first documents of the row with the most, packed into one row vs each alone: the largest |logit|
    difference over their tokens, and over the tokens past each document's first conv_kernel − 1 (where a conv
    window that ignores the documents' bounds reads the previous document)."""
    row = int((b["doc_ids"][:, 1:] != b["doc_ids"][:, :-1]).sum(1).argmax())
    doc = b["doc_ids"][row]
    starts = [0] + [i for i in range(1, len(doc)) if doc[i] != doc[i - 1]]
    bounds = [(s, e) for s, e in zip(starts, starts[1:] + [len(doc)]) if doc[s] > 0][:max_docs]
    end = bounds[-1][1]
    ids, pos = (b[k][row:row + 1, :end].to(device) for k in ("input_ids", "position_ids"))
    doc_ids = b["doc_ids"][row:row + 1, :end].to(device)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    with torch.no_grad(), amp:
        packed = logits_fn(ids, pos, doc_ids).float()
        calls = getattr(logits_fn, "calls", None)
        worst, worst_inside, scale = 0.0, 0.0, 0.0
        for s, e in bounds:
            alone = logits_fn(ids[:, s:e], pos[:, s:e], doc_ids[:, s:e]).float()
            diff = (packed[:, s:e] - alone).abs().amax(-1)[0]
            worst, worst_inside = max(worst, float(diff.max())), max(worst_inside, float(diff[3:].max()) if e - s > 3 else 0.0)
            scale = max(scale, float(alone.abs().max()))
    return {"documents": [e - s for s, e in bounds], "max_abs_logit_diff": worst,
            "max_abs_logit_diff_past_first_3_tokens": worst_inside, "max_abs_logit": scale,
            **({"calls": calls} if calls else {})}


def run(name: str, cfg: DecoderConfig, batches: list[dict], args, device) -> dict:
    t0 = time.perf_counter()
    if name == "hf_peft":
        model, loss, logits, info = hf_peft(cfg, device)
        step_batches = [hf_batch(b) for b in batches]
    else:
        model, loss, logits, info = ours(cfg, device, checkpointing=name != "ours_nockpt")
        step_batches = batches
    info["build_s"] = round(time.perf_counter() - t0, 1)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with kernels.using("auto", "auto"):
        info["packing_check"] = packing_check(logits, batches[0], device)
        opt = build_optimizer(model, 2e-4, 0.0, fused=device.type == "cuda")
        step = train_step(loss, opt, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()       # the step's peak, not the model's fp32 build
        res = timed_steps(step, step_batches, device, args.steps, max_warmup=args.max_warmup,
                          max_measure_s=args.max_measure_s)
    return {**res, **info, "trainable_params": trainable}


# ---- the kernels alone ----------------------------------------------------------------------------------------

def kernel_bench(cfg: DecoderConfig, batch: dict, device, compile_reference: bool) -> dict:
    """fwd + bwd of the gated delta rule and the conv1d at one layer's size over the packed batch's documents."""
    cuda = device.type == "cuda"
    doc_ids = batch["doc_ids"].to(device)
    B, T = doc_ids.shape
    H, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv_dim = 2 * cfg.linear_num_key_heads * Dk + H * Dv
    dtype = torch.bfloat16 if cuda else torch.float32
    g_ = torch.Generator(device).manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=g_, device=device).to(dt)
    q, k, v = rnd(B, T, H, Dk), rnd(B, T, H, Dk), rnd(B, T, H, Dv)
    g = -torch.nn.functional.softplus(rnd(B, T, H, dt=torch.float32))
    beta = rnd(B, T, H, dt=torch.float32).sigmoid()
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta)]
    cot = rnd(B, T, H, Dv)
    x, w = rnd(B, T, conv_dim).requires_grad_(), rnd(conv_dim, cfg.linear_conv_kernel_dim, dt=torch.float32).requires_grad_()
    xcot = rnd(B, T, conv_dim)

    def timer(fn) -> float:
        if cuda:
            from triton.testing import do_bench
            return do_bench(fn, warmup=50, rep=300, return_mode="median")
        fn()
        t0 = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - t0)

    rows = delta_rule.PackedRows(doc_ids)     # built once a forward and shared by its layers, as in the model

    def delta(backend):
        def f():
            with kernels.using(backend, "auto"):
                o = kernels.gated_delta_rule(*inputs, rows)
            torch.autograd.grad(o, inputs, cot)
        return f

    def delta_forward(backend):
        def f():
            with torch.no_grad(), kernels.using(backend, "auto"):
                kernels.gated_delta_rule(*inputs, rows)
        return f

    def conv(backend):
        def f():
            with kernels.using(backend, "auto"):
                y = kernels.causal_conv1d(x, w, rows)
            torch.autograd.grad(y, (x, w), xcot)
        return f

    docs = rows.aligned
    split = [docs.split(t.detach()).requires_grad_() for t in inputs]
    split_cot = docs.split(cot)
    compiled_rule = torch.compile(delta_rule.gated_delta_rule, dynamic=False)

    def compiled():
        o = compiled_rule(*split, resets=docs.resets)[0]
        torch.autograd.grad(o, split, split_cot)

    fla = cuda and flash_linear.available()
    fla_backward = fla and flash_linear.backward_ok()       # else "auto" takes the reference's backward (ops.py)
    variants = {"fla_delta_rule_forward": (delta_forward("auto"), fla),
                "reference_delta_rule_forward": (delta_forward("reference"), True),
                "fla_delta_rule": (delta("auto"), fla_backward), "reference_delta_rule": (delta("reference"), True),
                "reference_compiled_delta_rule": (compiled, cuda and compile_reference),
                "fla_conv1d": (conv("auto"), fla), "reference_conv1d": (conv("reference"), True)}
    out = {"size": {"rows": B, "seq_len": T, "documents": int(docs.resets.sum()), "aligned_length": docs.length,
                    "value_heads": H, "head_dim_k": Dk, "head_dim_v": Dv, "conv_dim": conv_dim,
                    "dtype": str(dtype).replace("torch.", "")},
           "timing": "triton.testing.do_bench median of fwd + bwd (ms)" if cuda else "one fwd + bwd on CPU (ms)"}
    for name, (fn, wanted) in variants.items():
        if not wanted:
            out[name] = {"skipped": ("fla refuses its gated backward here (Hopper, Triton < 3.7.1)" if fla else
                                     "needs CUDA and fla") if name.startswith("fla") else
                         "needs CUDA (inductor's CPU build is minutes)"}
        else:
            out[name] = guarded(lambda: {("fwd_ms" if name.endswith("forward") else "fwd_bwd_ms"): timer(fn),
                                         **({"peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30} if cuda else {})},
                                device)
        print("kernels", name, json.dumps(out[name]), flush=True)
    for kind in ("delta_rule", "conv1d"):
        f, r = out[f"fla_{kind}"], out[f"reference_{kind}"]
        if "fwd_bwd_ms" in f and "fwd_bwd_ms" in r:
            out[f"{kind}_reference_vs_fla_time"] = r["fwd_bwd_ms"] / f["fwd_bwd_ms"]
    c = out["reference_compiled_delta_rule"]
    if "fwd_bwd_ms" in c and "fwd_bwd_ms" in out["fla_delta_rule"]:
        out["delta_rule_compiled_vs_fla_time"] = c["fwd_bwd_ms"] / out["fla_delta_rule"]["fwd_bwd_ms"]
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.set_defaults(providers=DEFAULT_PROVIDERS, steps=8)
    ap.add_argument("--shape", default="4b", choices=list(SHAPES))
    ap.add_argument("--rows", type=int, default=ROWS)
    ap.add_argument("--max-warmup", type=int, default=5)
    ap.add_argument("--max-measure-s", type=float, default=40.0)
    ap.add_argument("--kernels", action="store_true", help="the gated delta rule / conv1d alone, fla vs reference")
    ap.add_argument("--no-compile", action="store_true", help="--kernels without torch.compile of the reference")
    ap.add_argument("--no-sft", action="store_true", help="only --kernels")
    ap.add_argument("--out", default="", help="also copy the results here (and a partial file after each provider)")
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.steps, args.max_warmup, args.max_measure_s, args.kernels = "tiny", 2, 2, None, True
        args.rows = 4
        torch.set_num_threads(1)
    tiny = args.shape == "tiny"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not tiny:
        raise SystemExit("needs a CUDA GPU (or --shape tiny / --smoke)")
    vocab, seq_len = (1000, 128) if tiny else (VOCAB, SEQ_LEN)
    cfg = our_config(args.shape, vocab, seq_len)
    src = RandomSFT(scaled_lengths(600 if tiny else 4000, seq_len, seed=0), vocab)
    stream = PackedBatches(src, iter(EpochSampler(len(src), seed=0)), rows=args.rows, seq_len=seq_len)
    batches = [next(stream) for _ in range(args.max_warmup + args.steps)]
    docs = [int((b["doc_ids"][:, 1:] != b["doc_ids"][:, :-1]).sum()) + b["doc_ids"].shape[0] for b in batches]
    figures = {"shape": {"name": args.shape, **SHAPES[args.shape], "vocab": vocab, "rows": args.rows,
                         "seq_len": seq_len, "layer_types": list(cfg.layer_types),
                         "documents_per_batch_mean": sum(docs) / len(docs)},
               "lora": {"r": R, "alpha": ALPHA, "targets": TARGETS}, "precision": "bf16 autocast, adapter fp32"
               if device.type == "cuda" else "fp32 (CPU)", "warmup_rule": WARMUP_RULE, "providers": {}}
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)

    def save_partial():
        if out:
            (out / "qwen35_partial.json").write_text(json.dumps(figures, indent=1, default=str) + "\n")

    if args.kernels:
        free(device)
        figures["kernels"] = kernel_bench(cfg, batches[0], device, compile_reference=not args.no_compile)
        save_partial()
    rows = figures["providers"]
    wanted = [] if args.no_sft else [p for p in args.providers.split(",") if p]
    if set(wanted) - set(PROVIDERS):
        raise SystemExit(f"unknown providers {sorted(set(wanted) - set(PROVIDERS))}; choose from {PROVIDERS}")
    for name in wanted:             # each provider's figures as soon as it ends (a time limit keeps what finished)
        rows[name] = guarded(lambda: run(name, cfg, batches, args, device), device)
        r = rows[name]
        print("done", name, json.dumps({k: v for k, v in r.items() if k not in ("step_ms", "warmup_step_ms")},
                                       default=str), flush=True)
        save_partial()
    ratios(rows, "hf_peft")
    for name, r in rows.items():
        print(name, json.dumps({k: r[k] for k in ("real_tokens_per_s", "step_ms_p50", "peak_mem_gb",
                                                   "tokens_per_s_vs_hf_peft", "peak_mem_vs_hf_peft", "error")
                                if k in r}))
    free(device)
    path = write_result("qwen35_lora_sft" + ("_smoke" if args.smoke else "" if not tiny else "_tiny"), figures)
    print("wrote", path)
    if out:
        shutil.copy(path, out / path.name)


if __name__ == "__main__":
    main()
