"""Every bench runs on the CPU at tiny sizes, a step or two, against the code as it is: a bench that no longer fits the
code (a renamed function, a stage object grown an attribute the bench does not set) fails here instead of on the
next GPU session.

Each case runs the bench's own `main` with its smoke flag in this process (torch, transformers and PEFT are imported
once for all of them), with every provider whose libraries CI has. A bench records a failing provider as
{"error": ...} and goes on with the others, so the test reads the figures the bench wrote and fails on any error.
The kernel benches (bench/kernels/*.py, bench/grouped_mm_gpu.py) call each implementation once, untimed, in fp32 at
64-row shapes, their Triton kernels in the interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets before
anything imports Triton); a failing implementation raises, or is recorded as {"error": ...} by grouped_mm_gpu.

Skipped inside the runs, by name:
- providers needing liger_kernel (not in CI's virtualenv): NEEDS below;
- torch.compile'd implementations of the kernel benches ("compile" in the name): inductor's CPU code generation
  takes minutes, more than all of these runs together;
- grouped_mm_gpu's torch_grouped_mm providers: torch._grouped_mm runs on CUDA only.

Not run here, and why:
- bench/torchrun_overhead_gpu.py: a run is two CLI stages and four engine processes (~1 CPU-minute of process starts
  even at tiny sizes); the same torchrun path runs in tests/engine/test_dist.py.
- bench/serve_throughput.py, bench/serve_load.py, bench/rl_sampler_cpu.py, bench/probe/vllm_poll_cpu.py: need a
  served model in vLLM's own virtualenv; serve_load's load loop (`run_load`) runs against the deployment in
  tests/serve/test_deployment.py.
- bench/cpu_step.py, bench/probe/cpu_sft_levers.py, bench/quality/*: need a finished tiny run (data, tokenizer,
  pretrained base) and measure over minutes; the quality harness's stages are the flow's own, and its
  bench.quality.fresh / bench.quality.on_run run in tests/test_quality.py.
- bench/probe/{copy_probe,pretrain_probe,cudagraph_blocks}.py: GPU profiles (torch.cuda and CUDA graphs throughout).
- bench/minimind_gpu.py: runs MiniMind's own scripts from a checkout the user points to, which CI cannot fetch; its
  observer and weight reader are tested in tests/bench/test_minimind_bench.py, and `--smoke` runs it on a CPU that
  has a checkout (~45 s).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys

import pytest

from bench import common

NEEDS = {"liger": "liger_kernel"}      # a provider named with the key needs the module (not in CI's virtualenv)


def ci_has(provider: str) -> bool:
    return all(importlib.util.find_spec(module) is not None for key, module in NEEDS.items() if key in provider)


def every_provider(*names: str) -> list[str]:
    return ["--providers", ",".join(p for p in dict.fromkeys(names) if ci_has(p))]


def errors(figures, where: str = "") -> list[str]:
    """Every {"error": ...} in a bench's figures, with where it sits."""
    if isinstance(figures, dict):
        found = [f"{where}: {figures['error']}"] if "error" in figures else []
        return found + [e for k, v in figures.items() for e in errors(v, f"{where}/{k}")]
    if isinstance(figures, list):
        return [e for i, v in enumerate(figures) for e in errors(v, f"{where}[{i}]")]
    return []


def smoke_args(module: str) -> list[str]:
    if module in KERNEL_BENCHES + ["bench.sft_packing_gpu", "bench.moe_scale_gpu"]:
        return ["--smoke"]                                    # every provider of these runs in CI's virtualenv
    bench = importlib.import_module(module)
    if module == "bench.packing_efficiency":
        return ["--samples", "300", "--rows", "2"]
    if module == "bench.peer_gpu":
        return ["--smoke", *every_provider(*bench.SFT, *bench.DPO)]
    return ["--smoke", *every_provider(*bench.PROVIDERS)]


