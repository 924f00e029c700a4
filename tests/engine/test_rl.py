"""The RL stage (GRPO): advantages and the clipped-ratio loss by hand, sampling, rewards (built-in, a user's module,
and the errors a bad one gives), the rollout batches, and the stage itself: it trains, resumes to the same answers,
and a failing reward stops it with its name and prompt while the last checkpoint stays."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from glm_lora.artifacts.manifest import write_manifest
from glm_lora.configs.load import load_config
from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import Config, LoRAConfig
from glm_lora.data.prepare import prepare_data
from glm_lora.data.tokenizer import end_of_turn_ids, load_tokenizer, train_tokenizer
from glm_lora.engine import rewards
from glm_lora.evaluation.decode import greedy_decode, sample_decode
from glm_lora.engine.losses import GRPOLoss, grpo_token_loss
from glm_lora.engine.rollouts import Rollouts, group_advantages
from glm_lora.engine.trainer import Runtime
from glm_lora.data.packing import IGNORE
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from glm_lora.model.hf import save_native

torch.set_num_threads(1)


# ---------------------------------------------------------------- formulas by hand

def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 3.0]])
    a = group_advantages(r)
    std = math.sqrt(4 * 0.25 / 3)                                  # mean 0.5, sample std (n − 1)
    assert torch.allclose(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4))
    assert torch.equal(a[1], torch.zeros(4))                                               # nothing to learn
    std = math.sqrt((0.75 ** 2 * 3 + 2.25 ** 2) / 3)
    assert a[2, 3].item() == pytest.approx(2.25 / (std + 1e-4)) and a[2].sum().item() == pytest.approx(0, abs=1e-5)


def test_grpo_token_loss_clips_the_ratio_and_adds_k3_kl_by_hand():
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    old = torch.tensor([-1.5, -0.5, -1.5, -0.5])            # ratios e^0.5 = 1.65, e^-0.5 = 0.61
    adv = torch.tensor([2.0, 2.0, -1.0, -1.0])
    ref = torch.tensor([-1.2, -0.8, -1.0, -2.0])
    loss, kl = grpo_token_loss(logp, old, adv, clip_epsilon=0.2, ref_logp=ref, kl_beta=0.1)
    hi, lo = math.exp(0.5), math.exp(-0.5)
    surrogate = [min(hi * 2, 1.2 * 2), min(lo * 2, 0.8 * 2), min(hi * -1, 1.2 * -1), min(lo * -1, 0.8 * -1)]
    k3 = [math.exp(d) - d - 1 for d in (-0.2, 0.2, 0.0, -1.0)]
    assert kl.tolist() == pytest.approx(k3, rel=1e-5)
    assert loss.tolist() == pytest.approx([-s + 0.1 * k for s, k in zip(surrogate, k3)], rel=1e-5)


def test_one_update_per_rollout_is_the_policy_gradient():
    """π_old = π detached: ρ = 1, loss value −A per token, d loss / d log π = −A (clipping never bites)."""
    logp = torch.tensor([-0.7, -2.0, -0.1], requires_grad=True)
    adv = torch.tensor([1.5, -0.5, 0.0])
    loss, _ = grpo_token_loss(logp, logp.detach(), adv, clip_epsilon=0.2)
    loss.sum().backward()
    assert loss.tolist() == pytest.approx((-adv).tolist()) and logp.grad.tolist() == pytest.approx((-adv).tolist())


def _decoder(vocab: int, seed: int = 0, max_seq_len: int = 64) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(DecoderConfig(vocab_size=vocab, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=64, max_seq_len=max_seq_len))


def _rl_batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (4, 12), generator=g)
    labels = torch.full_like(ids, IGNORE)
    for r, (start, end) in enumerate([(5, 12), (5, 7), (8, 12), (6, 9)]):     # answers of 7, 2, 4 and 3 tokens
        labels[r, start:end] = ids[r, start:end]
    return {"input_ids": ids, "labels": labels, "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
            "rollout_reward_mean": torch.tensor(0.25)}


def test_grpo_loss_on_a_model_averages_per_answer_or_per_token():
    model = _decoder(50)
    inject_lora(model, LoRAConfig(r=4))
    batch = _rl_batch(50)
    per_answer, m = GRPOLoss(loss_type="grpo")(model, batch)
    per_token, _ = GRPOLoss(loss_type="token")(model, batch)
    n = torch.tensor([7.0, 2.0, 4.0, 3.0])
    adv = batch["advantages"]
    assert per_answer.item() == pytest.approx(float((-adv).mean()), abs=1e-6)     # ρ = 1: each answer's mean is −A
    assert per_token.item() == pytest.approx(float((-adv * n).sum() / n.sum()), abs=1e-6)
    assert m["reward_mean"].item() == 0.25 and m["kl"].item() == 0.0
    with_kl, m = GRPOLoss(kl_beta=0.5)(model, batch)
    assert m["kl"].item() == pytest.approx(0.0, abs=1e-7)       # a fresh adapter (B = 0) is the reference
    with torch.no_grad():                                        # move the adapter: KL > 0 and enters the loss
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    with_kl, m = GRPOLoss(kl_beta=0.5)(model, batch)
    without, _ = GRPOLoss(kl_beta=0.0)(model, batch)
    assert m["kl"].item() > 1e-3
    assert with_kl.item() == pytest.approx(without.item() + 0.5 * m["kl"].item(), rel=0.3)


def test_grpo_log_probs_are_those_of_the_sampling_temperature():
    """logits / T, as sampling drew them (and TRL computes them): the loss's gradient equals a pure-torch
    log_softmax(logits / T) policy gradient's."""
    model = _decoder(50)
    inject_lora(model, LoRAConfig(r=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)
    batch = {**_rl_batch(50), "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])}
    lora = [p for n, p in model.named_parameters() if "lora_" in n]

    def grads(loss):
        return [g.clone() for g in torch.autograd.grad(loss, lora)]
    for T in (0.7, 1.0, 1.6):
        ours, _ = GRPOLoss(temperature=T)(model, batch)
        logits = model(batch["input_ids"])[:, :-1].float() / T
        labels = batch["labels"][:, 1:]
        mask = labels != IGNORE
        logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        ref = ((-(logp - logp.detach()).exp() * batch["advantages"][:, None]) * mask).sum(1) / mask.sum(1)
        for a, b in zip(grads(ours), grads(ref.mean())):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    g07, g16 = grads(GRPOLoss(temperature=0.7)(model, batch)[0]), grads(GRPOLoss(temperature=1.6)(model, batch)[0])
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(g07, g16))
    with pytest.raises(ValueError, match="temperature"):
        GRPOLoss(temperature=0.0)


# ---------------------------------------------------------------- sampling

def test_sampling_is_reproducible_and_near_zero_temperature_is_greedy():
    model = _decoder(40).eval()
    prompts = [[1, 5, 7], [2, 9, 11, 13, 4], [3]]
    with torch.no_grad():
        greedy = greedy_decode(model, prompts, max_new_tokens=6, eos_id=None)
        cold = sample_decode(model, prompts, max_new_tokens=6, eos_id=None, temperature=1e-4,
                             generator=torch.Generator().manual_seed(1))
        a = sample_decode(model, prompts * 4, max_new_tokens=6, eos_id=None, temperature=1.0,
                          generator=torch.Generator().manual_seed(7))
        b = sample_decode(model, prompts * 4, max_new_tokens=6, eos_id=None, temperature=1.0,
                          generator=torch.Generator().manual_seed(7))
        c = sample_decode(model, prompts * 4, max_new_tokens=6, eos_id=None, temperature=1.0,
                          generator=torch.Generator().manual_seed(8))
    assert cold == greedy
    assert a == b and a != c
    assert len({tuple(x) for x in a[::3]}) > 1          # the same prompt, four different answers
    with pytest.raises(ValueError, match="longer than"):
        sample_decode(model, [[1] * 60], max_new_tokens=8, eos_id=None, temperature=1.0,
                      generator=torch.Generator())


# ---------------------------------------------------------------- rewards

def test_builtin_rewards():
    assert rewards.exact_match(" 19 ", reference="19", task="add_en") == 1.0
    assert rewards.exact_match("18", reference="19", task="add_en") == 0.0
    assert rewards.format("19", finished=True) == 1.0
    assert rewards.format("19", finished=False) == 0.0 and rewards.format("1\n9", finished=True) == 0.0


def test_a_users_reward_module_and_the_errors_a_bad_reward_gives(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def short(completion, **kw):\n    return 1.0 if len(completion) < 4 else 0.0\n"
        "def boom(completion, **kw):\n    raise KeyError('no such field')\n"
        "def text(completion, **kw):\n    return 'yes'\n"
        "def nan(completion, **kw):\n    return float('nan')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fns = rewards.resolve(["exact_match", "my_rewards:short"])
    prompt = [{"role": "user", "content": "What is 12 + 7?"}]
    assert rewards.score(fns, "19", reference="19", prompt=prompt, task="add_en", finished=True) == {
        "exact_match": 1.0, "my_rewards:short": 1.0}
    for name, what in (("boom", "raised KeyError"), ("text", "returned 'yes'"), ("nan", "returned nan")):
        with pytest.raises(rewards.RewardError) as e:
            rewards.score(rewards.resolve([f"my_rewards:{name}"]), "19", reference="19", prompt=prompt,
                          task="add_en", finished=True)
        assert f"reward 'my_rewards:{name}' on prompt 'What is 12 + 7?'" in str(e.value) and what in str(e.value)
    for bad, msg in (("exact", "neither a built-in"), ("no_module_here:f", "cannot import module"),
                     ("my_rewards:missing", "has no 'missing'")):
        with pytest.raises(UserError, match=msg):
            rewards.resolve([bad])


# ---------------------------------------------------------------- rollouts and the stage

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny run's inputs to the RL stage: data, tokenizer, a random base and (empty) SFT / DPO adapters."""
    from glm_lora.model.adapters import save_adapter
    d = tmp_path_factory.mktemp("rl-run")
    cfg = _cfg(d)
    prepare_data(cfg.data, d / "data")
    from glm_lora.data.prepare import split_path
    tok_dir = train_tokenizer([split_path(d / "data", "pretrain")], d / "tokenizer", vocab_size=700)
    tok = load_tokenizer(tok_dir)
    model = _decoder(len(tok), max_seq_len=128)
    save_native(model, d / "pretrain")
    for stage in ("sft", "dpo"):
        m = _decoder(len(tok), max_seq_len=128)
        inject_lora(m, LoRAConfig(r=2))
        (d / stage).mkdir()
        save_adapter(m, LoRAConfig(r=2), d / stage)
    for stage in ("data", "tokenizer", "pretrain", "sft", "dpo"):
        write_manifest(d / stage, stage)
    return d


def _cfg(d: Path, **over) -> Config:
    return load_config("tiny", {"runs_dir": str(d / "runs"), "serve.enabled": False, "eval.enabled": False,
                                "data.synthetic.n_pretrain": 200, "data.synthetic.n_sft": 60,
                                "data.synthetic.n_dpo": 10, "data.synthetic.n_eval": 20, "rl.batch_size": 3,
                                "rl.group_size": 4, "rl.max_new_tokens": 6, "rl.seq_len": 96, "rl.log_every": 1,
                                "checkpoint.save_every": 2, "rl.rewards": ["exact_match", "format"], **over})


def _inputs(d: Path) -> dict[str, Path]:
    return {"base": d / "pretrain", "sft": d / "sft", "dpo": d / "dpo", "tokenizer": d / "tokenizer", "data": d / "data"}


def test_rollout_batches_label_the_answers_and_normalise_each_group(run_dir):
    cfg = _cfg(run_dir, **{"rl.families": ["add_en", "sub_en"]})
    tok = load_tokenizer(run_dir / "tokenizer")
    model = _decoder(len(tok), max_seq_len=128)
    source = Rollouts(cfg, tok, run_dir / "data", model, Runtime(torch.device("cpu"), torch.float32))
    assert {r["task"] for r in source.rows} == {"add_en", "sub_en"}
    make, summary = source.batches("rl", cfg.rl)
    batch = next(make(None))
    assert batch["input_ids"].shape[0] == 3 * 4 and batch["data_state"] == {"cursor": 3}
    stop = set(end_of_turn_ids(tok))
    for r in range(12):
        answer = batch["labels"][r][batch["labels"][r] != IGNORE].tolist()
        first = int((batch["labels"][r] != IGNORE).nonzero()[0])
        assert batch["input_ids"][r, first:first + len(answer)].tolist() == answer
        assert 1 <= len(answer) <= 6 and all(t not in stop for t in answer[:-1])
    assert batch["advantages"].view(3, 4).sum(1).abs().max() < 1e-4
    again = next(make({"cursor": 0}))                    # resumed at the same cursor: the same answers
    assert torch.equal(again["input_ids"], batch["input_ids"])
    from glm_lora.evaluation.decode import prompt_ids          # one apply_chat_template per prompt: the same ids
    assert [r["ids"] for r in source.rows] == [prompt_ids(tok, r["prompt"]) for r in source.rows]
    with pytest.raises(UserError, match=r"rl.families \['nope'\] match no row of .*sft.jsonl"):
        Rollouts(_cfg(run_dir, **{"rl.families": ["nope"]}), tok, run_dir / "data", model,
                 Runtime(torch.device("cpu"), torch.float32))


@pytest.mark.parametrize("loss_type", ["grpo", "token"])
def test_a_rollout_trained_in_chunks_takes_the_same_step(run_dir, loss_type):
    """rl.train_chunks: the rollout's answers as equal micro-batches, each trimmed to its longest row, losses
    accumulated as train_step does (1/k each) — the same gradient as the whole rollout at once, for both losses."""
    from glm_lora.engine.rollouts import chunks
    cfg = _cfg(run_dir, **{"rl.loss_type": loss_type, "rl.kl_beta": 0.1})
    tok = load_tokenizer(run_dir / "tokenizer")
    model = _decoder(len(tok), max_seq_len=128)
    inject_lora(model, LoRAConfig(r=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)
    batch = next(Rollouts(cfg, tok, run_dir / "data", model, Runtime(torch.device("cpu"), torch.float32))
                 .batches("rl", cfg.rl)[0](None))
    loss = GRPOLoss.of(cfg.rl)

    def grads(parts):
        model.zero_grad(set_to_none=True)
        for part in parts:
            (loss(model, part)[0] / len(parts)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    whole = grads([batch])
    for k in (2, 3, 4):
        parts = list(chunks(batch, k))
        assert len(parts) == k and sum(p["num_tokens"] for p in parts) == batch["num_tokens"]
        assert all(p["data_state"] == batch["data_state"] for p in parts)
        assert max(p["input_ids"].shape[1] for p in parts) == batch["input_ids"].shape[1]
        split = grads(parts)
        for n in whole:
            torch.testing.assert_close(split[n], whole[n], atol=1e-6, rtol=1e-4, msg=n)
    with pytest.raises(ValueError, match=r"rl.train_chunks \(5\) must divide rl.batch_size × rl.group_size \(3 × 4\)"):
        _cfg(run_dir, **{"rl.train_chunks": 5})


def test_the_stage_in_chunks_trains_the_same_adapter(run_dir, tmp_path, monkeypatch):
    from glm_lora.engine import rl
    from safetensors.torch import load_file
    (tmp_path / "by_length.py").write_text("def reward(completion, **kw):\n    return float(len(completion) % 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))             # answers of a random model differ in length, not in right
    adapters = []
    for k in (1, 4):
        out = tmp_path / f"out{k}"
        out.mkdir()
        # one step: a second one samples from the updated weights, where float rounding may draw other tokens
        rl.run(_cfg(run_dir, **{"rl.max_steps": 1, "rl.train_chunks": k, "runs_dir": str(tmp_path / f"runs{k}"),
                                "rl.rewards": ["by_length:reward"]}), _inputs(run_dir), out)
        adapters.append(load_file(next(out.glob("*.safetensors"))))
    assert adapters[0].keys() == adapters[1].keys()
    moved = [n for n in adapters[0] if "lora_B" in n and adapters[0][n].abs().max() > 0]
    assert moved                                            # the step trained the adapter
    # AdamW's first step moves each weight by ~lr·sign(g): where g is ~0 the summation order of the parts can move it
    # differently (1 of 512 weights here), so compare the step's loss exactly and nearly every weight
    losses = [json.loads((tmp_path / f"out{k}" / "metrics.jsonl").read_text().splitlines()[0])["loss"] for k in (1, 4)]
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)
    off = sum(int(((adapters[1][n] - adapters[0][n]).abs() > 1e-5).sum()) for n in adapters[0])
    assert off <= 0.005 * sum(t.numel() for t in adapters[0].values()), off
    sys.modules.pop("by_length", None)


def test_prompts_too_long_even_cut_are_counted_in_a_warning(run_dir, caplog):
    tok = load_tokenizer(run_dir / "tokenizer")
    model = _decoder(len(tok), max_seq_len=128)
    rt = Runtime(torch.device("cpu"), torch.float32)
    every = Rollouts(_cfg(run_dir), tok, run_dir / "data", model, rt).rows
    lengths = sorted(len(r["ids"]) for r in every)
    room = lengths[len(lengths) // 2]
    with caplog.at_level("WARNING", logger="glm_lora.rl"):
        kept = Rollouts(_cfg(run_dir, **{"rl.seq_len": room + 6}), tok, run_dir / "data", model, rt).rows
    assert 0 < len(kept) < len(every) and max(len(r["ids"]) for r in kept) <= room
    assert f"{len(every) - len(kept)} of {len(every)} prompts are longer than" in caplog.text


def test_a_users_prompt_file_replaces_the_sft_split_and_is_checked_before_training(run_dir, tmp_path):
    from glm_lora.engine.preflight import preflight
    tok = load_tokenizer(run_dir / "tokenizer")
    rows = [{"conversations": [{"role": "user", "content": f"What is {a} + 1?"},
                               {"role": "assistant", "content": str(a + 1)}], "task": "succ"} for a in range(5)]
    rows.append({"instruction": "Copy: ab", "output": "ab"})                    # Alpaca form, no task: family "all"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(run_dir, **{"rl.prompts": str(prompts), "rl.enabled": True})
    preflight(cfg)
    got = Rollouts(cfg, tok, run_dir / "data", _decoder(len(tok), max_seq_len=128),
                   Runtime(torch.device("cpu"), torch.float32)).rows
    assert [(r["task"], r["reference"]) for r in got] == [("succ", str(a + 1)) for a in range(5)] + [("all", "ab")]
    with pytest.raises(UserError, match=r"rl.families \['add_en'\] match no row of .*prompts.jsonl"):
        Rollouts(_cfg(run_dir, **{"rl.prompts": str(prompts), "rl.families": ["add_en"]}), tok, run_dir / "data",
                 _decoder(len(tok), max_seq_len=128), Runtime(torch.device("cpu"), torch.float32))
    with pytest.raises(UserError, match="rl.prompts: .*missing.jsonl is not a file"):
        preflight(_cfg(run_dir, **{"rl.prompts": str(tmp_path / "missing.jsonl"), "rl.enabled": True}))
    prompts.write_text(prompts.read_text() + '{"conversations": [{"role": "user"}]}\n')
    with pytest.raises(UserError, match=r"prompts.jsonl:7"):
        preflight(cfg)


def test_the_stage_trains_logs_rewards_and_keeps_samples(run_dir, tmp_path):
    from glm_lora.engine import rl
    out = tmp_path / "out"
    out.mkdir()
    m = rl.run(_cfg(run_dir, **{"rl.max_steps": 3}), _inputs(run_dir), out)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert {"reward_mean", "reward_std", "kl", "completion_length", "reward_exact_match", "reward_format",
            "flat_groups"} <= set(lines[0])
    assert m["samples"] and {"prompt", "answer", "reference", "exact_match", "format"} <= set(m["samples"][0])
    assert (out / "adapter.safetensors").is_file() or list(out.glob("*.safetensors"))


def test_a_failing_reward_names_itself_and_the_prompt_and_keeps_the_last_checkpoint(run_dir, tmp_path, monkeypatch):
    (tmp_path / "late_fail.py").write_text(
        "calls = 0\n"
        "def reward(completion, **kw):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls > 12 * 3:\n"            # steps 1-3 score 12 answers each; step 4's first answer fails
        "        raise ValueError('broken scorer')\n"
        "    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from glm_lora.engine import rl
    cfg = _cfg(run_dir, **{"rl.max_steps": 6, "rl.rewards": ["late_fail:reward"], "runs_dir": str(tmp_path / "runs"),
                           "checkpoint.async_save": False})
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(rewards.RewardError, match=r"reward 'late_fail:reward' on prompt '.+' .*raised ValueError: "
                                                  r"broken scorer"):
        rl.run(cfg, _inputs(run_dir), out)
    steps = sorted(p.name for p in (tmp_path / "runs" / "tiny" / "checkpoints").glob("rl-*/step-*"))
    assert steps == ["step-00000002"], steps
    sys.modules.pop("late_fail", None)


RUN_STAGE = """
import json, sys
from pathlib import Path
from glm_lora.configs.load import load_config
from glm_lora.engine import rl
d, out, over = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
rl.run(load_config("tiny", over), {s: d / s for s in ("data", "tokenizer", "sft", "dpo")} | {"base": d / "pretrain"}, out)
"""


def test_kill_minus_9_mid_rollout_or_update_then_resume_is_bit_identical(run_dir, tmp_path):
    """The stage killed after its step-4 checkpoint (in a rollout or an update) and run again ends with the same
    adapter and the same per-step losses as a run never killed: the rollouts are drawn again from the saved cursor."""
    import os
    import signal
    import subprocess
    import time
    from safetensors.torch import load_file

    def over(name):
        return {"runs_dir": str(tmp_path / name), "serve.enabled": False, "eval.enabled": False, "threads": 1,
                "data.synthetic.n_pretrain": 200, "data.synthetic.n_sft": 60, "data.synthetic.n_dpo": 10,
                "data.synthetic.n_eval": 20, "rl.batch_size": 3, "rl.group_size": 4, "rl.max_new_tokens": 6,
                "rl.seq_len": 96, "rl.max_steps": 10, "rl.log_every": 1, "checkpoint.save_every": 2,
                "checkpoint.save_optimizer_every": 2, "checkpoint.async_save": False}

    def start(name):
        return subprocess.Popen([sys.executable, "-c", RUN_STAGE, str(run_dir), str(tmp_path / name / "out"),
                                 json.dumps(over(name))], stderr=subprocess.PIPE)

    ref = start("reference")
    assert ref.wait(timeout=300) == 0, ref.stderr.read().decode()[-3000:]
    killed = start("killed")
    deadline = time.time() + 120
    while not list((tmp_path / "killed").glob("tiny/checkpoints/rl-*/step-00000004")) and time.time() < deadline:
        assert killed.poll() is None, killed.stderr.read().decode()[-3000:]
        time.sleep(0.01)
    time.sleep(0.2)
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL                   # killed before its end, not finished
    again = start("killed")
    assert again.wait(timeout=300) == 0, again.stderr.read().decode()[-3000:]
    a, b = (load_file(next((tmp_path / n / "out").glob("*.safetensors"))) for n in ("reference", "killed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "reference" / "out" / "losses.json").read_text()) == \
        json.loads((tmp_path / "killed" / "out" / "losses.json").read_text())
