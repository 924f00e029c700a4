"""engine/: schedule, optimizer groups, losses (CE, DPO) and the one training loop."""
import copy
import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F

import glm_lora.engine.losses as losses
from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import TrainConfig
from glm_lora.engine.losses import PreferenceLoss
from glm_lora.model.heads import causal_lm_loss, group_logprobs
from glm_lora.engine.optim import build_optimizer, lr_at
from glm_lora.engine.trainer import NonFiniteLossError, Runtime, train, train_step
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from glm_lora.model.lora import lora_modules
from glm_lora.configs.schema import LoRAConfig

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

VOCAB = 67
CPU = Runtime(torch.device("cpu"), torch.float32)


def tiny(seed=0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(DecoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=48, max_seq_len=32))


def batch(B=4, T=10, seed=0, ignore_prefix=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (B, T), generator=g)
    labels = x.clone()
    labels[:, :ignore_prefix] = -100
    return {"input_ids": x, "labels": labels, "num_tokens": torch.tensor(B * T)}


def cfg(**kw) -> TrainConfig:
    base = dict(max_steps=5, batch_size=4, seq_len=16, lr=1e-2, warmup_steps=0, min_lr_ratio=1.0,
                weight_decay=0.0, grad_clip=0.0, log_every=1)
    return TrainConfig(**{**base, **kw})


# ---------------------------------------------------------------- schedule

def test_lr_warmup_is_linear_and_reaches_base():
    kw = dict(max_steps=100, warmup_steps=10, base_lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(4, **kw) == pytest.approx(0.5)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)       # cosine starts at base lr


def test_lr_cosine_endpoints_and_midpoint():
    kw = dict(max_steps=110, warmup_steps=10, base_lr=2.0, min_lr_ratio=0.1)
    assert lr_at(110, **kw) == pytest.approx(0.2)       # min_lr at max_steps
    assert lr_at(60, **kw) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))
    assert lr_at(500, **kw) == pytest.approx(0.2)       # clamps past the end
    after = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(after, after[1:]))


def test_lr_without_warmup_and_constant_ratio():
    assert lr_at(0, max_steps=10, warmup_steps=0, base_lr=3.0, min_lr_ratio=0.0) == pytest.approx(3.0)
    assert lr_at(10, max_steps=10, warmup_steps=0, base_lr=3.0, min_lr_ratio=0.0) == pytest.approx(0.0)
    assert lr_at(7, max_steps=10, warmup_steps=0, base_lr=3.0, min_lr_ratio=1.0) == pytest.approx(3.0)


# ---------------------------------------------------------------- optimizer

def test_build_optimizer_decays_only_matrices():
    m = tiny()
    m.lm_head.weight.requires_grad_(False)
    opt = build_optimizer(m, lr=1e-3, weight_decay=0.1)
    groups = {g["weight_decay"]: {id(p) for p in g["params"]} for g in opt.param_groups}
    trainable = [p for p in m.parameters() if p.requires_grad]
    assert groups[0.1] == {id(p) for p in trainable if p.ndim >= 2}
    assert groups[0.0] == {id(p) for p in trainable if p.ndim < 2}
    assert id(m.model.norm.weight) in groups[0.0]
    assert id(m.model.embed_tokens.weight) in groups[0.1]
    assert id(m.lm_head.weight) not in groups[0.1] | groups[0.0]
    assert all(g["betas"] == (0.9, 0.95) for g in opt.param_groups)


def test_weight_decay_moves_matrices_not_vectors():
    m = tiny()
    before = copy.deepcopy(m.state_dict())
    opt = build_optimizer(m, lr=0.1, weight_decay=0.5)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(m.model.norm.weight, before["model.norm.weight"], atol=0, rtol=0)
    torch.testing.assert_close(m.lm_head.weight, before["lm_head.weight"] * (1 - 0.1 * 0.5))


def test_build_optimizer_lora_only_and_none_trainable():
    m = tiny()
    inject_lora(m, LoRAConfig(target_modules=["q_proj"], r=2, alpha=2))
    opt = build_optimizer(m, lr=1e-3, weight_decay=0.1)
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == 4 and all(p.ndim == 2 for p in params)
    for p in m.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(m, lr=1e-3, weight_decay=0.0)


