"""GPU benchmark: DSA's sparse attention (Triton) against the masked-dense form and dense causal flash attention,
forward + backward; and the chunked indexer top-k.

CUDA: one document per row (B = 1) of 4k, 16k and 64k tokens, K = 2048 keys per query (the index that `index_topk`
picks over random indexer inputs, 32 heads × 128), bf16, 16 query heads (GLM-5's attention scaled to one GPU) in two
forms: absorbed MLA (Hkv = 1, Dk 576, Dv 512) and plain (Hkv = Hq = 16, Dk = Dv = 256). For each length and form,
do_bench's median ms of forward + backward and the peak memory above the inputs (bench/kernels/timing.py `measure`) of

  sparse        kernels.triton_sparse_attention, O(T·K) memory
  masked_dense  transformers' form: the T × T bool mask scattered from the index (built inside the step), then SDPA
                with it (reference.attention); "OOM" where it does not fit
  dense_flash   SDPA is_causal (FlashAttention) over all T²/2 pairs, what a dense path pays at best; plain form only
                (no flash kernel takes Dk = 576)

and index_topk's median ms and peak memory (no_grad). Printed last, and its own row: the crossover, the shortest
length where sparse beats dense_flash. --smoke: lengths 16 and 24, K 8, tiny heads, fp32 on the CPU (Triton
interpreted), each implementation called once, untimed.

    python -m bench.kernels.sparse_attention [--smoke]
"""
from __future__ import annotations

import gc

import torch
import torch.nn.functional as F

from bench.kernels.timing import device_from_cli, dtype_for, measure, median_ms, rounded, write
from glm_lora.kernels import reference as ref
from glm_lora.kernels.triton_sparse_attention import sparse_attention

LENGTHS, SMOKE_LENGTHS = (4096, 16384, 65536), (16, 24)
TOPK, SMOKE_TOPK = 2048, 8
FORMS = {"absorbed": (16, 1, 576, 512), "plain": (16, 16, 256, 256)}     # (Hq, Hkv, Dk, Dv)
SMOKE_FORMS = {"absorbed": (4, 1, 40, 32), "plain": (2, 2, 16, 16)}
INDEXER, SMOKE_INDEXER = (32, 128), (2, 8)                               # indexer heads, head dim


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _peak_mb(fn, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def index_for(T: int, topk: int, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    """The indexer's top-k over random (B = 1) indexer inputs, and its timing row."""
    heads, dim = INDEXER if device.type == "cuda" else SMOKE_INDEXER
    dtype = dtype_for(device)
    q = torch.randn(1, T, heads, dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(1, T, dim, device=device, dtype=dtype, generator=gen)
    w = torch.randn(1, T, heads, device=device, dtype=dtype, generator=gen) * heads ** -0.5

    def pick():
        return ref.index_topk(q, k, w, None, topk, dim ** -0.5)
    index = pick()
    row = {"op": "index_topk", "T": T, "K": topk, "shape": f"{heads}x{dim}", "dtype": str(dtype).removeprefix("torch."),
           "impl": "chunked_torch", "ms": rounded(median_ms(pick, device), 3),
           "peak_mem_mb": rounded(_peak_mb(pick, device), 1)}
    return index, row


def attention_rows(form: str, T: int, index: torch.Tensor, device: torch.device, gen: torch.Generator) -> list[dict]:
    Hq, Hkv, Dk, Dv = (FORMS if device.type == "cuda" else SMOKE_FORMS)[form]
    dtype = dtype_for(device)

    def leaf(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    q, k, v = leaf(1, Hq, T, Dk), leaf(1, Hkv, T, Dk), leaf(1, Hkv, T, Dv)
    do = torch.randn(1, Hq, T, Dv, device=device, dtype=dtype, generator=gen)
    scale = Dk ** -0.5                                     # SDPA's default, which both dense paths use
    impls = {"sparse": lambda q, k, v: sparse_attention(q, k, v, index, scale),
             "masked_dense": lambda q, k, v: ref.attention(q, k, v, ref.sparse_index_mask(index, T))}
    if Hq == Hkv and Dk == Dv:
        impls["dense_flash"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rows = []
    for impl, fn in impls.items():
        try:
            ms, peak = measure(fn, (q, k, v), (do,))
            ms, peak = rounded(ms, 3), rounded(peak, 1)
        except torch.OutOfMemoryError:
            ms = peak = "OOM"
        _free(device)                                      # after the except block: its traceback holds the tensors
        rows.append({"op": "sparse_attention", "form": form, "T": T, "K": index.shape[-1],
                     "shape": f"Hq{Hq}/Hkv{Hkv} Dk{Dk}/Dv{Dv}", "dtype": str(dtype).removeprefix("torch."),
                     "impl": impl, "ms": ms, "peak_mem_mb": peak})
    return rows


def crossover(rows: list[dict]) -> dict:
    """The shortest length where sparse's fwd + bwd beats dense_flash's (plain form), None if none or untimed."""
    times = {(r["T"], r["impl"]): r["ms"] for r in rows if r["op"] == "sparse_attention" and r["form"] == "plain"}
    wins = sorted(T for (T, impl), ms in times.items() if impl == "sparse" and isinstance(ms, float)
                  and isinstance(times.get((T, "dense_flash")), float) and ms < times[(T, "dense_flash")])
    return {"op": "crossover", "form": "plain", "sparse_beats_dense_flash_from_T": wins[0] if wins else None,
            "lengths": sorted({T for T, _ in times})}


def bench(device: torch.device) -> list[dict]:
    gen = torch.Generator(device).manual_seed(0)
    topk = TOPK if device.type == "cuda" else SMOKE_TOPK
    rows = []
    for T in LENGTHS if device.type == "cuda" else SMOKE_LENGTHS:
        index, index_row = index_for(T, topk, device, gen)
        rows.append(index_row)
        print(index_row, flush=True)                # each row as it comes: a run cut short keeps what it measured
        for form in FORMS:
            rows += attention_rows(form, T, index, device, gen)
            print(*rows[-3:], sep="\n", flush=True)
        del index
        _free(device)
    rows.append(crossover(rows))
    found = rows[-1]["sparse_beats_dense_flash_from_T"]
    print(f"crossover (plain form): sparse beats dense causal flash from T = {found}" if found else
          f"crossover (plain form): sparse beat dense causal flash at none of T = {rows[-1]['lengths']} (or untimed)")
    return rows


def main() -> None:
    device = device_from_cli(__doc__)
    write("kernels_sparse_attention", bench(device), device)


if __name__ == "__main__":
    main()
