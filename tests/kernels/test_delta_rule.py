"""Gated DeltaNet's references (kernels/delta_rule.py): the chunked rule equals the token-by-token one, on odd
lengths, from a given state, with value heads sharing key heads; transformers' own torch rule agrees; packed
documents equal each document alone, in the convolution and in the rule, forward and every gradient."""
from __future__ import annotations

import pytest
import torch

from glm_lora.kernels import delta_rule, ops


def inputs(B=2, T=37, H=3, Dk=8, Dv=6, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, Dk, generator=g), torch.randn(B, T, H, Dk, generator=g)
    v = torch.randn(B, T, H, Dv, generator=g)
    decay = -torch.rand(B, T, H, generator=g) * 2
    beta = torch.rand(B, T, H, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, decay, beta)]


@pytest.mark.parametrize("T, chunk", [(1, 64), (37, 16), (64, 64), (131, 64)])
def test_chunked_rule_equals_the_recurrent_rule(T, chunk):
    q, k, v, g, beta = inputs(T=T)
    state = torch.randn(2, 3, 8, 6)
    out, final = delta_rule.gated_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    want, want_final = delta_rule.gated_delta_rule_recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, want_final, rtol=1e-5, atol=1e-5)


def test_chunked_rule_equals_transformers():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    q, k, v, g, beta = inputs(T=77)
    state = torch.randn(2, 3, 8, 6)
    out, final = delta_rule.gated_delta_rule(q, k, v, g, beta, state)
    want, want_final = torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(final, want_final, rtol=1e-6, atol=1e-6)


def test_state_splits_a_sequence():
    """Running the first part, then the rest from its final state, is running the whole: what decoding relies on."""
    q, k, v, g, beta = inputs(T=50)
    whole, _ = delta_rule.gated_delta_rule(q, k, v, g, beta)
    first, state = delta_rule.gated_delta_rule(*(t[:, :29] for t in (q, k, v, g, beta)))
    rest, _ = delta_rule.gated_delta_rule_recurrent(*(t[:, 29:] for t in (q, k, v, g, beta)), initial_state=state)
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, rtol=1e-5, atol=1e-5)


def test_convolution_with_a_window_and_lengths():
    x, w = torch.randn(3, 10, 5), torch.randn(5, 4)
    y, _ = delta_rule.causal_conv1d(x, w)
    first, window = delta_rule.causal_conv1d(x[:, :6], w)
    rest, _ = delta_rule.causal_conv1d(x[:, 6:], w, window)
    torch.testing.assert_close(torch.cat([first, rest], 1), y)
    lengths = torch.tensor([2, 6, 10])        # right padding past each row's length leaves its window as the row's end
    _, padded = delta_rule.causal_conv1d(x, w, lengths=lengths)
    for r, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(padded[r], delta_rule.causal_conv1d(x[r:r + 1, :n], w)[1][0])


def _docs():
    doc_ids = torch.tensor([[0] * 5 + [1] * 20 + [2] * 12, [0] * 37])     # row 0: three documents; row 1: one
    return doc_ids, [(0, 0, 5), (0, 5, 25), (0, 25, 37), (1, 0, 37)]


