"""The fused (Triton) path and the reference path train the same: per-stage losses over a few steps.

Runs the Triton kernels under the interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1).
"""
import itertools

import pytest
import torch

from glm_lora.kernels import ops as kernels
from glm_lora.configs.schema import TrainConfig
from glm_lora.data.packing import place
from glm_lora.engine.losses import PreferenceLoss
from glm_lora.model.heads import causal_lm_loss
from glm_lora.engine.trainer import Runtime, train
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from glm_lora.configs.schema import LoRAConfig

torch.set_num_threads(1)
CPU = Runtime(torch.device("cpu"), torch.float32)
VOCAB = 97


def model(seed=0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(DecoderConfig(vocab_size=VOCAB, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=80, max_seq_len=64))


def packed_batch(seed: int, docs: int, answer_only: bool, group_size: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows, row = [], []
    for i in range(docs):
        n = int(torch.randint(5, 14, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (n,), generator=g).numpy()
        labels = ids.copy()
        if answer_only:
            labels[: n // 2] = -100
        row.append((ids, labels))
        if len(row) == 2 * group_size:
            rows.append(row)
            row = []
    return place(rows, 64 if group_size == 2 else 32, group_size)


def run(backend: str, stage: str) -> list[float]:
    m = model()
    if stage == "pretrain":
        loss_fn, batches = causal_lm_loss, [packed_batch(s, 4, answer_only=False) for s in range(1)]
    else:
        inject_lora(m, LoRAConfig(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], r=4, alpha=8))
        if stage == "sft":
            loss_fn, batches = causal_lm_loss, [packed_batch(s, 4, answer_only=True) for s in range(1)]
        else:
            loss_fn, batches = PreferenceLoss(beta=0.5, nll_weight=1.0), [packed_batch(s, 4, True, 2) for s in range(1)]
    logs = []
    cfg = TrainConfig(max_steps=2, batch_size=4, seq_len=64, lr=3e-2, warmup_steps=0, log_every=1)
    with kernels.using(backend):
        train(m, loss_fn, lambda _: itertools.repeat(batches[0]), cfg, CPU, on_log=logs.append)
    return [r["loss"] for r in logs]


@pytest.mark.parametrize("stage", ["pretrain", "sft", "dpo"])
def test_fused_and_reference_losses_agree(stage):
    ref, fused = run("reference", stage), run("triton", stage)
    assert len(ref) == 2 and ref[-1] < ref[0]          # it learns, so later steps depend on earlier updates
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(ref), atol=1e-4, rtol=1e-4)


def test_triton_backend_really_dispatches_to_triton(monkeypatch):
    calls = []
    real = kernels._triton_op
    monkeypatch.setattr(kernels, "_triton_op", lambda name: calls.append(name) or real(name))
    m = model()
    inject_lora(m, LoRAConfig(target_modules=["q_proj", "down_proj"], r=4, alpha=8))
    # gate/up (plain linears here) run as one stacked GEMM on "triton", so SwiGLU reads its [gate | up] in place
    # the residual adds run inside the norms that read them (add_rms_norm); the first layer's input norm has none
    for backend, expected in (("triton", {"rms_norm", "add_rms_norm", "apply_rope", "swiglu_halves", "lora_linear",
                                          "linear_cross_entropy", "linear_token_logprobs"}),
                              ("auto", set())):      # CPU tensors: "auto" keeps the reference
        calls.clear()
        with kernels.using(backend), torch.no_grad():
            causal_lm_loss(m, packed_batch(0, 2, answer_only=True))
            PreferenceLoss(beta=0.1)(m, packed_batch(0, 4, True, 2))
        assert set(calls) == expected


def test_using_restores_the_previous_choice():
    def current():
        return kernels._BACKEND, kernels._ATTENTION
    before = current()
    with kernels.using("triton", "sdpa"):
        assert current() == ("triton", "sdpa")
        with pytest.raises(RuntimeError), kernels.using("reference"):
            assert current() == ("reference", "auto")
            raise RuntimeError("a failing step")
        assert current() == ("triton", "sdpa")
    assert current() == before
    with pytest.raises(ValueError, match="backend"), kernels.using("cuda"):
        pass
    with pytest.raises(ValueError, match="attention"), kernels.using("auto", "dense"):
        pass
    assert current() == before