KERNEL_BENCHES = [f"bench.kernels.{op}" for op in ("linear_loss", "lora_gemm", "lora_linear", "nf4", "rms_norm", "rope",
                                                    "sparse_attention", "swiglu")] + ["bench.grouped_mm_gpu"]
BENCHES = ["bench.e2e_sft_gpu", "bench.e2e_dpo_gpu", "bench.e2e_pretrain_gpu", "bench.peer_gpu", "bench.moe_gpu",
           "bench.dsa_gpu", "bench.moe_scale_gpu", "bench.qwen35_gpu", "bench.qlora_gpu", "bench.rl_gpu", "bench.packing_efficiency", "bench.sft_packing_gpu", *KERNEL_BENCHES]
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="CPU smoke runs of Triton kernels need TRITON_INTERPRET=1 (a GPU machine)")


def figures_written(where) -> dict | list:
    """The one results file a bench wrote: JSON, or JSON lines (a list of rows)."""
    written = list(where.glob("*.json")) + list(where.glob("*.jsonl"))
    assert len(written) == 1, f"wrote {[p.name for p in written]}"
    text = written[0].read_text()
    return [json.loads(line) for line in text.splitlines()] if written[0].suffix == ".jsonl" else json.loads(text)


@pytest.mark.parametrize("module", [pytest.param(m, marks=needs_interpreter) if m in KERNEL_BENCHES else m
                                    for m in BENCHES])
def test_the_bench_runs_at_smoke_size(module, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", [module, *smoke_args(module)])
    importlib.import_module(module).main()
    figures = figures_written(tmp_path)
    assert figures, f"{module} wrote no figures"
    assert not errors(figures), errors(figures)


@needs_interpreter
def test_the_rope_tile_probe_runs_at_smoke_size(monkeypatch, capsys):
    from bench.kernels.rope import SMOKE_HEADS
    monkeypatch.setattr(sys, "argv", ["bench.kernels.rope_tiles", "smoke", "--smoke"])
    importlib.import_module("bench.kernels.rope_tiles").main()
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("smoke tile")]) == len(SMOKE_HEADS)


def test_errors_finds_a_failed_provider_anywhere_in_the_figures():
    figures = {"results": {"smoke": {"ours": {"tok_s": 1.0}, "trl": {"error": "AttributeError: x"}}}, "rows": [{}]}
    assert errors(figures) == ["/results/smoke/trl: AttributeError: x"]
    assert errors({"results": {"smoke": {"ours": {"skipped": "--smoke: no compile"}}}}) == []


def test_ci_cpu_sums_a_cpu_log_per_module(tmp_path, monkeypatch, capsys):
    log = tmp_path / "cpu.jsonl"
    log.write_text("".join(json.dumps({"test": f"tests/a/test_x.py::t{i}", "cpu_s": 2.0, "wall_s": 3.0}) + "\n"
                           for i in range(2)))
    monkeypatch.setattr(sys, "argv", ["bench.ci_cpu", str(log), "--tests", "1"])
    importlib.import_module("bench.ci_cpu").main()
    assert "| tests/a/test_x.py | 4 | 6 | 2 |" in capsys.readouterr().out


def test_proc_sampler_samples_every_process_then_sums_the_new_ones_by_kind(tmp_path):
    import subprocess
    import time
    from pathlib import Path
    script = Path(common.BENCH, "probe", "proc_sampler.py")
    out = tmp_path / "procs.jsonl"
    sampler = subprocess.Popen([sys.executable, str(script), "sample", str(out)])
    time.sleep(0.8)                                    # past the first sample: what starts now counts
    subprocess.run([sys.executable, "-c", "import time; time.sleep(1.2)  # glm_lora"], check=True)
    sampler.terminate()
    assert sampler.wait(timeout=30) == 0
    kinds = importlib.import_module("bench.probe.proc_sampler").summary(str(out))
    assert kinds["the CLI and other glm_lora processes"][1] >= 1
