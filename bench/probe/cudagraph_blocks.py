"""Are the blocks' CUDA graphs (bench.peer_gpu's `*_cudagraph`) the same computation as eager? (GPU)

Two copies of the 125M LoRA model (same seed), one eager, one with model.hidden_states graphed; the same batches
and optimizer steps on both; prints each step's loss and the largest adapter-weight difference after it.

    PYTHONPATH=. python bench/probe/cudagraph_blocks.py [--steps 5]
"""
from __future__ import annotations

import torch

from bench import peer_gpu as P
from bench.workloads import RandomSFT, autocast, decoder_config, parser, scaled_lengths, setup
from glm_lora.engine.losses import causal_lm_loss
from glm_lora.engine.optim import build_optimizer


def main() -> None:
    args = parser(__doc__).parse_args()        # --steps, --precision; --smoke runs the eager arm alone on the CPU
    _, device, vocab, seq_len = setup(args)
    batches = P.packed_batches(RandomSFT(scaled_lengths(4000, seq_len), vocab), args.steps + 1, seq_len)
    cfg = decoder_config("smoke" if args.smoke else "125m", vocab, seq_len)
    runs = []
    for name in ("ours_sdpa",) * 2 if args.smoke else ("ours_sdpa", "ours_sdpa_cudagraph"):
        torch.manual_seed(0)
        model = P.ours(cfg, device, name)
        with P.our_kernels(name):
            if name.endswith("_cudagraph"):
                P.graph_blocks(model, batches[-1], device)
            opt = build_optimizer(model, 2e-4, 0.0, fused=True)
            losses = []
            for b in batches[:args.steps]:
                b = P.to_device(b, device)
                with autocast(device):
                    loss = causal_lm_loss(model, b)[0]
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss))
        runs.append((losses, {k: v.detach().float().clone() for k, v in model.named_parameters() if v.requires_grad}))
        del model, opt
    (le, we), (lg, wg) = runs
    for i, (a, b) in enumerate(zip(le, lg)):
        print(f"step {i}: loss eager {a:.6f}  graphed {b:.6f}  |diff| {abs(a - b):.2e}")
    print("max |adapter weight diff| after the steps:", max(float((we[k] - wg[k]).abs().max()) for k in we))


if __name__ == "__main__":
    main()
