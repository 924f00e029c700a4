"""`<stage>.compile` (engine/compile.py): compiled training steps learn what eager ones do (fp32 rounding
apart), evaluation stays eager, and every way compiling can't work falls back to eager with a reason."""
from __future__ import annotations

import os

import pytest
import torch

import glm_lora.engine.compile as ec
from glm_lora.configs.schema import TrainConfig
from glm_lora.engine.compile import compiled_training
from glm_lora.model.heads import causal_lm_loss
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from glm_lora.configs.schema import LoRAConfig

torch.set_num_threads(1)
CPU = torch.device("cpu")
VOCAB = 61


def lora_model(seed=0) -> Decoder:
    torch.manual_seed(seed)
    m = Decoder(DecoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                              intermediate_size=48, max_seq_len=32, arch="qwen3"))
    inject_lora(m, LoRAConfig(target_modules="all-linear", r=4, alpha=8, modules_to_save=["embed_tokens", "lm_head"]))
    return m.train()


def packed(seed: int, B=3, T=16) -> dict:
    """Rows of two documents each, like data.packing's (doc ids, positions restarting, answer-only labels)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (B, T), generator=g)
    cut = T // 2 - 1
    doc = torch.cat([torch.ones(B, cut, dtype=torch.long), torch.full((B, T - cut), 2)], 1)
    pos = torch.cat([torch.arange(cut), torch.arange(T - cut)]).expand(B, T)
    labels = torch.where(torch.rand(B, T, generator=g) < 0.4, x, -100)
    return {"input_ids": x, "labels": labels, "doc_ids": doc, "position_ids": pos, "packed": True}


def run(model, n: int, bf16: bool = False, **ctx) -> tuple[list[float], dict]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    with compiled_training(model, device=CPU, **ctx) as info:
        for i in range(n):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):     # as `precision: auto` on AVX512-BF16
                loss, _ = causal_lm_loss(model, packed(i % 4))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():      # evaluation inside the block: eager (other shapes, no recompiles)
            model.hidden_states(torch.zeros(1, 5, dtype=torch.long))
        model.train()
    assert "hidden_states" not in model.__dict__       # the method is back after the block
    return losses, info


def test_compiled_steps_learn_what_eager_steps_do(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))      # a cold, private cache: the kernels are written
    cache = tmp_path / "xdg" / "glm-lora" / "inductor"
    if ec.cxx_compiler() is None:
        pytest.skip("no C++ compiler: the fallback tests cover this machine")
    eager, info_e = run(lora_model(), 12, enabled=False)
    torch.set_num_threads(2)        # as the stages run on two cores: inductor writes parallel kernels
    try:
        compiled, info_c = run(lora_model(), 12, enabled=True, runs_dir=tmp_path)
    finally:
        torch.set_num_threads(1)
    assert info_e == {"compile": False}
    assert info_c["compile"] is True and info_c["compile_s"] > 0 and "compile_fallback" not in info_c
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache.resolve())
    assert any(cache.iterdir())         # the compiled artifacts are there
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-5)
    assert compiled[-1] < compiled[0] - 0.5          # it learned
    # Reproducible from run to run: no kernel sums with parallel atomic adds (the trained embedding's backward
    # did, so two runs of the same config trained different weights), and the deterministic mode is the
    # compiled block's only.
    kernels = list(cache.rglob("*.cpp"))
    assert kernels and not [k.name for k in kernels if "atomic_add" in k.read_text()]
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_second_compile_of_the_bf16_step_comes_from_aot_autograds_cache(tmp_path, monkeypatch):
    """Under bf16 autocast the CPU attention leaves autocast for fp32 inside the graph, whose enter/exit calls AOT
    autograd's cache refused: every run re-traced forward and backward (~15 s of the tiny SFT's warm compile). Marked
    cacheable (engine.compile.AUTOCAST_CACHEABLE), a second compile of the same step is a cache hit, and it trains
    the same losses bit for bit."""
    from torch._dynamo.utils import counters
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)       # the user's cache, as a stage uses it: warm
    if ec.cxx_compiler() is None:                                       # after the first run on a machine
        pytest.skip("no C++ compiler: the fallback tests cover this machine")
    counters.clear()
    first, info_1 = run(lora_model(), 4, bf16=True, enabled=True, runs_dir=tmp_path)
    aot = counters["aot_autograd"]
    assert info_1["compile"] is True and aot["autograd_cache_saved"] + aot["autograd_cache_hit"] == 1, dict(aot)
    torch._dynamo.reset()          # a new process, as far as dynamo's in-memory state goes
    counters.clear()               # the first run may itself have been a hit (a warm user's cache)
    second, info_2 = run(lora_model(), 4, bf16=True, enabled=True, runs_dir=tmp_path)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])
    assert "autograd_cache_bypass" not in counters["aot_autograd"]
    assert second == first


def test_cache_dir_is_the_users_and_replaces_only_inductors_default(tmp_path, monkeypatch):
    """One cache per user, outside any run directory: another run directory or checkout compiles warm."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    for runs in ("runs", "other-runs"):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())   # what importing torch._dynamo leaves
        assert ec.cache_dir(tmp_path / runs) == tmp_path / "home" / ".cache" / "glm-lora" / "inductor"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert ec.cache_dir(tmp_path / "runs") == tmp_path / "xdg" / "glm-lora" / "inductor"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("HOME")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")                               # no home directory: the run's own
    assert ec.cache_dir(tmp_path / "runs") == (tmp_path / "runs" / ".cache" / "inductor").resolve()
    (tmp_path / "not-a-dir").write_text("")                                 # a home where nothing can be made
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert ec.cache_dir(tmp_path / "runs") == (tmp_path / "runs" / ".cache" / "inductor").resolve()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))    # the user's choice is kept
    assert ec.cache_dir(tmp_path / "other") == tmp_path / "mine"


