"""engine/checkpoint_store.py: round trip, async stall, atomicity under crashes, corruption, pruning;
engine/checkpoint.py: the loop's Checkpointer (resume checks, trainer_state.json format, directory key)."""
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import glm_lora.engine.checkpoint as ckpt_mod
import glm_lora.engine.checkpoint_store as store_mod
from glm_lora.configs.schema import CheckpointConfig, Config
from glm_lora.engine.checkpoint import Checkpointer, IncompatibleResumeError, TrainState, capture_rng, config_diff, restore_rng
from glm_lora.engine.checkpoint_store import (MANIFEST, MODEL, OPTIMIZER, RNG, TRAINER_STATE, CheckpointError,
                                     CheckpointManager, CheckpointUnusable)
from glm_lora.model.heads import causal_lm_loss
from glm_lora.engine.optim import build_optimizer
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from glm_lora.configs.schema import LoRAConfig

torch.set_num_threads(1)

VOCAB = 67
REPO = Path(__file__).resolve().parents[2]


def trained(lora: bool = True, hidden: int = 32, steps: int = 2):
    """A tiny decoder (LoRA on q/v, or full) and its real AdamW after `steps` steps."""
    torch.manual_seed(0)
    m = Decoder(DecoderConfig(vocab_size=VOCAB, hidden_size=hidden, num_layers=2, num_heads=4, num_kv_heads=2,
                              intermediate_size=hidden + hidden // 2, max_seq_len=32))
    if lora:
        inject_lora(m, LoRAConfig(target_modules=["q_proj", "v_proj"], r=4, alpha=8))
    opt = build_optimizer(m, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (2, 12), generator=g)
        loss, _ = causal_lm_loss(m, {"input_ids": x, "labels": x})
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return m, opt


def weights_of(m) -> dict[str, torch.Tensor]:
    return {n: p for n, p in m.named_parameters() if p.requires_grad}


def state(step: int) -> dict:
    return {"step": step, "epoch": 0, "tokens": 100 * step, "config_hash": "abc", "code_version": "deadbeef",
            "data_state": {"order": {"epoch": 0, "position": 7 * step}, "packer": {"buffer": [3, 1, 2]}},
            "losses": [4.0 - 0.1 * i for i in range(step)]}


def save(mgr, step, m, opt, **kw):
    return mgr.save(step, weights=weights_of(m), optimizer=opt.state_dict() if opt else None,
                    trainer_state=state(step), rng=capture_rng(), **kw)


def assert_nested_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_nested_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_nested_equal(x, y)
    else:
        assert a == b, (a, b)


@pytest.fixture
def slow_writes(monkeypatch):
    """Every small-file write sleeps `delay` seconds first."""
    delay = {"s": 0.0}
    real = store_mod._write_file

    def slow(path, data):
        time.sleep(delay["s"])
        real(path, data)
    monkeypatch.setattr(store_mod, "_write_file", slow)
    return delay


# ---------------------------------------------------------------- round trip

def test_round_trip_weights_optimizer_rng_state(tmp_path):
    m, opt = trained()
    w = {k: v.detach().clone() for k, v in weights_of(m).items()}
    opt_state = opt.state_dict()
    rng = capture_rng()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(2, weights=weights_of(m), optimizer=opt_state, trainer_state=state(2), rng=rng)
    c = CheckpointManager(tmp_path).latest()
    assert c.step == 2 and c.path == tmp_path / "step-00000002"
    assert sorted(p.name for p in c.path.iterdir()) == sorted([MODEL, OPTIMIZER, RNG, TRAINER_STATE, MANIFEST])
    assert_nested_equal(w, c.weights)
    assert_nested_equal(opt_state, c.optimizer)
    assert c.rng == rng and c.trainer_state == state(2)
    # The loaded state drives a fresh AdamW to the same next step as the original.
    m2, opt2 = trained(steps=0)
    m2.load_state_dict(c.weights, strict=False)
    opt2.load_state_dict(c.optimizer)
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(9))
    for model, o in ((m, opt), (m2, opt2)):
        causal_lm_loss(model, {"input_ids": x, "labels": x})[0].backward()
        o.step()
    assert_nested_equal(weights_of(m), weights_of(m2))


def test_restore_rng_reproduces_next_draws():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.randn(3), torch.randn(3)   # advance, numpy's cached gaussian included
    s = json.loads(json.dumps(capture_rng()))               # through JSON, as on disk
    want = (random.random(), random.gauss(0, 1), np.random.randn(5).tolist(), torch.randn(5), torch.rand(2))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    restore_rng(s)
    got = (random.random(), random.gauss(0, 1), np.random.randn(5).tolist(), torch.randn(5), torch.rand(2))
    assert_nested_equal(list(want), list(got))


# ---------------------------------------------------------------- async

def test_save_is_async_and_snapshots_at_call(tmp_path, slow_writes):
    m, opt = trained()
    before_w = {k: v.detach().clone() for k, v in weights_of(m).items()}
    before_opt = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    slow_writes["s"] = 0.15                        # × 3 small files (optimizer, rng, trainer_state)
    mgr = CheckpointManager(tmp_path)
    st = save(mgr, 2, m, opt)
    # Training goes on mutating everything in place while the write runs.
    with torch.no_grad():
        for p in weights_of(m).values():
            p.add_(1.0)
    for s in opt.state.values():
        s["exp_avg"].mul_(-3)
        s["step"].add_(10)
    assert not (tmp_path / "step-00000002").exists()   # still writing
    mgr.wait()
    stat = mgr.stats[-1]
    assert stat["stall_s"] == st and stat["write_s"] >= 0.45
    assert st < stat["write_s"] / 5, (st, stat)
    c = mgr.latest()
    assert_nested_equal(before_w, c.weights)
    assert_nested_equal(before_opt, c.optimizer["state"])
    mgr.close()
    print(f"\nasync: stall {st * 1e3:.2f} ms, write {stat['write_s'] * 1e3:.0f} ms (slowed), {stat['bytes']} bytes")


def test_sync_mode_and_next_save_waits_for_previous(tmp_path, slow_writes):
    m, opt = trained()
    slow_writes["s"] = 0.05
    mgr = CheckpointManager(tmp_path, keep_last=5)
    save(mgr, 1, m, opt)
    stall2 = save(mgr, 2, m, opt)                  # waits for step 1's write
    assert mgr.stats[1]["wait_prev_s"] > 0.05 and stall2 >= mgr.stats[1]["wait_prev_s"]
    mgr.close()
    assert [p.name for p in mgr.list()] == ["step-00000001", "step-00000002"]
    sync = CheckpointManager(tmp_path, keep_last=5, async_save=False)
    st = save(sync, 3, m, opt)
    assert (tmp_path / "step-00000003" / MANIFEST).is_file() and st >= sync.stats[-1]["write_s"]


def test_thread_error_is_raised_by_next_call_and_cleaned_up(tmp_path, monkeypatch):
    m, opt = trained()
    mgr = CheckpointManager(tmp_path)
    monkeypatch.setattr(store_mod, "_write_file", lambda path, data: (_ for _ in ()).throw(OSError("disk full")))
    save(mgr, 1, m, opt)
    with pytest.raises(CheckpointError, match="step 1.*disk full"):
        mgr.wait()
    mgr.wait()                                     # raised once, then cleared
    assert list(tmp_path.iterdir()) == []          # the temp dir was removed
    with pytest.raises(TypeError):                 # not JSON: fails in the caller, not in the thread
        mgr.save(2, weights=weights_of(m), optimizer=None, trainer_state={"x": object()}, rng=capture_rng())


# ---------------------------------------------------------------- atomicity

def test_crash_mid_write_keeps_previous(tmp_path, monkeypatch):
    m, opt = trained()
    mgr = CheckpointManager(tmp_path)
    save(mgr, 1, m, opt)
    mgr.wait()
    real = store_mod._write_file

    def dies_at_rng(path, data):
        if path.name == RNG:
            raise KeyboardInterrupt                # model + optimizer already written
        real(path, data)
    monkeypatch.setattr(store_mod, "_write_file", dies_at_rng)
    save(mgr, 2, m, opt)
    with pytest.raises(CheckpointError):
        mgr.wait()
    assert [p.name for p in mgr.list()] == ["step-00000001"]
    assert CheckpointManager(tmp_path).latest().step == 1


def test_kill_9_during_save_keeps_previous(tmp_path):
    """A real crash: a subprocess is SIGKILLed while its writer thread is inside a save."""
    script = textwrap.dedent(f"""
        import sys, time, torch
        sys.path.insert(0, {str(REPO)!r})
        import glm_lora.engine.checkpoint as c
        import glm_lora.engine.checkpoint_store as s
        mgr = s.CheckpointManager({str(tmp_path)!r})
        w = {{"a": torch.arange(6.0)}}
        mgr.save(1, weights=w, optimizer={{"state": {{}}, "param_groups": []}}, trainer_state={{"step": 1}},
                 rng=c.capture_rng())
        mgr.wait()
        def hang(path, data):
            open(path, "wb").write(data[: len(data) // 2])
            print("writing", flush=True)
            time.sleep(60)
        s._write_file = hang
        mgr.save(2, weights={{"a": w["a"] + 1}}, optimizer={{"state": {{}}, "param_groups": []}},
                 trainer_state={{"step": 2}}, rng=c.capture_rng())
        mgr.wait()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert any(p.name.startswith(".tmp-step-00000002-") for p in tmp_path.iterdir())
    c = CheckpointManager(tmp_path).latest()
    assert c.step == 1 and torch.equal(c.weights["a"], torch.arange(6.0))
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]    # leftover temp dir removed


# ---------------------------------------------------------------- corruption

def _flip(p: Path):
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))


def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


@pytest.mark.parametrize("damage", [_flip, _truncate], ids=["flip", "truncate"])
@pytest.mark.parametrize("name", [MODEL, OPTIMIZER, RNG, TRAINER_STATE, MANIFEST])
def test_corrupt_newest_falls_back_to_previous(tmp_path, caplog, name, damage):
    m, opt = trained()
    with CheckpointManager(tmp_path) as mgr:
        save(mgr, 1, m, opt)
        save(mgr, 2, m, opt)
    damage(tmp_path / "step-00000002" / name)
    with caplog.at_level(logging.WARNING, logger="glm_lora.checkpoint"):
        c = CheckpointManager(tmp_path).latest()
    assert c.step == 1 and c.optimizer is not None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(tmp_path / "step-00000002" / name) in warned[0], warned


def test_missing_manifest_and_nothing_valid(tmp_path, caplog):
    m, opt = trained()
    with CheckpointManager(tmp_path) as mgr:
        save(mgr, 1, m, opt)
    (tmp_path / "step-00000001" / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="glm_lora.checkpoint"):
        # Checkpoints exist but none verifies: starting over would overwrite them (and the best weights).
        with pytest.raises(CheckpointUnusable, match=r"none of the 1 checkpoints .*manifest.json: missing"):
            CheckpointManager(tmp_path).latest()
    assert "manifest.json: missing" in caplog.text
    assert CheckpointManager(tmp_path / "empty").latest() is None


# ---------------------------------------------------------------- pruning and preference

def test_keep_last_prunes_oldest(tmp_path):
    m, opt = trained()
    with CheckpointManager(tmp_path, keep_last=2) as mgr:
        for step in range(1, 6):
            save(mgr, step, m, opt)
    assert [p.name for p in mgr.list()] == ["step-00000004", "step-00000005"]


def test_hybrid_keeps_newest_optimizer_checkpoint_and_latest_prefers_it(tmp_path, caplog):
    """Model every step, optimizer every 3rd: the newest optimizer checkpoint outlives keep_last."""
    m, opt = trained()
    with CheckpointManager(tmp_path, keep_last=2) as mgr:
        for step in range(1, 6):
            save(mgr, step, m, opt if step % 3 == 0 else None)
    assert [p.name for p in mgr.list()] == ["step-00000003", "step-00000004", "step-00000005"]
    c = mgr.latest()
    assert c.step == 3 and c.optimizer is not None
    # Its optimizer file rots: fall back to the newest model-only one, and say so.
    _flip(tmp_path / "step-00000003" / OPTIMIZER)
    with caplog.at_level(logging.WARNING, logger="glm_lora.checkpoint"):
        c = mgr.latest()
    assert c.step == 5 and c.optimizer is None
    assert "no verified checkpoint with optimizer state" in caplog.text
    # A later optimizer save at 6 makes step 3 prunable.
    with CheckpointManager(tmp_path, keep_last=2) as mgr:
        save(mgr, 6, m, opt)
    assert [p.name for p in mgr.list()] == ["step-00000005", "step-00000006"]


def test_resave_same_step_replaces_it(tmp_path):
    m, opt = trained()
    with CheckpointManager(tmp_path) as mgr:
        save(mgr, 4, m, None)                      # scheduled model-only save
        save(mgr, 4, m, opt)                       # then the stop signal's full save
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000004"]
    assert mgr.latest().optimizer is not None


# ---------------------------------------------------------------- compression

def test_optimizer_compression_ratio_recorded(tmp_path):
    m, opt = trained(lora=False, hidden=64, steps=3)
    with CheckpointManager(tmp_path) as mgr:
        save(mgr, 3, m, opt)
    manifest = json.loads((tmp_path / "step-00000003" / MANIFEST).read_text())
    o = manifest["optimizer"]
    assert o["compressed_bytes"] == (tmp_path / "step-00000003" / OPTIMIZER).stat().st_size
    assert o["raw_bytes"] > o["compressed_bytes"] and o["ratio"] > 1
    st = mgr.stats[-1]
    assert (st["optimizer_raw_bytes"], st["optimizer_compressed_bytes"]) == (o["raw_bytes"], o["compressed_bytes"])
    print(f"\nAdamW state {o['raw_bytes']} → {o['compressed_bytes']} bytes, zstd-3 ratio {o['ratio']:.3f}; "
          f"stall {st['stall_s'] * 1e3:.2f} ms, write {st['write_s'] * 1e3:.1f} ms")


# ---------------------------------------------------------------- config_diff

def test_config_diff_names_differing_dotted_keys():
    saved = {"model": {"hidden_size": 64, "num_layers": 2}, "tokenizer": {"vocab_size": 100},
             "lora": {"target_modules": ["q_proj", "v_proj"], "r": 8}, "train": {"max_steps": 100}}
    current = {"model": {"hidden_size": 128, "num_layers": 2, "tie_embeddings": False},
               "tokenizer": {"vocab_size": 100}, "lora": {"target_modules": ("q_proj", "v_proj"), "r": 16},
               "train": {"max_steps": 500}}
    keys = ["model", "tokenizer.vocab_size", "lora.target_modules", "lora.r", "lora.dropout"]
    assert config_diff(saved, current, keys) == ["model.hidden_size", "model.tie_embeddings", "lora.r"]
    assert config_diff(saved, saved, keys) == []
    assert config_diff(saved, {**current, "tokenizer": {}}, ["tokenizer.vocab_size"]) == ["tokenizer.vocab_size"]


# ---------------------------------------------------------------- Checkpointer: the loop's side

SYNC = CheckpointConfig(async_save=False)


def test_incompatible_resume_is_refused_naming_the_key(tmp_path):
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(m.parameters())
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(3, weights={n: p.detach() for n, p in m.named_parameters()}, optimizer=opt.state_dict(),
             trainer_state={"step": 3, "config": {"lora": {"r": 8}, "seq_len": 64}}, rng=capture_rng())
    with pytest.raises(IncompatibleResumeError, match="lora"):
        Checkpointer(tmp_path, SYNC, run_config={"lora": {"r": 16}, "seq_len": 64}, name="sft").restore(m, opt)
    state = Checkpointer(tmp_path, SYNC, run_config={"lora": {"r": 8}, "seq_len": 64}, name="sft").restore(m, opt)
    assert state.step == 3
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))          # 0.weight, 0.bias
    with pytest.raises(IncompatibleResumeError, match="weights differ"):
        Checkpointer(tmp_path, SYNC, run_config={"lora": {"r": 8}, "seq_len": 64}).restore(
            other, torch.optim.AdamW(other.parameters()))


def test_trainer_state_json_keeps_its_format_and_resumes(tmp_path):
    """trainer_state.json as the loop wrote it before TrainState existed: it resumes, and a save of the
    restored state writes the same content (so older checkpoints and newer ones are interchangeable)."""
    m, opt = trained()
    run_config = {"model": None, "lora": {"r": 4}, "inputs": ["abc"], "seq_len": 16, "batch_size": 2, "packing": True}
    saved = {"step": 4, "tokens": 400, "losses": [4.0, 3.5, 3.25, 3.0], "skipped": 1,
             "data_state": {"order": {"epoch": 1, "position": 3}, "packer": {"buffer": [1]}},
             "val_losses": [[2, 3.5], [4, 3.75]], "best_val_loss": 3.5, "best_step": 2, "bad_evals": 1,
             "stopped_early": False, "config": run_config, "config_hash": ckpt_mod.sha256_json(run_config),
             "code_version": ckpt_mod.CODE_VERSION, "max_steps": 10, "epoch": 1}
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(4, weights=weights_of(m), optimizer=opt.state_dict(), trainer_state=saved, rng=capture_rng())
        mgr.save_best({k: v.detach() for k, v in weights_of(m).items()}, step=2, val_loss=3.5)
    before = (tmp_path / "step-00000004" / TRAINER_STATE).read_text()
    m2, opt2 = trained(steps=0)
    ckpt = Checkpointer(tmp_path, SYNC, run_config=run_config)
    state = ckpt.restore(m2, opt2)
    assert state == TrainState(**{k: saved[k] for k in vars(TrainState())})
    assert_nested_equal(weights_of(m), weights_of(m2))
    with torch.no_grad():
        for p in weights_of(m2).values():
            p.add_(1.0)
    ckpt.restore_best(m2, state)                                        # best_step 2 came back with it
    assert_nested_equal(weights_of(m), weights_of(m2))
    ckpt.save(state, m2, opt2, with_optimizer=True, max_steps=10)      # replaces step 4
    ckpt.close()
    assert (tmp_path / "step-00000004" / TRAINER_STATE).read_text() == before


def test_without_a_root_nothing_is_written_and_the_best_stays_in_memory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m, opt = trained()
    ckpt = Checkpointer()
    assert ckpt.restore(m, opt) is None and ckpt.root is None
    state = TrainState(step=3)
    ckpt.maybe_save(state, m, opt, stop=True, max_steps=5)
    state.validated(1.0, 0.0, 0)
    ckpt.save_best(state, m)
    best = {k: v.detach().clone() for k, v in weights_of(m).items()}
    with torch.no_grad():
        for p in weights_of(m).values():
            p.add_(1.0)
    state.step = 5
    ckpt.restore_best(m, state)
    assert_nested_equal(best, {k: v.detach() for k, v in weights_of(m).items()})
    assert ckpt.metrics() == {} and list(tmp_path.iterdir()) == []


def test_train_state_validated_counts_patience():
    s = TrainState(step=2)
    assert s.validated(3.0, 0.1, 2) and (s.best_step, s.best_val_loss) == (2, 3.0)
    s.step = 4
    assert not s.validated(2.95, 0.1, 2) and s.bad_evals == 1 and not s.stopped_early    # within min_delta
    s.step = 6
    assert not s.validated(3.5, 0.1, 2) and s.stopped_early
    assert s.val_losses == [[2, 3.0], [4, 2.95], [6, 3.5]]


def test_for_stage_keeps_the_checkpoint_directory_of_earlier_versions(tmp_path):
    """The directory hash is the one engine/stages.py computed before: checkpoints made by an earlier
    version are still found (and a changed max_steps/log_every still resumes)."""
    from glm_lora.artifacts import manifest as artifacts
    inputs = []
    for name in ("tokenizer", "data"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f.txt").write_text(name)
        artifacts.write_manifest(tmp_path / name, name)
        inputs.append(tmp_path / name)
    cfg = Config(runs_dir=tmp_path / "runs", run_name="r")
    model, _ = trained(lora=False, steps=0)
    digests = [artifacts.read_manifest(p)["digest"] for p in inputs]
    for stage, tc in (("pretrain", cfg.pretrain), ("sft", cfg.sft)):
        # (global_batch_size came later: unset, it is left out so the directory stays the same; compile, a
        # speed setting, came later too and is always left out; so did lora.quantization, left out while "none",
        # and the MTP keys, left out while they change nothing: mtp carry, model.mtp_layers 0)
        earlier = {"max_steps": True, "log_every": True, "global_batch_size": True, "compile": True,
                   "lora": {"quantization"}, "mtp": True, "mtp_weight": True}
        section = tc.model_dump(mode="json", exclude=earlier)
        model_section = cfg.model.model_dump(mode="json", exclude={"mtp_layers"})
        key = artifacts.sha256_json({"stage": stage, "section": section, "model": model_section,
                                     "device": cfg.device, "precision": cfg.precision, "kernels": cfg.kernels,
                                     "attention": cfg.attention, "inputs": digests})
        ckpt = Checkpointer.for_stage(cfg, stage, tc, inputs, model)
        assert ckpt.root == cfg.run_dir / "checkpoints" / f"{stage}-{key[:12]}" and ckpt.name == stage
        longer = Checkpointer.for_stage(cfg, stage, tc.model_copy(update={"max_steps": 999, "log_every": 3}), inputs,
                                        model)
        assert longer.root == ckpt.root
        compiled = Checkpointer.for_stage(cfg, stage, tc.model_copy(update={"compile": True}), inputs, model)
        assert compiled.root == ckpt.root
        lora = getattr(tc, "lora", None)          # what the loop saved as trainer_state["config"] before
        assert ckpt.run_config == {"model": model.config.to_dict() if stage == "pretrain" else None,
                                   "lora": lora.model_dump(mode="json", exclude={"quantization"}) if lora else None,
                                   "inputs": digests, "seq_len": tc.seq_len, "batch_size": tc.batch_size,
                                   "packing": tc.packing}
        assert list(ckpt.run_config) == ["model", "lora", "inputs", "seq_len", "batch_size", "packing"]
        if lora is not None:                      # a QLoRA run is another run: its own directory and resume config
            qlora = Checkpointer.for_stage(cfg, stage, tc.model_copy(update={"lora": lora.model_copy(
                update={"quantization": "nf4"})}), inputs, model)
            assert qlora.root != ckpt.root and qlora.run_config["lora"]["quantization"] == "nf4"
