"""The preference stage's losses (dpo.loss): each formula against a case computed by hand, against TRL's own
implementation on the same log-probs (CPOTrainer.cpo_loss covers sigmoid-DPO on log-ratios, IPO and SimPO;
ORPOTrainer.odds_ratio_loss covers ORPO), and through the model: SimPO and ORPO never run the reference forward."""
import math
from types import SimpleNamespace

import pytest
import torch

from glm_lora.engine.losses import PAIRED, PreferenceLoss, kto_loss


PC, PR = torch.tensor([-4.0, -9.0, -2.5]), torch.tensor([-6.0, -7.0, -8.0])      # summed answer log-probs
RC, RR = torch.tensor([-5.0, -8.5, -3.0]), torch.tensor([-5.5, -7.5, -6.0])
NC, NR = torch.tensor([4.0, 6.0, 2.0]), torch.tensor([3.0, 5.0, 4.0])             # answer token counts


def test_each_formula_by_hand():
    beta = 0.5
    loss, m = PAIRED["dpo"](PC, PR, RC, RR, NC, NR, beta=beta)
    margin0 = beta * ((-4 + 5) - (-6 + 5.5))                                      # 0.5 · (1 + 0.5) = 0.75
    assert m[0].item() == pytest.approx(margin0) and loss[0].item() == pytest.approx(math.log1p(math.exp(-margin0)))
    loss, h = PAIRED["ipo"](PC, PR, RC, RR, NC, NR, beta=beta)
    h0 = (1 / 4) - (-0.5 / 3)
    assert h[0].item() == pytest.approx(h0) and loss[0].item() == pytest.approx((h0 - 1.0) ** 2)
    loss, m = PAIRED["simpo"](PC, PR, None, None, NC, NR, beta=2.0, gamma=0.5)
    m0 = 2.0 * (-4 / 4 - -6 / 3) - 0.5                                            # 2 · (−1 + 2) − 0.5 = 1.5
    assert m[0].item() == pytest.approx(m0) and loss[0].item() == pytest.approx(math.log1p(math.exp(-m0)))
    loss, lo = PAIRED["orpo"](PC, PR, None, None, NC, NR, orpo_lambda=0.2)
    ac, ar = -1.0, -2.0
    lo0 = (ac - ar) - (math.log(1 - math.exp(ac)) - math.log(1 - math.exp(ar)))
    assert lo[0].item() == pytest.approx(lo0) and loss[0].item() == pytest.approx(0.2 * math.log1p(math.exp(-lo0)))
    desirable = torch.tensor([True, False, True])
    per, r, z0 = kto_loss(PC, RC, PR, RR, desirable, beta=0.1, desirable_weight=1.0, undesirable_weight=2.0)
    z = max(0.0, float((PR - RR).mean()))
    assert z0.item() == pytest.approx(z)
    assert per[0].item() == pytest.approx(1 - 1 / (1 + math.exp(-0.1 * (1.0 - z))))
    assert per[1].item() == pytest.approx(2.0 * (1 - 1 / (1 + math.exp(-0.1 * (z - -0.5)))))


def _trl(cls_path: str):
    pytest.importorskip("trl")
    module, name = cls_path.rsplit(".", 1)
    return getattr(__import__(module, fromlist=[name]), name)


@pytest.mark.parametrize("kind, trl_type", [("dpo", "sigmoid"), ("ipo", "ipo"), ("simpo", "simpo")])
def test_against_trl_cpo_loss(kind, trl_type):
    CPOTrainer = _trl("trl.experimental.cpo.cpo_trainer.CPOTrainer")
    beta, gamma = (2.0, 0.7) if kind == "simpo" else (0.3, 0.0)
    me = SimpleNamespace(alpha=0.0, loss_type=trl_type, beta=beta, simpo_gamma=gamma, label_smoothing=0.0,
                         accelerator=SimpleNamespace(device="cpu"))
    if kind == "dpo":            # TRL's sigmoid on the log-ratios is DPO
        chosen, rejected = PC - RC, PR - RR
    elif kind == "ipo":          # on length-averaged log-ratios, as TRL's DPOTrainer does for IPO
        chosen, rejected = (PC - RC) / NC, (PR - RR) / NR
    else:                        # SimPO: length-averaged policy log-probs
        chosen, rejected = PC / NC, PR / NR
    theirs = CPOTrainer.cpo_loss(me, chosen, rejected)[0]
    ours, _ = PAIRED[kind](PC, PR, RC, RR, NC, NR, beta=beta, gamma=gamma)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


def test_against_trl_orpo():
    ORPOTrainer = _trl("trl.experimental.orpo.orpo_trainer.ORPOTrainer")
    me = SimpleNamespace(beta=0.25, accelerator=SimpleNamespace(device="cpu"))
    theirs = ORPOTrainer.odds_ratio_loss(me, PC / NC, PR / NR)[0]           # β · log σ(log odds): TRL subtracts it
    ours, _ = PAIRED["orpo"](PC, PR, None, None, NC, NR, orpo_lambda=0.25)
    torch.testing.assert_close(ours, -theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["dpo", "ipo", "simpo", "orpo"])
def test_reference_forward_only_where_the_loss_has_a_reference(kind, monkeypatch):
    from tests.engine.test_engine import pair_batch, tiny
    from glm_lora.configs.schema import LoRAConfig
    from glm_lora.model import inject_lora
    import glm_lora.engine.losses as losses

    m = tiny()
    inject_lora(m, LoRAConfig(target_modules=["q_proj", "v_proj"], r=4, alpha=8))
    calls = []
    real = losses.lora_disabled

    def counted(model):
        calls.append(1)
        return real(model)
    monkeypatch.setattr(losses, "lora_disabled", counted)
    loss, metrics = PreferenceLoss(beta=0.5, nll_weight=0.0, kind=kind)(m, pair_batch())
    loss.backward()
    assert len(calls) == (0 if kind in ("simpo", "orpo") else 1)
    assert torch.isfinite(loss) and 0.0 <= float(metrics["preference_accuracy"]) <= 1.0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in m.named_parameters() if "lora_" in n)

