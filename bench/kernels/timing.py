"""How the kernel benches run an implementation: timed by do_bench on CUDA; on the CPU (`--smoke`: tiny shapes,
fp32, Triton in its interpreter) called once, untimed, with torch.compile'd ones skipped.

A smoke run checks that every bench still fits the code it calls; its rows carry no figures (ms None).
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

M, SMOKE_M = 16384, 64          # rows (tokens) of the benches' activations: 8 × 2048 on CUDA
# torch.compile's CPU codegen costs minutes of C++ builds per shape: more than all the smoke runs together.
SKIP_COMPILED = "--smoke: torch.compile on the CPU is too slow for CI"


def device_from_cli(doc: str) -> torch.device:
    """Parse the kernel benches' one flag: --smoke runs on the CPU (Triton under TRITON_INTERPRET=1)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU, fp32, one untimed call each, no torch.compile (needs TRITON_INTERPRET=1)")
    if ap.parse_args().smoke:
        torch.set_num_threads(1)        # tiny shapes: extra threads only add contention on a shared CPU
        return torch.device("cpu")
    return torch.device("cuda")


def rows(device: torch.device) -> int:
    return M if device.type == "cuda" else SMOKE_M


def dtype_for(device: torch.device) -> torch.dtype:
    """bf16 on CUDA; fp32 on the CPU (the interpreter's bf16 dot is wrong)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def skipped(impl: str, device: torch.device) -> bool:
    return device.type != "cuda" and "compile" in impl


def median_ms(fn, device: torch.device, **do_bench) -> float | None:
    """do_bench's median of fn() on CUDA; on the CPU one call and None."""
    if device.type != "cuda":
        fn()
        return None
    return float(triton.testing.do_bench(fn, return_mode="median", **do_bench))


def rounded(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a / b, 3)


def write(name: str, rows: list[dict], device: torch.device) -> None:
    """Print the rows, then write them to bench/results/<name>[_smoke]_<date>_<commit>.json."""
    from bench.common import write_result
    for row in rows:
        print(row)
    print("->", write_result(name + ("" if device.type == "cuda" else "_smoke"), {"rows": rows}))


def measure(fn, inputs, cotangents) -> tuple[float | None, float | None]:
    """(median ms, peak MB above what was allocated before) of one forward + backward of fn(*inputs);
    on the CPU one step and (None, None)."""
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        outs = fn(*inputs)
        torch.autograd.grad(outs if isinstance(outs, tuple) else (outs,), wrt, cotangents)

    if not wrt[0].is_cuda:
        step()
        return None, None
    for _ in range(3):                 # compiles (Triton JIT, torch.compile) before anything is measured
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    return triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median"), peak_mb


def compare(op: str, shape: str, dtype: torch.dtype, impls: dict, inputs, cotangents) -> list[dict]:
    """One row per implementation; ratio_vs_eager = ms / eager ms (below 1 is faster than eager)."""
    rows = []
    device = inputs[0].device
    for impl, fn in impls.items():
        row = {"op": op, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "impl": impl}
        if skipped(impl, device):
            rows.append({**row, "skipped": SKIP_COMPILED})
            continue
        ms, peak_mb = measure(fn, inputs, cotangents)
        rows.append({**row, "ms": rounded(ms, 4), "peak_mem_mb": rounded(peak_mb, 1)})
    eager_ms = next(r["ms"] for r in rows if r["impl"] == "eager")
    for r in rows:
        r["ratio_vs_eager"] = ratio(r.get("ms"), eager_ms)
    return rows
