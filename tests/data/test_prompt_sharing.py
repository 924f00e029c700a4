"""Preference pairs packed with their common prompt placed once (`dpo.share_prompt`): the layout, and the same
per-answer log-probs, loss and gradients as the pairs packed whole, with fewer tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from glm_lora.configs.schema import LoRAConfig
from glm_lora.data.packing import IGNORE, PackedBatches, shared_prefix
from glm_lora.engine.losses import PreferenceLoss
from glm_lora.model.heads import group_logprobs
from glm_lora.model import Decoder, DecoderConfig
from glm_lora.model.lora import inject_lora
from tests.data.test_packing import Counter, ListSource

torch.set_num_threads(1)


def _pairs(n, seed=0, vocab=50):
    """n (prompt + chosen, prompt + rejected) pairs, labels on the answers: examples 2i, 2i + 1."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = rng.integers(1, vocab, rng.integers(2, 14)).tolist()
        for _ in range(2):
            answer = rng.integers(1, vocab, rng.integers(1, 9)).tolist()
            out.append((prompt + answer, [IGNORE] * len(prompt) + answer))
    return out


def _doc(ids, labels):
    return np.asarray(ids), np.asarray(labels)


def test_the_shared_part_is_the_common_unlabelled_prefix_but_its_last_token():
    a = _doc([5, 6, 7, 8, 9], [IGNORE, IGNORE, IGNORE, 8, 9])
    b = _doc([5, 6, 7, 3], [IGNORE, IGNORE, IGNORE, 3])
    assert shared_prefix([a, b]) == 2              # 5 6 shared; each answer keeps 7, which predicts its first token
    c = _doc([5, 6, 7, 8], [IGNORE, 6, IGNORE, 8])  # a labelled token ends what can be shared
    assert shared_prefix([a, c]) == 0
    assert shared_prefix([a, _doc([4, 6, 7], [IGNORE] * 3)]) == 0
    assert shared_prefix([a]) == 0


def test_layout_prompt_once_answers_at_their_own_positions():
    pairs = _pairs(6, seed=1)
    src = ListSource(pairs)
    plain = next(PackedBatches(src, iter(range(6)), rows=3, seq_len=64, group_size=2, lookahead=6))
    shared = next(PackedBatches(src, iter(range(6)), rows=3, seq_len=64, group_size=2, lookahead=6,
                                share_prefix=True))
    saved = sum(shared_prefix([_doc(*pairs[2 * g]), _doc(*pairs[2 * g + 1])]) for g in range(6))
    assert saved > 0 and shared["num_tokens"] == plain["num_tokens"] - saved
    assert len(shared["group_docs"]) == len(plain["group_docs"]) == 6
    for g, (chosen, rejected) in enumerate(shared["group_docs"].tolist()):
        r = int((shared["doc_ids"] == chosen).nonzero()[0, 0])
        prompt = int(shared["prefix_docs"][shared["doc_ids"] == chosen][0])
        assert (shared["prefix_docs"][shared["doc_ids"] == rejected] == prompt).all()
        p_cols = (shared["doc_ids"][r] == prompt).nonzero().flatten()
        assert (shared["labels"][r, p_cols] == IGNORE).all()
        for doc in (chosen, rejected):
            cols = (shared["doc_ids"][r] == doc).nonzero().flatten()
            whole = np.concatenate([shared["input_ids"][r, p_cols].numpy(), shared["input_ids"][r, cols].numpy()])
            assert any(np.array_equal(whole, ids) for ids, _ in src.examples)   # prompt + answer = the example
            assert (shared["position_ids"][r, cols] == torch.arange(len(p_cols), len(p_cols) + len(cols))).all()
    assert (shared["prefix_docs"][shared["doc_ids"] == 0] == -1).all()


def _policy():
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                  intermediate_size=48, max_seq_len=64)).double()
    inject_lora(model, LoRAConfig(r=4, alpha=8))
    with torch.no_grad():      # a trained adapter: the policy differs from the reference (the adapter off)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model


def _by_pair(batch, values):
    """{the chosen example's token ids: value} — the packer may order pairs differently with shorter groups."""
    out = {}
    for g, (chosen, _) in enumerate(batch["group_docs"].tolist()):
        cols = batch["doc_ids"] == chosen
        prompt = []
        if "prefix_docs" in batch:      # the shared prompt's tokens, then the answer's
            prompt = batch["input_ids"][batch["doc_ids"] == int(batch["prefix_docs"][cols][0])].tolist()
        out[tuple(prompt + batch["input_ids"][cols].tolist())] = values[g]
    return out


@pytest.mark.parametrize("kind", ["dpo", "orpo"])
def test_same_log_probs_loss_and_gradients_as_whole_pairs(kind):
    pairs = _pairs(8, seed=2)
    src = ListSource(pairs)
    plain = next(PackedBatches(src, iter(range(8)), rows=4, seq_len=64, group_size=2, lookahead=8))
    shared = next(PackedBatches(src, iter(range(8)), rows=4, seq_len=64, group_size=2, lookahead=8,
                                share_prefix=True))
    assert len(plain["group_docs"]) == len(shared["group_docs"]) == 8 and shared["num_tokens"] < plain["num_tokens"]
    model = _policy()
    with torch.no_grad():
        lp_plain, n_plain = group_logprobs(model, plain)
        lp_shared, n_shared = group_logprobs(model, shared)
    a, b = _by_pair(plain, list(zip(lp_plain, n_plain))), _by_pair(shared, list(zip(lp_shared, n_shared)))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key][0], b[key][0], rtol=1e-10, atol=1e-10)
        assert torch.equal(a[key][1], b[key][1])
    loss_fn = PreferenceLoss(beta=0.5, nll_weight=1.0, kind=kind)
    grads = []
    for batch in (plain, shared):
        model.zero_grad()
        loss, metrics = loss_fn(model, batch)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-10, atol=1e-12)
    for g_plain, g_shared in zip(grads[0][1], grads[1][1]):     # RMSNorm normalises in fp32 (as transformers):
        torch.testing.assert_close(g_plain, g_shared, rtol=1e-6, atol=1e-8)   # fp32-sized differences in float64


def test_resume_recomputes_what_the_buffered_groups_take():
    src = ListSource(_pairs(30, seed=3))
    order = Counter(30)
    a = PackedBatches(src, order, rows=2, seq_len=40, group_size=2, lookahead=8, share_prefix=True)
    for _ in range(2):
        next(a)
    saved_position, saved = order.position, a.state_dict()
    expected = [next(a) for _ in range(3)]
    b = PackedBatches(src, Counter(30, saved_position), rows=2, seq_len=40, group_size=2, lookahead=8,
                      share_prefix=True)
    b.load_state_dict(saved)
    for e in expected:
        got = next(b)
        for key in ("input_ids", "labels", "position_ids", "doc_ids", "prefix_docs"):
            assert torch.equal(got[key], e[key]), key