# ---------------------------------------------------------------- losses

def test_causal_lm_loss_equals_manual_shifted_ce_and_ignores_masked():
    m = tiny()
    b = batch(B=3, T=9, ignore_prefix=4)
    b["labels"][1, 6] = -100
    loss, metrics = causal_lm_loss(m, b)
    logits = m(b["input_ids"])
    manual = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, manual, atol=1e-6, rtol=1e-6)
    assert metrics["target_tokens"].item() == 3 * 5 - 1
    # labels[:, 0] is never a target (nothing predicts position 0), masked or not.
    b2 = {**b, "labels": b["labels"].clone()}
    b2["labels"][:, 0] = 5
    torch.testing.assert_close(causal_lm_loss(m, b2)[0], loss, atol=0, rtol=0)
    b3 = {**b, "labels": b["labels"].clone()}
    b3["labels"][0, 7] = (b3["labels"][0, 7] + 1) % VOCAB
    assert not torch.allclose(causal_lm_loss(m, b3)[0], loss)


def test_causal_lm_loss_all_ignored_is_zero_not_nan():
    m = tiny()
    b = batch(B=2, T=6, ignore_prefix=6)
    loss, metrics = causal_lm_loss(m, b)
    assert loss.item() == 0.0 and metrics["target_tokens"].item() == 0


def test_group_logprobs_matches_manual():
    m = tiny()
    b = batch(B=2, T=8, ignore_prefix=3)
    b["doc_ids"] = torch.tensor([[1] * 8, [2] * 8])
    b["group_docs"] = torch.tensor([[1], [2]])
    logp, counts = group_logprobs(m, b)
    logp, counts = logp[:, 0], counts[:, 0]
    lp = m(b["input_ids"]).log_softmax(-1)[:, :-1]
    labels = b["labels"][:, 1:]
    manual = torch.stack([sum(lp[r, t, labels[r, t]] for t in range(7) if labels[r, t] != -100) for r in range(2)])
    torch.testing.assert_close(logp, manual, atol=1e-5, rtol=1e-5)
    assert counts.tolist() == [5, 5]


def test_group_logprobs_on_packed_pairs_runs_the_head_on_the_answers_only_and_matches_each_document_alone(monkeypatch):
    """data.packing's rows (several pairs a row, `target_positions`): each answer's summed log-prob and token count
    equal the document's own forward; the lm_head sees the labelled rows only."""
    from glm_lora.data.packing import IGNORE, PackedBatches
    from tests.data.test_prompt_sharing import _pairs
    from tests.data.test_packing import ListSource
    pairs = _pairs(5, seed=3, vocab=VOCAB)
    b = next(PackedBatches(ListSource(pairs), iter(range(5)), rows=2, seq_len=48, group_size=2, lookahead=5))
    assert "target_positions" in b and b["doc_ids"].max() > 2           # several documents a row
    m = tiny()
    rows = []
    head = losses.kernels.linear_token_logprobs
    monkeypatch.setattr(losses.kernels, "linear_token_logprobs", lambda h, *a: rows.append(h.shape[0]) or head(h, *a))
    logp, counts = group_logprobs(m, b)
    assert rows == [len(b["target_positions"])] == [int((b["labels"][:, 1:] != IGNORE).sum())]
    for g, docs in enumerate(b["group_docs"].tolist()):
        for j, doc in enumerate(docs):                                  # the document alone, as the batch holds it
            ids, labels = b["input_ids"][b["doc_ids"] == doc], b["labels"][b["doc_ids"] == doc]
            assert any(ids.tolist() == list(p[0]) for p in pairs)
            lp = m(ids[None]).log_softmax(-1)[0, :-1].gather(-1, labels[1:].clamp(min=0)[:, None])[:, 0]
            answer = labels[1:] != IGNORE
            torch.testing.assert_close(logp[g, j], lp[answer].sum(), atol=1e-5, rtol=1e-5)
            assert counts[g, j] == answer.sum()


