"""Qwen3.5 in our decoder (gated DeltaNet beside gated attention; the MoE variant): transformers' own classes at
random init give the same logits in fp32 on three shapes, and packed rows equal each document run alone — logits and
the LoRA gradients — so no state or convolution window crosses a document boundary."""
from __future__ import annotations

import pytest
import torch
import transformers

from glm_lora.configs.schema import LoRAConfig
from glm_lora.model.lora import inject_lora
from glm_lora.model.model import Decoder, DecoderConfig

SHAPES = [  # (hidden, heads, kv heads, head_dim, linear key heads, value heads, key dim, value dim, layer_types)
    (64, 4, 2, 16, 2, 4, 8, 12, ("linear_attention", "full_attention", "linear_attention", "full_attention")),
    (48, 2, 1, 32, 2, 2, 16, 8, ("linear_attention", "linear_attention", "linear_attention", "full_attention")),
    (96, 6, 3, 16, 1, 3, 12, 16, ("full_attention", "linear_attention", "linear_attention")),
]


def pair(shape, moe: bool, seed: int = 0):
    """transformers' model at random init (weights scaled up: peaked logits; norms off their zero-centred init) and
    ours holding its weights."""
    C, H, KV, D, LK, LV, DK, DV, types = shape
    torch.manual_seed(seed)
    hf = dict(vocab_size=96, hidden_size=C, intermediate_size=80, num_hidden_layers=len(types), num_attention_heads=H,
              num_key_value_heads=KV, head_dim=D, linear_num_key_heads=LK, linear_num_value_heads=LV,
              linear_key_head_dim=DK, linear_value_head_dim=DV, layer_types=list(types))
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
    if moe:
        theirs = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**hf, **experts))
    else:
        theirs = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**hf))
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.normal_(0, 0.2) if "norm" in name else p.mul_(4) if p.ndim >= 2 else None
    ours = Decoder(DecoderConfig(
        vocab_size=96, hidden_size=C, intermediate_size=80, num_layers=len(types), num_heads=H, num_kv_heads=KV,
        head_dim=D, rms_norm_eps=1e-6, arch="qwen3_5_moe_text" if moe else "qwen3_5_text", layer_types=types,
        linear_num_key_heads=LK, linear_num_value_heads=LV, linear_key_head_dim=DK, linear_value_head_dim=DV,
        **({"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 40} if moe else {})))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs.eval(), ours.eval()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_logits_equal_transformers(shape, moe):
    theirs, ours = pair(SHAPES[shape], moe)
    ids = torch.randint(0, 96, (2, 67), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs(ids).logits, ours(ids)
    assert want.abs().max() > 1                                     # not near-zero logits
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_packed_rows_equal_each_document_alone(moe):
    _, model = pair(SHAPES[0], moe)
    inject_lora(model, LoRAConfig(target_modules="all-linear", r=4, alpha=8))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    ids = torch.randint(0, 96, (1, 90), generator=torch.Generator().manual_seed(2))
    spans = [(0, 7), (7, 71), (71, 90)]                              # a short one, one past a 64-token chunk, a tail
    doc_ids = torch.cat([torch.full((b - a,), d) for d, (a, b) in enumerate(spans)])[None]
    positions = torch.cat([torch.arange(b - a) for a, b in spans])[None]
    packed = model(ids, positions, doc_ids)
    packed.square().mean().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    alone = [model(ids[:, a:b]) for a, b in spans]
    sum(a.square().sum() for a in alone).div(packed.numel()).backward()
    for (a, b), logits in zip(spans, alone):
        torch.testing.assert_close(packed[:, a:b], logits, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    assert any("linear_attn.in_proj_qkv.lora_A" in n for n in packed_grads)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_shared_prompt_gives_each_answer_what_prompt_and_answer_give_alone(moe):
    """DPO places a pair's prompt once ([prompt][chosen][rejected], data.packing's prefix_docs): through gated DeltaNet
    and the attention layers, each answer's logits equal those of its prompt followed by it, run alone."""
    _, model = pair(SHAPES[0], moe)
    P, A, B = 70, 12, 30
    ids = torch.randint(0, 96, (1, P + A + B), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.tensor([[1] * P + [2] * A + [3] * B])
    prefix = torch.tensor([[-1] * P + [1] * (A + B)])
    positions = torch.cat([torch.arange(P), torch.arange(P, P + A), torch.arange(P, P + B)])[None]
    with torch.no_grad():
        packed = model.hidden_states(ids, positions, doc_ids, prefix_docs=prefix)
        for a, b in ((P, P + A), (P + A, P + A + B)):
            alone = model.hidden_states(torch.cat([ids[:, :P], ids[:, a:b]], 1))
            torch.testing.assert_close(packed[:, a:b], alone[:, P:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[:, :P], model.hidden_states(ids[:, :P]), rtol=1e-5, atol=1e-5)
