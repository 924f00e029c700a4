"""Run one of MiniMind's own training scripts unchanged, observing what it trains on and how fast.

    python -m bench.minimind_observe OUT.json SCRIPT [SCRIPT'S ARGS...]      (cwd: the script's trainer/ directory)

Two observers are put in before the script runs (it runs as __main__, as `python SCRIPT` would run it):
- its DataLoader: each batch's real tokens (input ids that are not the pad id) and slots (every id, pads included),
  counted on the host before the script moves the batch to the GPU;
- its optimizer (`torch.optim.AdamW`, which the script looks up when it builds one): the step count. After
  `--warmup` optimizer steps the GPU is synchronised once and the clock starts; when the loader is exhausted it is
  synchronised again and the clock stops. Batches fetched in between all finish before the stop, so
  tokens / seconds over that window is the steady throughput, without start-up or the first steps' allocations.

OUT.json gets the totals, that window and the peak GPU memory allocated (torch.cuda.max_memory_allocated).
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import time

import torch
import torch.utils.data

WARMUP_ENV = "MINIMIND_OBSERVE_WARMUP"     # optimizer steps before the clock starts
PAD_ENV = "MINIMIND_OBSERVE_PAD"           # the tokenizer's pad id


class Observed:
    def __init__(self, warmup: int, pad: int):
        self.warmup, self.pad = warmup, pad
        self.tokens = self.slots = self.steps = self.batches = 0
        self.start = self.stop = None
        self.tokens_at_start = self.slots_at_start = 0
        self.t0 = time.perf_counter()

    def batch(self, batch) -> None:
        ids = batch[0]
        self.batches += 1
        self.tokens += int((ids != self.pad).sum())
        self.slots += ids.numel()

    def step(self) -> None:
        self.steps += 1
        if self.steps == self.warmup and self.start is None:
            _sync()
            self.start, self.tokens_at_start, self.slots_at_start = time.perf_counter(), self.tokens, self.slots

    def exhausted(self) -> None:
        _sync()
        self.stop = time.perf_counter()

    def figures(self) -> dict:
        out = {"tokens": self.tokens, "slots": self.slots, "optimizer_steps": self.steps, "batches": self.batches,
               "wall_s_in_process": time.perf_counter() - self.t0}
        if self.start is not None and self.stop is not None and self.stop > self.start:
            window = self.stop - self.start
            tokens, slots = self.tokens - self.tokens_at_start, self.slots - self.slots_at_start
            out.update(window_s=window, window_tokens=tokens, tokens_per_s=tokens / window, slots_per_s=slots / window,
                       train_loop_s=self.stop - self.t0)
        if torch.cuda.is_available():
            out["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
        return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def install(obs: Observed) -> None:
    base_loader, base_adamw = torch.utils.data.DataLoader, torch.optim.AdamW

    class DataLoader(base_loader):
        def __iter__(self):
            for batch in super().__iter__():
                obs.batch(batch)
                yield batch
            obs.exhausted()

    class AdamW(base_adamw):
        def step(self, *args, **kwargs):
            out = super().step(*args, **kwargs)
            obs.step()
            return out

    torch.utils.data.DataLoader = DataLoader
    torch.optim.AdamW = AdamW


def main(argv: list[str]) -> None:
    out, script, *args = argv
    obs = Observed(int(os.environ.get(WARMUP_ENV, "20")), int(os.environ[PAD_ENV]))
    install(obs)
    atexit.register(lambda: open(out, "w").write(json.dumps(obs.figures(), indent=1)))
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
