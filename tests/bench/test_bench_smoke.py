"""Every bench runs on the CPU at tiny sizes, a step or two, against the code as it is: a bench that no longer fits the
code (a renamed function, a stage object grown an attribute the bench does not set) fails here instead of on the
next GPU session.

Each case runs the bench's own `main` with its smoke flag in this process (torch, transformers and PEFT are imported
once for all of them), with every provider whose libraries CI has. A bench records a failing provider as
{"error": ...} and goes on with the others, so the test reads the figures the bench wrote and fails on any error.

Not run here, and why:
- bench/sft_packing_gpu.py, bench/grouped_mm_gpu.py, bench/kernels/*.py: no CPU path yet (CUDA tensors, CUDA-event
  timing and the GPU shapes are fixed in the code); their kernels run in the Triton interpreter in tests/kernels/.
- bench/torchrun_overhead_gpu.py: a run is two CLI stages and four engine processes (~1 CPU-minute of process starts
  even at tiny sizes); the same torchrun path runs in tests/engine/test_dist.py.
- bench/serve_throughput.py, bench/serve_load.py, bench/rl_sampler_cpu.py, bench/probe/vllm_poll_cpu.py: need vLLM,
  which only the deployment tests' second virtualenv has.
- bench/cpu_step.py, bench/probe/cpu_sft_levers.py, bench/quality/*: need a finished tiny run (data, tokenizer,
  pretrained base) and measure over minutes; the quality harness's stages are the flow's own (tests/test_quality.py).
- bench/probe/{copy_probe,pretrain_probe,cudagraph_blocks}.py: GPU profiles (torch.cuda and CUDA graphs throughout).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
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
    bench = importlib.import_module(module)
    if module == "bench.packing_efficiency":
        return ["--samples", "300", "--rows", "2"]
    if module == "bench.peer_gpu":
        return ["--smoke", *every_provider(*bench.SFT, *bench.DPO)]
    return ["--smoke", *every_provider(*bench.PROVIDERS)]


BENCHES = ["bench.e2e_sft_gpu", "bench.e2e_dpo_gpu", "bench.e2e_pretrain_gpu", "bench.peer_gpu", "bench.moe_gpu",
           "bench.qlora_gpu", "bench.rl_gpu", "bench.packing_efficiency"]


@pytest.mark.parametrize("module", BENCHES)
def test_the_bench_runs_at_smoke_size(module, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", [module, *smoke_args(module)])
    importlib.import_module(module).main()
    written = list(tmp_path.glob("*.json"))
    assert len(written) == 1, f"{module} wrote {[p.name for p in written]}"
    figures = json.loads(written[0].read_text())
    assert not errors(figures), errors(figures)


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