def pair_batch(seed=0):
    """2 pairs: rows 0-1 chosen, rows 2-3 rejected, sharing a 4-token prompt (ignored)."""
    b = batch(B=4, T=10, seed=seed, ignore_prefix=4)
    b["input_ids"][2:, :4] = b["input_ids"][:2, :4]
    b["labels"][2:, :4] = -100
    b["doc_ids"] = torch.arange(1, 5)[:, None].expand(4, 10).clone()   # one document per row
    b["group_docs"] = torch.tensor([[1, 3], [2, 4]])                   # (chosen, rejected) per pair
    return b


@pytest.mark.parametrize("nll_weight", [0.0, 0.7])
def test_dpo_at_init_margin_zero_loss_log2(nll_weight):
    m = tiny()
    inject_lora(m, LoRAConfig(target_modules=["q_proj", "v_proj", "up_proj"], r=4, alpha=8))     # B = 0: policy == reference
    b = pair_batch()
    loss, metrics = PreferenceLoss(beta=0.1, nll_weight=nll_weight)(m, b)
    assert metrics["reward_margin"].item() == pytest.approx(0.0, abs=1e-6)
    assert metrics["preference_accuracy"].item() == 0.0
    chosen = {k: (v[:2] if v.ndim else v) for k, v in b.items() if k != "group_docs"}
    nll = causal_lm_loss(m, chosen)[0].item()
    assert loss.item() == pytest.approx(math.log(2) + nll_weight * nll, rel=1e-5)


def test_dpo_matches_manual_formula_on_hand_built_logprobs(monkeypatch):
    """Reference log-probs must be taken with the adapter off; numbers checked by hand."""
    m = tiny()
    inject_lora(m, LoRAConfig(target_modules=["q_proj"], r=2, alpha=2))
    policy = torch.tensor([-3.0, -5.0, -4.0, -2.0], requires_grad=True)   # chosen 0,1 | rejected 2,3
    ref = torch.tensor([-3.5, -4.0, -3.0, -2.5])
    counts = torch.tensor([3, 5, 4, 2])
    calls = []

    def fake(model, b):
        enabled = {mod.enabled for mod in lora_modules(model).values()}
        assert len(enabled) == 1
        calls.append(enabled.pop())
        grouped = (policy if calls[-1] else ref).view(2, 2).t()      # [[c0, r0], [c1, r1]]
        return grouped, counts.view(2, 2).t()
    monkeypatch.setattr(losses, "group_logprobs", fake)

    beta, w = 0.5, 0.25
    loss, metrics = PreferenceLoss(beta, w)(m, pair_batch())
    assert calls == [True, False]                    # policy with adapter, reference without
    assert all(mod.enabled for mod in lora_modules(m).values())
    # margins: pair 0: 0.5*((-3+3.5) - (-4+3)) = 0.75; pair 1: 0.5*((-5+4) - (-2+2.5)) = -0.75
    expected_dpo = (-math.log(1 / (1 + math.exp(-0.75))) - math.log(1 / (1 + math.exp(0.75)))) / 2
    expected = expected_dpo + w * (3.0 + 5.0) / (3 + 5)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["reward_margin"].item() == pytest.approx(0.0, abs=1e-7)
    assert metrics["preference_accuracy"].item() == 0.5
    assert metrics["chosen_reward"].item() == pytest.approx(0.5 * (0.5 - 1.0) / 2)
    assert metrics["rejected_reward"].item() == pytest.approx(0.5 * (-1.0 + 0.5) / 2)
    loss.backward()
    s0, s1 = torch.sigmoid(torch.tensor(-0.75)).item(), torch.sigmoid(torch.tensor(0.75)).item()
    # d/dpolicy of -logsig(margin)/2 = -beta*sig(-margin)/2 * (+1 chosen, -1 rejected); nll: -w/8 on chosen
    expected_grad = [-beta * s0 / 2 - w / 8, -beta * s1 / 2 - w / 8, beta * s0 / 2, beta * s1 / 2]
    torch.testing.assert_close(policy.grad, torch.tensor(expected_grad), atol=1e-6, rtol=1e-6)


