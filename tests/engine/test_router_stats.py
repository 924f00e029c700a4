"""Router health of a mixture-of-experts model in training: per-step token shares, idle experts named per
window, the optional balance loss (DeepSeek-V3's, checked by hand), and the UI's table and heat map."""
import logging

import pytest
import torch

from glm_lora.configs.schema import LoRAConfig
from glm_lora.engine.router_stats import RouterHealth, balance_loss
from glm_lora.model import inject_lora
from glm_lora.tasks.report import router_heatmap, router_rows
from tests.model.test_moe_lora import ids, moe_model


def plain_loss(model, batch):
    return model(batch).float().pow(2).mean(), {}


def test_shares_idle_experts_and_summary(caplog):
    m = moe_model()
    with torch.no_grad():
        m.model.layers[2].mlp.gate.e_score_correction_bias[3] = -50.0      # expert 3 of layer 2 is never chosen
    inject_lora(m, LoRAConfig(target_modules=["q_proj"], r=2, alpha=2))
    health = RouterHealth(m, stage="sft")
    loss_fn = health.wrap(plain_loss)
    m.train()
    _, metrics = loss_fn(m, ids(B=4, T=16))
    assert float(metrics["router_min_share"]) == 0 and 1 / 6 <= float(metrics["router_max_share"]) <= 1   # expert 3
    m.eval()
    _, quiet = loss_fn(m, ids())                    # not a training forward: no routing metrics, no counts
    assert "router_max_share" not in quiet
    with caplog.at_level(logging.WARNING, logger="glm_lora.router"):
        window = health.end_window()
    assert window["router_idle_experts"] >= 1
    assert "model.layers.2.mlp.gate expert 3" in caplog.text
    summary = health.summary()
    assert summary["layers"] == ["model.layers.1", "model.layers.2"]
    assert summary["token_share"][1][3] == 0 and summary["idle_experts"] >= 1
    assert all(abs(sum(row) - 1) < 1e-6 for row in summary["token_share"])
    rows = router_rows(summary)
    assert rows[1]["idle_experts"] >= 1 and rows[1]["min_share"] == "0"


def test_balance_loss_by_hand_and_its_gradient_reaches_the_adapter():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.5], [0.2, 0.8, 0.5, 0.5]])
    experts = torch.tensor([[0, 2], [1, 2]])
    f = torch.tensor([1, 1, 2, 0]) / 4                                   # routed slots per expert / all slots
    p = (scores / scores.sum(1, keepdim=True)).mean(0)
    assert torch.allclose(balance_loss(scores, experts), 4 * (f * p).sum())

    m = moe_model(seed=4)
    inject_lora(m, LoRAConfig(target_modules=["q_proj"], r=2, alpha=2))
    with torch.no_grad():
        for n, prm in m.named_parameters():
            if "lora_B" in n:
                prm.normal_(0, 0.2)
    m.train()
    x = ids(B=3, T=10)
    base, _ = RouterHealth(m).wrap(plain_loss)(m, x)
    loss, metrics = RouterHealth(m, aux_weight=0.5).wrap(plain_loss)(m, x)
    assert torch.allclose(loss, base + 0.5 * metrics["router_aux_loss"], atol=1e-6)
    loss.backward()
    assert m.model.layers[1].self_attn.q_proj.lora_A.weight.grad.abs().sum() > 0
    assert m.model.layers[1].mlp.gate.weight.grad is None                 # the router itself stays frozen


def test_the_heat_map_is_drawn(tmp_path):
    png = router_heatmap("sft", {"layers": ["model.layers.1", "model.layers.2"],
                                 "token_share": [[0.25, 0.25, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4]]}, tmp_path / "x.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_dense_model_has_no_router_health():
    from glm_lora.model import Decoder, DecoderConfig
    assert not RouterHealth(Decoder(DecoderConfig(vocab_size=10, hidden_size=16, num_layers=1, num_heads=2,
                                                  num_kv_heads=1, intermediate_size=8)))
