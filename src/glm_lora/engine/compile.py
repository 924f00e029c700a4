"""`<stage>.compile`: torch.compile the decoder's training forward and backward.

Why: a small model's step spends much of its time in small elementwise ops (RMSNorm, RoPE, SwiGLU, the LoRA
scale-and-add, residuals), one kernel each; inductor fuses them. The compile costs tens of seconds once, so on the
CPU `auto` compiles only a stage of at least PAYBACK_STEPS steps; on CUDA a stage compiles only when asked (`true`,
`max-autotune`): it pays for small, elementwise-heavy steps and not for large ones (figures: bench/RESULTS.md).

Only training forwards are compiled: `Decoder.hidden_states` is replaced, on this model instance and for the
block's duration, by a function that runs the compiled graph in train mode (fixed shapes: batch_size x seq_len
packed rows) and the eager method otherwise (validation and decoding have other, changing shapes that would each
recompile). Losses, optimizer and clipping stay eager: the lm_head runs on a data-dependent number of answer rows.
On CUDA the compiled blocks run the torch reference ops (kernels.ops._impl inside a compiled region), which inductor
fuses, in place of our Triton kernels; each block compiles as two graphs, cut before its MLP
(model.COMPILE_SPLITS_BLOCKS: one graph over the stack was slower).

Falls back to eager, with a warning, where compiling can't work: a mixture-of-experts model, no C++ compiler for
inductor on the CPU, or several processes (DDP/FSDP2 wrap the model). If the compile itself fails on the first call,
that call and the rest of the stage run eager.

The compiled artifacts go to the user's cache, `$XDG_CACHE_HOME/glm-lora/inductor` or `~/.cache/glm-lora/inductor`
(TORCHINDUCTOR_CACHE_DIR wins where it is set; `runs_dir/.cache/inductor` without a home directory): inductor names
each entry by what decides it (the graph, torch's version and config, the C++ compiler), so another run directory,
a fresh checkout or a CI clone on the same machine reuses what any of them compiled.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Iterator

import torch

log = logging.getLogger("glm_lora.engine")


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use (`cpp.cxx`, $CXX; g++ by default), or None if there is none."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        return get_cpp_compiler()
    except Exception:       # InvalidCxxCompiler, or an inductor without this helper
        return None


def unavailable(device: torch.device, dist, model: torch.nn.Module | None = None) -> str | None:
    """Why compiling can't be used here, or None if it can."""
    layout = getattr(getattr(model, "config", None), "layout", None)
    if getattr(layout, "moe", False):
        return "mixture-of-experts layers (each step's expert batches have new sizes: a recompile every step)"
    if getattr(layout, "linear_attention", False):
        return ("gated DeltaNet layers (packed documents laid out chunk-aligned: each step's rows have a new length, "
                "a recompile every step)")
    if device.type not in ("cpu", "cuda"):
        return f"device {device.type} (compiling is measured on the CPU and CUDA only)"
    if dist is not None:
        return "several processes (torchrun): not measured with DDP/FSDP2"
    if device.type == "cpu" and cxx_compiler() is None:
        return "no C++ compiler found for inductor (install g++ or set CXX)"
    return None


PAYBACK_STEPS = 400


def run_eager(info: dict, setting: str, stage: str, why: str) -> None:
    """`<stage>.<setting>` (compile, cuda_graphs) was asked for and is not used: the reason goes into the stage's
    report (`<setting>_fallback`) and the log."""
    info[f"{setting}_fallback"] = why
    log.warning("%s.%s: running eager: %s", stage, setting, why)


def failure(e: Exception, what: str) -> str:
    """A compile's or a capture's error in one line (its message's first, at most 300 characters)."""
    first_line = (str(e).splitlines() or [""])[0][:300]
    return f"{what} failed: {type(e).__name__}: {first_line}"


# The CPU attention leaves autocast for fp32 inside the graph (kernels.reference.attention_in_fp32), and AOT
# autograd's cache refuses any graph holding autocast's enter/exit calls, so every run re-traced forward and backward
# (~15 s of the tiny SFT's ~19 s warm compile on two cores, bench/RESULTS.md "AOT autograd's cache"). The two calls
# are fixed by their constant arguments and torch's version, which keys the entry: marked cacheable for our compile.
AUTOCAST_CACHEABLE = {f"torch.amp.autocast_mode.{f}": torch.__version__ for f in ("_enter_autocast", "_exit_autocast")}

MODES = {True: None, "auto": None, "max-autotune": "max-autotune-no-cudagraphs"}     # setting -> torch.compile's mode