def test_no_cxx_compiler_runs_eager(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))       # (restored after the test)
    monkeypatch.setattr(ec, "cxx_compiler", lambda: None)
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compile must not be tried"))
    eager, _ = run(lora_model(), 3, enabled=False)
    losses, info = run(lora_model(), 3, enabled=True, runs_dir=tmp_path)
    assert info["compile"] is False and "C++ compiler" in info["compile_fallback"]
    assert losses == eager and "running eager" in caplog.text


def test_a_failing_compile_falls_back_to_eager(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ec, "cxx_compiler", lambda: "g++")

    def broken(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("InductorError: CppCompileError: no such header\nmore")
        return call
    monkeypatch.setattr(torch, "compile", broken)
    eager, _ = run(lora_model(), 3, enabled=False)
    losses, info = run(lora_model(), 3, enabled=True, runs_dir=tmp_path)
    assert losses == eager
    assert info["compile"] is False and info["compile_fallback"].startswith("compile failed: RuntimeError")


def test_several_processes_stay_eager_and_cuda_needs_no_cxx_compiler(monkeypatch):
    assert "torchrun" in ec.unavailable(CPU, object())
    assert "torchrun" in ec.unavailable(torch.device("cuda"), object())
    monkeypatch.setattr(ec, "cxx_compiler", lambda: None)       # inductor writes Triton kernels for CUDA
    assert ec.unavailable(torch.device("cuda"), None) is None
    assert "C++ compiler" in ec.unavailable(CPU, None)
    assert "mps" in ec.unavailable(torch.device("mps"), None)


def test_max_autotune_compiles_with_inductors_gemm_autotuning(monkeypatch, tmp_path):
    """`compile: max-autotune` is torch.compile's "max-autotune-no-cudagraphs" (the GEMMs autotuned, no CUDA graphs:
    the step's buffers stay the caller's); `true` is the default mode. The setting is validated by the config."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ec, "cxx_compiler", lambda: "g++")
    modes = []
    monkeypatch.setattr(torch, "compile", lambda fn, **k: modes.append(k.get("mode", "unset")) or fn)
    for setting in ("max-autotune", True):
        _, info = run(lora_model(), 1, enabled=setting, runs_dir=tmp_path)
        assert info["compile"] is True, info
    assert modes == ["max-autotune-no-cudagraphs", None]
    assert TrainConfig(compile="max-autotune").compile == "max-autotune"


def test_compile_is_off_by_default():
    assert TrainConfig().compile is False


def test_auto_compiles_only_a_stage_long_enough_to_pay_the_compile_back(monkeypatch, caplog, tmp_path):
    """`compile: auto`: below engine.compile.PAYBACK_STEPS steps the stage runs eager (a cold compile, ~24 s on two
    cores, pays back after ~400 steps) and says why; at the threshold it compiles like `true`."""
    assert ec.skip_reason("auto", ec.PAYBACK_STEPS - 1) and ec.skip_reason("auto", ec.PAYBACK_STEPS) is None
    assert ec.skip_reason(True, 1) is None and ec.skip_reason(False, 1) is None
    # On CUDA only an explicit setting compiles (the 1B steps gained nothing or lost, bench/RESULTS.md).
    cuda = torch.device("cuda")
    assert "CUDA" in ec.skip_reason("auto", 10 * ec.PAYBACK_STEPS, cuda)
    assert ec.skip_reason(True, 1, cuda) is None and ec.skip_reason("max-autotune", 1, cuda) is None
    assert TrainConfig(compile="auto").compile == "auto" and TrainConfig(compile=True).compile is True
    with pytest.raises(ValueError):
        TrainConfig(compile="sometimes")
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("a short auto stage must not compile"))
    eager, _ = run(lora_model(), 3, enabled=False)
    with caplog.at_level("INFO", logger="glm_lora.engine"):
        losses, info = run(lora_model(), 3, enabled="auto", steps=12, runs_dir=tmp_path)
    assert losses == eager
    assert info["compile"] is False and "fewer than the 400" in info["compile_skipped"], info
    assert "compile_fallback" not in info and "running eager: 12 steps" in caplog.text
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **k: compiled.append(fn) or fn)
    monkeypatch.setattr(ec, "cxx_compiler", lambda: "g++")
    _, info = run(lora_model(), 1, enabled="auto", steps=ec.PAYBACK_STEPS, runs_dir=tmp_path)
    assert compiled and info["compile"] is True and "compile_skipped" not in info, info


def test_where_blocks_are_split_the_graphs_break_only_there_and_learn_the_same(monkeypatch):
    """model.COMPILE_SPLITS_BLOCKS (on for CUDA, where one graph over the stack measured 1.15x slower): each block
    is cut before its MLP by an explicit graph break, and nowhere else; off (the CPU), the stack is one graph. Either
    way the compiled forward gives the eager one's loss and gradients."""
    from glm_lora.model import model as decoder_module
    batch = packed(0)
    torch._dynamo.reset()
    one = torch._dynamo.explain(lora_model().hidden_states)(batch["input_ids"], batch["position_ids"], batch["doc_ids"])
    assert one.graph_break_count == 0 and one.graph_count == 1, one.break_reasons
    monkeypatch.setitem(decoder_module.COMPILE_SPLITS_BLOCKS, "cpu", True)
    torch._dynamo.reset()
    split = torch._dynamo.explain(lora_model().hidden_states)(batch["input_ids"], batch["position_ids"],
                                                               batch["doc_ids"])
    assert split.graph_break_count >= 2 and split.graph_count > 2       # two blocks: at least one cut in each
    assert {r.reason.splitlines()[0] for r in split.break_reasons} == {"Call to `torch._dynamo.graph_break()`"}
    torch._dynamo.reset()
    eager, compiled = lora_model(), lora_model()
    compiled.hidden_states = torch.compile(compiled.hidden_states, backend="aot_eager")
    losses = [causal_lm_loss(m, batch)[0] for m in (eager, compiled)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0])
    for p_compiled, p_eager in zip(compiled.parameters(), eager.parameters()):
        if p_eager.requires_grad:
            torch.testing.assert_close(p_compiled.grad, p_eager.grad)