def test_dpo_reference_is_the_base_weights_of_the_same_model():
    m = tiny()
    base = copy.deepcopy(m).eval()
    inject_lora(m, LoRAConfig(target_modules=["q_proj", "k_proj", "gate_proj", "down_proj"], r=4, alpha=8))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in lora_modules(m).values():
            mod.lora_B.weight.copy_(torch.randn(mod.lora_B.weight.shape, generator=g) * 0.3)
    b = pair_batch()
    beta = 0.3
    loss, metrics = PreferenceLoss(beta)(m, b)
    pol, _ = group_logprobs(m, b)
    with torch.no_grad():
        ref, _ = group_logprobs(base, b)
    margin = beta * ((pol[:, 0] - ref[:, 0]) - (pol[:, 1] - ref[:, 1]))
    torch.testing.assert_close(loss, -F.logsigmoid(margin).mean(), atol=1e-6, rtol=1e-5)
    assert abs(metrics["reward_margin"].item()) > 1e-3
    loss.backward()     # reference is under no_grad: only the adapter gets gradients, base none
    assert all(p.grad is None for n, p in m.named_parameters() if "lora_" not in n)
    assert all(p.grad is not None for n, p in m.named_parameters() if "lora_" in n)


# ---------------------------------------------------------------- training loop

def test_runtime_resolve(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    rt = Runtime.resolve("auto", "auto")
    assert rt.device.type == "cpu" and rt.dtype == torch.float32
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)  # bf16 dot products (Zen 4)
    assert Runtime.resolve("auto", "auto").dtype == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)     # bf16 matmuls in AMX tiles
    assert Runtime.resolve("auto", "auto").dtype == torch.bfloat16
    assert Runtime.resolve("cpu", "fp32").dtype == torch.float32
    assert Runtime.resolve("cpu", "bf16").dtype == torch.bfloat16
    with pytest.raises(UserError, match="device=cuda"):
        Runtime.resolve("cuda", "auto")


def test_train_overfits_a_fixed_batch(tmp_path):
    m = tiny()
    b = batch(B=4, T=12)
    logs = []
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:     # as the stages keep metrics.jsonl
        def on_log(summary):
            print(json.dumps(summary), file=f, flush=True)
            logs.append(summary)
        summary = train(m, causal_lm_loss, lambda _: itertools.repeat(b), cfg(max_steps=30, lr=1e-2, warmup_steps=3,
                        min_lr_ratio=0.1, grad_clip=1.0, log_every=1), CPU, on_log=on_log)
    losses_ = [r["loss"] for r in logs]
    assert len(losses_) == 30
    assert losses_[0] == pytest.approx(math.log(VOCAB), rel=0.05)       # ~uniform at init
    assert losses_[-1] < 0.5 * losses_[0]
    assert summary["step"] == 30 and summary["tokens"] == 30 * 48
    assert summary["lr"] == pytest.approx(lr_at(29, max_steps=30, warmup_steps=3, base_lr=1e-2, min_lr_ratio=0.1))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert rows[-1]["loss"] == pytest.approx(losses_[-1])
    assert m.training


def test_a_run_lowered_below_its_checkpoint_is_refused_and_a_raised_one_resumes(tmp_path):
    """max_steps is not part of a stage's checkpoint directory (a raised max_steps continues the run), so a shorter
    run finds the longer run's checkpoint: resuming it would stop at once and pass the longer run's weights on as
    the shorter run's. It is refused before any step, naming the step, max_steps and the directory to delete."""
    from glm_lora.configs.schema import CheckpointConfig
    from glm_lora.engine.checkpoint import Checkpointer, IncompatibleResumeError

    def run(max_steps):
        m = tiny()
        ckpt = Checkpointer(tmp_path, CheckpointConfig(save_every=2, async_save=False), name="sft")
        steps = []
        train(m, causal_lm_loss, lambda _: itertools.repeat(batch()), cfg(max_steps=max_steps), CPU,
              checkpointer=ckpt, on_log=lambda s: steps.append(s["step"]))
        return steps

    assert run(6) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(IncompatibleResumeError, match=r"step 6, past max_steps 4 \(a 6-step run made it\)") as e:
        run(4)
    assert str(tmp_path) in str(e.value)
    assert run(6) == [] and run(8) == [7, 8]            # finished: nothing to do; raised: continues


def test_train_logs_window_means():
    m = tiny()
    logs = []
    train(m, causal_lm_loss, lambda _: itertools.repeat(batch()), cfg(max_steps=5, log_every=2), CPU, on_log=logs.append)
    assert [r["step"] for r in logs] == [2, 4, 5]
    assert logs[0]["tokens"] == 2 * 40 and logs[-1]["tokens"] == 5 * 40


