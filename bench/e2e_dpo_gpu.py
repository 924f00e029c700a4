"""End-to-end LoRA DPO step (β 0.1): naive transformers + PEFT DPO vs ours, same process (GPU).

Pairs: a prompt from the skewed mix (capped so both sequences of a pair fit one 2048-token row),
chosen and rejected answers of 16–256 tokens, labels on the answers only. LoRA r64 α128 on all 7
projections; fp32 master weights, bf16 autocast, fused AdamW. Providers, same pairs in the same order:
  hf_peft_naive          8 pairs as 16 padded rows (chosen, rejected interleaved), per-sequence log-prob
                         sums from the full logits.float().log_softmax, a separate reference forward under
                         `model.disable_adapter()` + no_grad, sigmoid loss. An OOM at 8 pairs is recorded
                         and the provider rerun with 4 pairs.
  ours_packed_reference  engine.losses.PreferenceLoss(beta=0.1, nll_weight=0) on packed 8 × 2048 rows, pairs
                         kept in one row (group_size 2), kernels "reference"
  ours_packed_fused      the same, kernels "auto" (fused Triton ops)
Real tokens/s counts the non-padding tokens of chosen and rejected sequences (prompts counted twice).

    python -m bench.e2e_dpo_gpu [--sizes 125m,1b] [--steps 10 --warmup 3] [--smoke]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from glm_lora.kernels import ops as kernels
from bench.common import write_result
from bench.workloads import (precision_note, result_name, train_step, SIZES, TARGETS, RandomDPO, autocast, decoder_config, free, guarded, hf_peft,
                             our_model, parser, ratios, selected, setup, table, timed)
from glm_lora.data.packing import IGNORE, PackedBatches, padded_batches
from glm_lora.data.sampler import EpochSampler
from glm_lora.engine.losses import PreferenceLoss
from glm_lora.engine.optim import build_optimizer
from glm_lora.model import inject_lora
from glm_lora.configs.schema import LoRAConfig

PROVIDERS = ("hf_peft_naive", "ours_packed_reference", "ours_packed_fused")
BASE = "hf_peft_naive"
BETA = 0.1


def sequence_logps(model, b: dict) -> torch.Tensor:
    """Sum of label log-probs per sequence from the full logits, as (pairs, [chosen, rejected])."""
    logits = model(input_ids=b["input_ids"], attention_mask=(b["doc_ids"] != 0).long()).logits
    logp = logits[:, :-1].float().log_softmax(-1)                              # (2·pairs, T-1, V)
    labels = b["labels"][:, 1:]
    keep = labels != IGNORE
    tok = torch.gather(logp, -1, labels.clamp(min=0)[..., None]).squeeze(-1) * keep
    return tok.sum(-1).view(-1, 2)


def naive_dpo_loss(model, b: dict) -> torch.Tensor:
    policy = sequence_logps(model, b)
    with torch.no_grad(), model.disable_adapter():
        ref = sequence_logps(model, b)
    margin = BETA * ((policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1]))
    return -F.logsigmoid(margin).mean()


def run(name: str, size: str, src: RandomDPO, args, device: torch.device, vocab: int, seq_len: int,
        pairs: int = 8) -> dict:
    cfg = decoder_config(size, vocab, seq_len)
    order = iter(EpochSampler(len(src) // 2, seed=0))
    if name.startswith("hf"):
        stream = padded_batches(src, order, batch_size=pairs, group_size=2)
        model = hf_peft(cfg, device)

        def loss_of(b):
            return naive_dpo_loss(model, b)
    else:
        stream = PackedBatches(src, order, rows=8, seq_len=seq_len, group_size=2)
        model = our_model(cfg, device)
        inject_lora(model, LoRAConfig(target_modules=TARGETS, r=64, alpha=128))
        dpo = PreferenceLoss(beta=BETA, nll_weight=0.0)

        def loss_of(b):
            return dpo(model, b)[0]
    batches = [next(stream) for _ in range(args.warmup + args.steps)]
    opt = build_optimizer(model, 5e-6, 0.0, fused=device.type == "cuda")

    pairs_per_step = sum(len(b["group_docs"]) for b in batches[args.warmup:]) / args.steps
    with kernels.using("auto" if name.endswith("fused") else "reference"):     # the HF providers never call them
        return {**timed(train_step(loss_of, opt, device), batches, args.warmup, device), "pairs_per_step": pairs_per_step}


def naive_with_retry(size, src, args, device, vocab, seq_len) -> dict:
    """8 pairs; on CUDA OOM, record it and rerun with 4 pairs."""
    try:
        return guarded(lambda: run(BASE, size, src, args, device, vocab, seq_len, pairs=8), device, oom=True)
    except torch.OutOfMemoryError as e:
        oom = str(e).splitlines()[0][:300]
    free(device)
    out = guarded(lambda: run(BASE, size, src, args, device, vocab, seq_len, pairs=4), device)
    return {**out, "note": "torch.OutOfMemoryError at 8 pairs; these figures are with 4 pairs", "oom_at_8_pairs": oom}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--pairs", type=int, default=2000, help="pairs in the random source")
    args = ap.parse_args()
    sizes, device, vocab, seq_len = setup(args)
    src = RandomDPO(args.pairs, vocab, seq_len)
    results = {}
    for size in sizes:
        rows = {}
        for p in selected(args, PROVIDERS):
            rows[p] = (naive_with_retry(size, src, args, device, vocab, seq_len) if p == BASE else
                       guarded(lambda: run(p, size, src, args, device, vocab, seq_len), device))
        ratios(rows, BASE)
        results[size] = rows
    table(results, [("real_tokens_per_s", "{:>9,.0f} tok/s"), ("pairs_per_step", "{:5.1f} pairs/step"),
                    ("token_efficiency", "eff {:.3f}"), ("step_ms", "{:7.1f} ms/step"), ("peak_mem_gb", "peak {:5.1f} GB"),
                    (f"tokens_per_s_vs_{BASE}", "{:5.2f}x tok/s"), (f"peak_mem_vs_{BASE}", "{:4.2f}x mem")])
    figures = {"workload": f"LoRA r64 a128 DPO beta {BETA}, prompt skewed mix capped, answers 16-256, pair <= {seq_len} tokens",
               "precision": precision_note() if device.type == "cuda" else "fp32 (smoke, CPU)",
               "reference_policy": "same weights with the adapter disabled (both sides); LoRA B = 0 at init, so policy = reference",
               "shapes": {s: SIZES[s] for s in sizes}, "vocab": vocab, "seq_len": seq_len,
               "steps": args.steps, "warmup": args.warmup, "results": results}
    print("->", write_result(result_name("e2e_dpo_gpu", args), figures))


if __name__ == "__main__":
    main()
