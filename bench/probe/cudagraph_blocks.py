"""Do the blocks' CUDA graphs (`cuda_graphs: true`, engine/cuda_graphs.py) train what eager blocks train? (GPU)

Three copies of the 125M LoRA model (same seed): eager, eager again (the run-to-run floor: cuDNN's attention
backward is not deterministic), graphed; the same batches and optimizer steps on each; prints each step's loss and
the largest adapter-weight difference after the steps, against the first eager copy.

    PYTHONPATH=. python bench/probe/cudagraph_blocks.py [--steps 5]
"""
from __future__ import annotations

import torch

from bench import peer_gpu as P
from glm_lora.engine.cuda_graphs import graphed_training
from bench.workloads import RandomSFT, autocast, decoder_config, parser, scaled_lengths, setup, to_device
from glm_lora.model.heads import causal_lm_loss
from glm_lora.engine.optim import build_optimizer


def main() -> None:
    args = parser(__doc__).parse_args()        # --steps, --precision; --smoke: the CPU, where the graphed copy runs eager
    _, device, vocab, seq_len = setup(args)
    batches = P.packed_batches(RandomSFT(scaled_lengths(4000, seq_len), vocab), args.steps + 1, seq_len)
    cfg = decoder_config("smoke" if args.smoke else "125m", vocab, seq_len)
    runs = []
    for name in ("ours_sdpa", "ours_sdpa", "ours_sdpa_cudagraph"):
        torch.manual_seed(0)
        model = P.ours(cfg, device, name)
        with P.our_kernels(name), graphed_training(model, name.endswith("_cudagraph"), device=device):
            opt = build_optimizer(model, 2e-4, 0.0, fused=True)
            losses = []
            for b in batches[:args.steps]:
                b = to_device(b, device)
                with autocast(device):
                    loss = causal_lm_loss(model, b)[0]
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss))
        runs.append((losses, {k: v.detach().float().clone() for k, v in model.named_parameters() if v.requires_grad}))
        del model, opt
    (le, we), (le2, we2), (lg, wg) = runs
    for i, (a, a2, b) in enumerate(zip(le, le2, lg)):
        print(f"step {i}: loss eager {a:.6f}  eager again {a2:.6f}  graphed {b:.6f}  |diff| {abs(a - a2):.2e} / "
              f"{abs(a - b):.2e}")
    for label, w in (("eager again", we2), ("graphed", wg)):
        print(f"max |adapter weight diff| after the steps, {label}:", max(float((we[k] - w[k]).abs().max()) for k in we))


if __name__ == "__main__":
    main()
