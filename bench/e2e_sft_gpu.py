"""End-to-end LoRA SFT step: our decoder vs transformers + PEFT, same process, same samples (GPU).

LoRA r64 α128 on all 7 projections, skewed lengths (80% 16–511, 15% 512–1536, 5% 1537–2048),
labels on the answer (last 30% of each sample) only; fp32 master weights, bf16 autocast, fused
AdamW on both sides. Providers, each over the same samples in the same order:
  hf_peft_padded          LlamaForCausalLM (SDPA) + peft LoRA, padded batches of 8, model(...).loss
  ours_padded_reference   our Decoder + inject_lora, padded batches of 8, kernels "reference"
  ours_packed_reference   packed 8 × 2048 rows (document mask), kernels "reference"
  ours_packed_fused       the same, kernels "auto" (fused Triton ops)
  ours_packed_fused_flex  the same with FlexAttention block masks (attention "flex")
--checkpointing adds the four again with activation checkpointing (group "<size>+ckpt"; ours
only once Decoder has a `gradient_checkpointing` attribute). Real tokens/s counts non-padding
tokens; ratios are vs hf_peft_padded of the same group.

    python -m bench.e2e_sft_gpu [--sizes 125m,1b] [--steps 10 --warmup 3] [--checkpointing] [--smoke]
"""
from __future__ import annotations

import torch

from glm_lora.kernels import ops as kernels
from bench.common import write_result
from bench.workloads import (precision_note, result_name, train_step, SIZES, TARGETS, RandomSFT, autocast, decoder_config, guarded, hf_peft,
                             our_model, parser, ratios, scaled_lengths, selected, setup, table, timed)
from glm_lora.data.packing import PackedBatches, padded_batches
from glm_lora.data.sampler import EpochSampler
from glm_lora.model.heads import causal_lm_loss
from glm_lora.engine.optim import build_optimizer
from glm_lora.model import inject_lora
from glm_lora.configs.schema import LoRAConfig

PROVIDERS = ("hf_peft_padded", "ours_padded_reference", "ours_packed_reference", "ours_packed_fused",
             "ours_packed_fused_flex")
BASE = "hf_peft_padded"


def run(name: str, size: str, src: RandomSFT, args, device: torch.device, vocab: int, seq_len: int,
        checkpointing: bool) -> dict:
    cfg = decoder_config(size, vocab, seq_len)
    order = iter(EpochSampler(len(src), seed=0))
    if "padded" in name:
        stream = padded_batches(src, order, batch_size=8)
    else:
        stream = PackedBatches(src, order, rows=8, seq_len=seq_len)
    batches = [next(stream) for _ in range(args.warmup + args.steps)]
    if name.startswith("hf"):
        model = hf_peft(cfg, device, checkpointing)

        def loss_of(b):
            return model(input_ids=b["input_ids"], attention_mask=(b["doc_ids"] != 0).long(), labels=b["labels"]).loss
    else:
        model = our_model(cfg, device, checkpointing)
        inject_lora(model, LoRAConfig(target_modules=TARGETS, r=64, alpha=128))

        def loss_of(b):
            return causal_lm_loss(model, b)[0]
    opt = build_optimizer(model, 2e-4, 0.0, fused=device.type == "cuda")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # Our kernels for ours_*; the HF providers never call them.
    with kernels.using("reference" if name.endswith("reference") else "auto", "flex" if name.endswith("flex") else "sdpa"):
        return {**timed(train_step(loss_of, opt, device), batches, args.warmup, device), "trainable_params": trainable}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--checkpointing", action="store_true", help="also run every provider with activation checkpointing")
    args = ap.parse_args()
    sizes, device, vocab, seq_len = setup(args)
    src = RandomSFT(scaled_lengths(args.samples, seq_len), vocab)
    results = {}
    for size in sizes:
        for ckpt in (False, True) if args.checkpointing else (False,):
            group = size + ("+ckpt" if ckpt else "")
            rows = {p: guarded(lambda: run(p, size, src, args, device, vocab, seq_len, ckpt), device)
                    for p in selected(args, PROVIDERS)}
            ratios(rows, BASE)
            results[group] = rows
    table(results, [("real_tokens_per_s", "{:>9,.0f} tok/s"), ("token_efficiency", "eff {:.3f}"),
                    ("step_ms", "{:7.1f} ms/step"), ("peak_mem_gb", "peak {:5.1f} GB"),
                    (f"tokens_per_s_vs_{BASE}", "{:5.2f}x tok/s"), (f"peak_mem_vs_{BASE}", "{:4.2f}x mem")])
    figures = {"workload": "LoRA SFT r64 a128 on 7 projections, skewed lengths, answer-only labels (last 30%)",
               "precision": precision_note() if device.type == "cuda" else "fp32 (smoke, CPU)",
               "batching": {"padded": "8 samples padded to the longest", "packed": f"8 rows x {seq_len} tokens"},
               "shapes": {s: SIZES[s] for s in sizes}, "vocab": vocab, "steps": args.steps, "warmup": args.warmup,
               "samples": args.samples, "results": results}
    print("->", write_result(result_name("e2e_sft_gpu", args), figures))


if __name__ == "__main__":
    main()
