"""`<stage>.cuda_graphs` (engine/cuda_graphs.py) where no GPU is: every case the blocks can't be graphed in runs
eager with its reason, the model untouched; the config refuses it beside `compile: true`. (What the graphs
compute is checked on a GPU: tests/gpu/test_cuda_graphs_gpu.py.)"""
from __future__ import annotations

import pytest
import torch

from glm_lora.configs.load import ConfigError, load_config
from glm_lora.engine.cuda_graphs import graphed_training, unavailable
from glm_lora.model import Decoder, DecoderConfig

CUDA = torch.device("cuda")    # a device object only: nothing here runs on it


def model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab_size=61, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                 intermediate_size=48, max_seq_len=32)).train()


def test_on_the_cpu_the_stage_runs_eager_and_says_why():
    m = model()
    method = m.hidden_states
    with graphed_training(m, True, device=torch.device("cpu"), name="sft") as info:
        assert m.hidden_states == method                 # not wrapped
    assert info == {"cuda_graphs": False, "cuda_graphs_fallback": "device cpu (CUDA graphs need a CUDA device)"}
    with graphed_training(m, False, device=CUDA) as info:
        assert m.hidden_states == method
    assert info == {"cuda_graphs": False}


def test_every_case_it_cannot_capture_has_its_reason():
    m = model()
    assert unavailable(CUDA, None, m) is None
    assert "several processes" in unavailable(CUDA, object(), m)
    assert "gradient accumulation" in unavailable(CUDA, None, m, grad_accum=2)
    m.gradient_checkpointing = True
    assert "activation_checkpointing" in unavailable(CUDA, None, m)


def test_the_config_refuses_it_beside_a_compiled_step():
    with pytest.raises(ConfigError, match="sft: cuda_graphs: true with compile: True: choose one"):
        load_config("tiny", {"sft.cuda_graphs": True, "sft.compile": True})
    assert load_config("tiny", {"sft.cuda_graphs": True, "sft.compile": "auto"}).sft.cuda_graphs is True


def test_a_capture_that_fails_leaves_the_stage_eager(monkeypatch, caplog):
    """Where capturing raises (here: no CUDA to capture on), that call and the rest run eager, the reason reported."""
    import glm_lora.engine.cuda_graphs as cg
    monkeypatch.setattr(cg, "unavailable", lambda *a, **k: None)
    m = model()
    ids = torch.randint(0, 61, (2, 16))
    expected = m.hidden_states(ids)
    with graphed_training(m, True, device=CUDA, name="sft") as info:
        first, second = m.hidden_states(ids), m.hidden_states(ids)
    assert info["cuda_graphs"] is False and info["cuda_graphs_fallback"].startswith("capture failed: "), info
    assert "sft.cuda_graphs: running eager: capture failed" in caplog.text
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)


def test_a_reference_capture_that_fails_leaves_only_the_reference_pass_eager(monkeypatch, caplog):
    """The reference forward (no_grad in training mode: DPO's adapter-off pass) has a graph of its own; where it
    can't be captured that pass runs eager, reported apart, and the training graph is still tried."""
    import glm_lora.engine.cuda_graphs as cg
    monkeypatch.setattr(cg, "unavailable", lambda *a, **k: None)
    m = model()
    ids = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        expected = m.hidden_states(ids)
    with graphed_training(m, True, device=CUDA, name="dpo") as info:
        with torch.no_grad():
            first, second = m.hidden_states(ids), m.hidden_states(ids)
        assert "cuda_graphs_fallback" not in info
        assert info["cuda_graphs_reference_fallback"].startswith("capture failed: "), info
        m.hidden_states(ids)                                       # with gradients: the training graph's capture
    assert info["cuda_graphs_fallback"].startswith("capture failed: "), info
    assert "dpo.cuda_graphs_reference: running eager: capture failed" in caplog.text
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
