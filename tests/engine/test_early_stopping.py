"""Validation during training: early stopping (patience, min_delta) and the best weights carried forward."""
import itertools

import torch

from glm_lora.engine.checkpoint import CheckpointManager, Checkpointer
from glm_lora.model.heads import causal_lm_loss
from glm_lora.engine.trainer import train
from glm_lora.configs.schema import CheckpointConfig
from tests.engine.test_engine import CPU, batch, cfg, tiny


def scripted(values):
    """A validate() returning the given losses in turn and remembering the weights it saw."""
    seen = []

    def validate():
        seen.append({n: p.detach().clone() for n, p in model_ref[0].named_parameters()})
        return values[len(seen) - 1]
    model_ref = [None]
    return validate, seen, model_ref


def run(values, tmp_path=None, **kw):
    m = tiny()
    validate, seen, ref = scripted(values)
    ref[0] = m
    ckpt = Checkpointer(tmp_path, CheckpointConfig(save_every=0, async_save=False)) if tmp_path else None
    summary = train(m, causal_lm_loss, lambda _: itertools.repeat(batch()), cfg(**kw), CPU, validate=validate,
                    checkpointer=ckpt)
    return m, summary, seen


def test_patience_stops_and_best_weights_are_restored():
    # validations at steps 2, 4, 6, 8: best at step 4, then two without improvement → stop at step 8
    m, s, seen = run([3.0, 2.0, 2.5, 2.1, 1.0], max_steps=20, eval_every=2, patience=2)
    assert s["stopped_early"] and s["last_step"] == 8
    assert s["best_step"] == 4 and s["best_val_loss"] == 2.0
    assert [v for _, v in s["val_losses"]] == [3.0, 2.0, 2.5, 2.1]
    assert len(s["losses"]) == 8
    for n, p in m.named_parameters():
        torch.testing.assert_close(p, seen[1][n], atol=0, rtol=0, msg=n)     # step 4's weights, not step 8's
    assert not torch.equal(seen[1]["lm_head.weight"], seen[3]["lm_head.weight"])   # training did move on


def test_min_delta_counts_small_gains_as_no_improvement():
    _, s, _ = run([3.0, 2.95, 2.9, 2.0], max_steps=20, eval_every=1, patience=2, min_delta=0.1)
    assert s["stopped_early"] and s["best_step"] == 1 and s["last_step"] == 3


def test_no_patience_runs_to_the_end_but_keeps_the_best():
    m, s, seen = run([1.0, 2.0, 3.0], max_steps=6, eval_every=2, patience=0)
    assert not s["stopped_early"] and s["last_step"] == 6 and s["best_step"] == 2
    torch.testing.assert_close(m.lm_head.weight, seen[0]["lm_head.weight"], atol=0, rtol=0)


def test_last_step_is_validated_and_kept_when_best():
    m, s, seen = run([3.0, 2.0, 1.0], max_steps=5, eval_every=2)
    assert [st for st, _ in s["val_losses"]] == [2, 4, 5]
    assert s["best_step"] == 5
    torch.testing.assert_close(m.lm_head.weight, seen[-1]["lm_head.weight"], atol=0, rtol=0)


def test_best_weights_are_saved_beside_checkpoints(tmp_path):
    _, s, seen = run([3.0, 1.0, 2.0], tmp_path, max_steps=6, eval_every=2)
    best = CheckpointManager(tmp_path).load_best(4)
    assert best is not None and s["best_step"] == 4
    torch.testing.assert_close(best["lm_head.weight"], seen[1]["lm_head.weight"], atol=0, rtol=0)
    assert CheckpointManager(tmp_path).load_best(6) is None      # tagged with its step


def test_without_validate_nothing_changes():
    m = tiny()
    s = train(m, causal_lm_loss, lambda _: itertools.repeat(batch()), cfg(max_steps=3, eval_every=1), CPU)
    assert "best_step" not in s and s["step"] == 3


def test_resume_keeps_the_best_weights_from_before_the_restart(tmp_path):
    m = tiny()
    validate, seen, ref = scripted([3.0, 1.0, 2.0, 2.5])
    ref[0] = m
    ck = CheckpointConfig(save_every=2, save_optimizer_every=2, async_save=False)
    go = lambda steps: train(m, causal_lm_loss, lambda _: itertools.repeat(batch()),   # noqa: E731
                             cfg(max_steps=steps, eval_every=2), CPU, validate=validate,
                             checkpointer=Checkpointer(tmp_path, ck))
    go(4)                                   # validations at 2 and 4: best is step 4
    m.lm_head.weight.data.add_(1.0)         # a fresh process would not have them in memory anyway
    s = go(8)                               # resumes at step 4; validations at 6, 8 are worse
    assert s["best_step"] == 4 and [st for st, _ in s["val_losses"]] == [2, 4, 6, 8]
    torch.testing.assert_close(m.lm_head.weight, seen[1]["lm_head.weight"], atol=0, rtol=0)
