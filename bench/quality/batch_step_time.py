"""SFT step time on this CPU at several batch sizes, interleaved in rounds (what turns the quality
sweep's steps into CPU minutes: README "Answer quality on the tiny default").

    python bench/quality/batch_step_time.py RUN_DIR [--rounds 3] [--seconds 10] [--batch 8 16 32]

RUN_DIR holds `data/`, `tokenizer/` and `pretrain/` stage outputs of the tiny config (e.g. runs/tiny).
One process, one model per batch size, rounds alternate between them so that load from other jobs
falls on all alike; prints the median ms/step per round and the smallest round median per size.
"""
import argparse, statistics, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from glm_lora.configs.load import load_config                      # noqa: E402
from glm_lora.data.pipeline import StageData                  # noqa: E402
from glm_lora.model.heads import causal_lm_loss             # noqa: E402
from glm_lora.engine.optim import build_optimizer             # noqa: E402
from glm_lora.model import inject_lora                        # noqa: E402
from glm_lora.model.hf import load_native                     # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--batch", type=int, nargs="+", default=[8, 16, 32])
    a = p.parse_args()
    setups = {}
    for bs in a.batch:
        tc = (cfg := load_config("tiny", {"runs_dir": str(a.run.parent), "sft.batch_size": bs})).sft
        make, _ = StageData(cfg, a.run / "tokenizer", a.run / "data", "cpu").batches("sft", tc)
        torch.manual_seed(0)
        model = load_native(a.run / "pretrain")
        inject_lora(model, tc.lora)
        model.train()
        setups[bs] = (model, build_optimizer(model, tc.lr, tc.weight_decay), make(None))

    def step(model, opt, batch):
        loss, _ = causal_lm_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([q for q in model.parameters() if q.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    medians = {bs: [] for bs in setups}
    for r in range(a.rounds):
        for bs, (model, opt, batches) in setups.items():
            for _ in range(2):                           # warm-up after switching models
                step(model, opt, next(batches))
            times, t0 = [], time.perf_counter()
            while time.perf_counter() - t0 < a.seconds:
                batch = next(batches)
                t = time.perf_counter(); step(model, opt, batch); times.append(time.perf_counter() - t)
            medians[bs].append(statistics.median(times))
            print(f"round {r} batch {bs}: {len(times)} steps, median {1000 * medians[bs][-1]:.1f} ms", flush=True)
    base = min(medians[a.batch[0]])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for bs, m in medians.items():
        print(f"batch {bs}: {1000 * min(m):.1f} ms/step (smallest round median), {min(m) / base:.2f}× batch {a.batch[0]}")
    for _, _, batches in setups.values():
        batches.close()


if __name__ == "__main__":
    main()