def skip_reason(setting: bool | str, steps: int | None, device: torch.device = torch.device("cpu")) -> str | None:
    """Why `compile: auto` leaves a stage of `steps` steps eager (None: compile it; also for the other settings, and
    for an unknown number of steps on the CPU)."""
    if setting == "auto" and device.type == "cuda":
        return ("CUDA: compiled blocks paid only for small elementwise-heavy steps (125M pretraining 1.38x, 1B 1.01x, "
                "1B LoRA SFT 0.92x); set compile: true or max-autotune to compile (compile: auto)")
    if setting == "auto" and steps is not None and steps < PAYBACK_STEPS:
        return f"{steps} steps, fewer than the {PAYBACK_STEPS} a cold compile takes to pay back (compile: auto)"
    return None


def cache_dir(runs_dir: Path) -> Path:
    """Where inductor keeps compiled artifacts: $TORCHINDUCTOR_CACHE_DIR if set, else the user's cache
    (`$XDG_CACHE_HOME` or `~/.cache`, then glm-lora/inductor), else (no home directory) runs_dir/.cache/inductor.

    (Importing torch._dynamo, which transformers does, writes inductor's default /tmp/torchinductor_<user> into
    the environment; inductor reads the variable at each use, so that default is replaced here too.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(_users_cache() or (Path(runs_dir) / ".cache" / "inductor").resolve())
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def _users_cache() -> Path | None:
    """glm-lora/inductor under $XDG_CACHE_HOME or ~/.cache, if there is a home and the directory can be made there
    (a service account's home may be missing or read-only: the run's own directory then, not a failed compile)."""
    home = os.environ.get("XDG_CACHE_HOME") or (os.environ.get("HOME") and Path(os.environ["HOME"]) / ".cache")
    if not home:
        return None
    path = (Path(home) / "glm-lora" / "inductor").resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


@contextlib.contextmanager
def compiled_training(model: torch.nn.Module, enabled: bool | str, *, device: torch.device, dist=None,
                      runs_dir: Path = Path("runs"), name: str = "train", steps: int | None = None) -> Iterator[dict]:
    """Inside the block, `model.hidden_states` runs compiled while `model.training` (see the module doc).
    `enabled`: the stage's `compile` setting (true, false, "max-autotune", or "auto" with the stage's `steps`).
    Yields a dict the stage can report: compile (bool: used), compile_s (the first compiled call: compile
    plus one forward), compile_fallback (why eager, if it was asked for and not used), compile_skipped (why
    `auto` chose eager)."""
    info: dict = {"compile": False}
    skipped = skip_reason(enabled, steps, device)
    if skipped:
        log.info("%s.compile: running eager: %s", name, skipped)
        info["compile_skipped"] = skipped
        enabled = False
    cache = cache_dir(runs_dir) if enabled else None      # before anything of inductor's reads it
    why = unavailable(device, dist, model) if enabled else None
    if not enabled or why:
        if why:
            run_eager(info, "compile", name, why)
        yield info
        return
    eager = model.hidden_states                                     # the bound method
    compiled = torch.compile(eager, dynamic=False, mode=MODES[enabled])

    def hidden_states(*args, **kwargs):
        if not model.training or info.get("compile_fallback"):
            return eager(*args, **kwargs)
        if "compile_s" in info:
            return compiled(*args, **kwargs)
        t = time.perf_counter()
        try:
            from torch._inductor import config as inductor_config
            with inductor_config.patch(unsafe_marked_cacheable_functions=AUTOCAST_CACHEABLE):
                out = compiled(*args, **kwargs)
        except Exception as e:      # a genuine error in the model raises again from the eager call below
            run_eager(info, "compile", name, failure(e, "compile"))
            return eager(*args, **kwargs)
        info.update(compile=True, compile_s=round(time.perf_counter() - t, 3))
        log.info("%s.compile: forward compiled in %.1f s (cache %s)", name, info["compile_s"], cache)
        return out

    model.hidden_states = hidden_states             # an instance attribute shadows the method
    try:
        with _deterministic() if device.type == "cpu" else contextlib.nullcontext():
            yield info
    finally:
        del model.hidden_states


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """torch's deterministic mode while the compiled CPU graphs are built and run: inductor otherwise lowers
    accumulating index_puts (the trained embedding's backward) to parallel atomic adds on the CPU, whose
    summation order — and so the trained weights, and the answers — changed from one run to the next.
    warn_only: an op with no deterministic kernel warns instead of failing the stage."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