def test_packed_documents_equal_each_document_alone_forward_and_backward():
    doc_ids, spans = _docs()
    q, k, v, g, beta = inputs(requires_grad=True)
    x, w = torch.randn(2, 37, 7, requires_grad=True), torch.randn(7, 4, requires_grad=True)
    with ops.using("reference"):
        rows = delta_rule.PackedRows(doc_ids)
        packed = ops.gated_delta_rule(q, k, v, g, beta, rows)
        conv = ops.causal_conv1d(x, w, rows)
    (packed.square().sum() + conv.square().sum()).backward()
    grads = [t.grad.clone() for t in (q, k, v, g, beta, x, w)]
    for t in (q, k, v, g, beta, x, w):
        t.grad = None
    loss = 0
    for r, a, b in spans:
        alone, _ = delta_rule.gated_delta_rule(*(t[r:r + 1, a:b] for t in (q, k, v, g, beta)))
        torch.testing.assert_close(packed[r:r + 1, a:b], alone, rtol=1e-5, atol=1e-5)
        conv_alone, _ = delta_rule.causal_conv1d(x[r:r + 1, a:b], w)
        torch.testing.assert_close(conv[r:r + 1, a:b], conv_alone, rtol=1e-5, atol=1e-5)
        loss = loss + alone.square().sum() + conv_alone.square().sum()
    loss.backward()
    for got, t in zip(grads, (q, k, v, g, beta, x, w)):
        torch.testing.assert_close(got, t.grad, rtol=1e-4, atol=1e-5)


def test_an_answer_continues_its_shared_prompt_as_if_they_ran_together():
    """DPO's shared prompts (data.packing): [P1][A][B][P2][C] with A, B after P1 and C after P2 — each answer's
    convolution and rule equal running its prompt and itself as one sequence; forward and every gradient."""
    lengths, prompt_of = [70, 9, 66, 3, 40], [None, 0, 0, None, 3]      # documents 1..5 in one row, then padding
    doc_ids = torch.cat([torch.full((n,), d + 1) for d, n in enumerate(lengths)] + [torch.zeros(4, dtype=torch.long)])
    prefix = torch.cat([torch.full((n,), -1 if p is None else p + 1) for n, p in zip(lengths, prompt_of)]
                       + [torch.full((4,), -1)])
    doc_ids, prefix = doc_ids[None], prefix[None]
    T = doc_ids.shape[1]
    q, k, v, g, beta = inputs(B=1, T=T, requires_grad=True)
    x, w = torch.randn(1, T, 7, requires_grad=True), torch.randn(7, 4, requires_grad=True)
    with ops.using("reference"):
        rows = delta_rule.PackedRows(doc_ids, prefix)
        rule = ops.gated_delta_rule(q, k, v, g, beta, rows)
        conv = ops.causal_conv1d(x, w, rows)
    starts = [sum(lengths[:d]) for d in range(len(lengths))]
    for d, p in enumerate(prompt_of):
        span = list(range(starts[d], starts[d] + lengths[d]))
        context = ([] if p is None else list(range(starts[p], starts[p] + lengths[p]))) + span
        alone, _ = delta_rule.gated_delta_rule(*(t[:, context] for t in (q, k, v, g, beta)))
        torch.testing.assert_close(rule[:, span], alone[:, -len(span):], rtol=1e-5, atol=1e-5)
        conv_alone, _ = delta_rule.causal_conv1d(x[:, context], w)
        torch.testing.assert_close(conv[:, span], conv_alone[:, -len(span):], rtol=1e-5, atol=1e-5)
    # gradients: the packed loss against the same loss over each answer's own [prompt + answer] run
    (rule[:, :sum(lengths)].square().sum() + conv[:, :sum(lengths)].square().sum()).backward()
    packed_grads = [t.grad.clone() for t in (q, k, v, g, beta, x, w)]
    for t in (q, k, v, g, beta, x, w):
        t.grad = None
    loss = 0
    for d, p in enumerate(prompt_of):
        span = list(range(starts[d], starts[d] + lengths[d]))
        context = ([] if p is None else list(range(starts[p], starts[p] + lengths[p]))) + span
        alone, _ = delta_rule.gated_delta_rule(*(t[:, context] for t in (q, k, v, g, beta)))
        conv_alone, _ = delta_rule.causal_conv1d(x[:, context], w)
        loss = loss + alone[:, -len(span):].square().sum() + conv_alone[:, -len(span):].square().sum()
    loss.backward()
    for got, t in zip(packed_grads, (q, k, v, g, beta, x, w)):
        torch.testing.assert_close(got, t.grad, rtol=1e-4, atol=1e-5)