def test_train_lora_dpo_learns_preference_and_keeps_base():
    m = tiny()
    base_sd = {k: v.clone() for k, v in m.state_dict().items()}
    inject_lora(m, LoRAConfig(target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], r=4, alpha=8))
    logs = []
    train(m, PreferenceLoss(beta=0.5), lambda _: itertools.repeat(pair_batch()), cfg(max_steps=15, lr=2e-2), CPU,
          on_log=logs.append)
    assert logs[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert logs[-1]["loss"] < 0.5 * math.log(2)
    assert logs[-1]["preference_accuracy"] == 1.0 and logs[-1]["reward_margin"] > 0
    sd = m.state_dict()
    for k, v in base_sd.items():
        torch.testing.assert_close(sd[k], v, atol=0, rtol=0)


def test_nan_loss_raises_naming_step_and_micro_batch():
    m = tiny()
    calls = {"n": 0}

    def loss_fn(model, b):
        calls["n"] += 1
        loss, metrics = causal_lm_loss(model, b)
        return (loss * float("nan") if calls["n"] == 6 else loss), metrics
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 2, micro-batch 1\b.*lr \(now 0.01\)"):
        train(m, loss_fn, lambda _: itertools.repeat(batch(B=2)), cfg(max_steps=5, grad_accum=2), CPU)
    assert calls["n"] == 6


def test_huge_lr_diverges_into_non_finite_loss_error():
    m = tiny()
    with pytest.raises(NonFiniteLossError, match=r"at step \d+, micro-batch 0"):
        train(m, causal_lm_loss, lambda _: itertools.repeat(batch()), cfg(max_steps=50, lr=1e10), CPU)


def test_grad_accum_matches_full_batch():
    full = [batch(B=4, T=10, seed=s) for s in range(3)]
    halves = [{"input_ids": b["input_ids"][i:i + 2], "labels": b["labels"][i:i + 2], "num_tokens": torch.tensor(20)}
              for b in full for i in (0, 2)]
    # clipping active and decay on: both must act on the accumulated gradient, not per micro-batch
    common = dict(max_steps=3, lr=1e-2, weight_decay=0.1, grad_clip=0.05, warmup_steps=1, min_lr_ratio=0.5)
    a, b = tiny(seed=4), tiny(seed=4)
    la, lb = [], []
    train(a, causal_lm_loss, lambda _: iter(full), cfg(**common, batch_size=4, grad_accum=1), CPU, on_log=la.append)
    train(b, causal_lm_loss, lambda _: iter(halves), cfg(**common, batch_size=2, grad_accum=2), CPU, on_log=lb.append)
    for ra, rb in zip(la, lb, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)   # Adam hides grad scale; this doesn't
        assert rb["tokens"] == ra["tokens"]
    assert la[0]["grad_norm"] > 0.05        # so clipping really happened
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-5, rtol=1e-4, msg=na)
    assert not torch.allclose(a.lm_head.weight, tiny(seed=4).lm_head.weight)


def test_lora_plus_trains_b_with_a_larger_learning_rate():
    m = tiny()
    inject_lora(m, LoRAConfig(target_modules=["q_proj", "v_proj"], r=4, alpha=8))
    opt = build_optimizer(m, 1e-3, 0.1, lora_b_lr_ratio=16.0)
    names = {id(p): n for n, p in m.named_parameters()}
    c = cfg(max_steps=10, lr=1e-3, warmup_steps=0, min_lr_ratio=1.0)
    train_step(m, causal_lm_loss, itertools.repeat(batch()), opt, torch.amp.GradScaler("cpu", enabled=False),
               [p for p in m.parameters() if p.requires_grad], c, CPU, step=0)
    for g in opt.param_groups:                           # the loop applied each group's scale
        kinds = {names[id(p)].rsplit(".", 2)[-2] for p in g["params"]}
        assert (kinds, g["lr"]) == (({"lora_B"}, 16e-3) if g["lr_scale"] == 16.0 else ({"lora_A"}, 1e-3))
    assert {g["lr_scale"] for g in build_optimizer(m, 1e-3, 0.0).param_groups} == {1.0}
