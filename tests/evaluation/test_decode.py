"""The KV-cached greedy decoder (evaluation.decode.greedy_decode) gives the token ids of the decoder it
replaced (batched, the whole prefix re-run every step, kept here as the reference) and of Decoder.generate,
for every layout (GLM's interleaved partial RoPE and sandwich norms included), with a LoRA adapter,
ragged prompt lengths, several stop ids and prompts that fall back to the cropped path."""
from __future__ import annotations

import pytest
import torch

from glm_lora.evaluation.decode import _cropped_then_batches, _generate, _stop_set, greedy_decode
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from glm_lora.model.model import LAYOUTS, KVCache
from glm_lora.configs.schema import LoRAConfig


def uncached_greedy_decode(model, prompts, *, max_new_tokens, eos_id, batch_size=32):
    """The previous evaluation.decode.greedy_decode (before the KV cache): its batched loop verbatim."""
    stop = _stop_set(eos_id)
    device = model.lm_head.weight.device
    stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=device)
    out, batches = _cropped_then_batches(model, prompts, max_new_tokens, stop, batch_size)   # shared, not tested here
    for idx in batches:
        lens = torch.tensor([len(prompts[i]) for i in idx], device=device)
        buf = torch.zeros(len(idx), int(lens.max()) + max_new_tokens, dtype=torch.long, device=device)
        for r, i in enumerate(idx):
            buf[r, :len(prompts[i])] = torch.tensor(prompts[i])
        active = torch.arange(len(idx), device=device)
        for _ in range(max_new_tokens):
            width = int(lens[active].max())
            hidden = model.hidden_states(buf[active, :width])
            last = hidden[torch.arange(len(active), device=device), lens[active] - 1]
            nxt = model.lm_head(last).argmax(-1)
            buf[active, lens[active]] = nxt
            lens[active] += 1
            for r, t in zip(active.tolist(), nxt.tolist()):
                out[idx[r]].append(t)
            active = active[~torch.isin(nxt, stop_ids)]
            if len(active) == 0:
                break
    return out


def decoder(arch: str, seed: int, vocab: int = 50, max_seq_len: int = 48) -> Decoder:
    torch.manual_seed(seed)
    moe = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
               first_k_dense_replace=1) if LAYOUTS[arch].moe else {}
    if LAYOUTS[arch].mla:        # latent attention; DSA choosing 12 keys, fewer than most prompts + answers have
        moe |= dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
    if LAYOUTS[arch].dsa:     # 16 indexer heads: with few, many keys score exactly 0 after the ReLU, and which of
        # such tied keys torch.topk keeps depends on the row's length (padding), as in transformers
        moe |= dict(index_topk=12, index_head_dim=16, index_n_heads=16, indexer_types=("full", "shared"))
    if LAYOUTS[arch].linear_attention:     # one gated DeltaNet layer, one attention layer
        moe |= dict(layer_types=("linear_attention", "full_attention"), head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                    shared_expert_intermediate_size=32, first_k_dense_replace=0)
    model = Decoder(DecoderConfig(vocab_size=vocab, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                                  intermediate_size=96, max_seq_len=max_seq_len, arch=arch, **moe))
    with torch.no_grad():           # larger weights than the init: peaked logits, answers that vary by prompt
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(20)
    return model.eval()


def prompts(seed: int, n: int, vocab: int = 50) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (n,), generator=g).tolist() + [45, 40]   # the last two: the cropped path
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("arch", sorted(LAYOUTS))
def test_cached_decode_equals_the_uncached_decoder_and_generate(arch):
    model = decoder(arch, seed=1)
    ps = prompts(2, 21)
    stop = [3, 7]
    with torch.no_grad():
        got = greedy_decode(model, ps, max_new_tokens=12, eos_id=stop, batch_size=8)
        assert got == uncached_greedy_decode(model, ps, max_new_tokens=12, eos_id=stop, batch_size=8)
        assert got == [_generate(model, p, 12, set(stop)) for p in ps]
    assert any(len(t) < 12 for t in got) and any(len(t) == 12 for t in got)   # both stops and full lengths seen
    assert len({tuple(t) for t in got}) > 5                                       # not one answer for every prompt


def test_cached_decode_with_a_trained_lora_adapter():
    model = decoder("qwen3", seed=3)
    inject_lora(model, LoRAConfig(target_modules="all-linear", r=4, alpha=8, modules_to_save=["embed_tokens", "lm_head"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    ps = prompts(4, 13)
    with torch.no_grad():
        got = greedy_decode(model, ps, max_new_tokens=9, eos_id=None, batch_size=5)
        assert got == uncached_greedy_decode(model, ps, max_new_tokens=9, eos_id=None, batch_size=5)
    assert all(len(t) == 9 for t in got)


def test_cache_logits_match_a_full_forward():
    """Each cached step's hidden state is the full forward's at that position (rows of different lengths)."""
    model = decoder("glm4", seed=5)
    ids = torch.randint(0, 50, (3, 20), generator=torch.Generator().manual_seed(6))
    lens = torch.tensor([7, 12, 9])
    cache = KVCache(20)
    with torch.no_grad():
        full = model.hidden_states(ids)                                                  # (3, 20, C)
        pre = torch.where(torch.arange(12) < lens[:, None], ids[:, :12], 0)              # right-padded prompts
        model.hidden_states(pre, torch.arange(12).expand(3, 12), cache=cache)
        pos = lens.clone()
        for _ in range(6):
            h = model.hidden_states(ids[torch.arange(3), pos][:, None], pos[:, None], cache=cache)[:, 0]
            torch.testing.assert_close(h, full[torch.arange(3), pos], rtol=1e-5, atol=1e-5)
            pos += 1


@pytest.mark.parametrize("arch", sorted(LAYOUTS))
def test_cached_decode_under_bf16_autocast(arch):
    """Under autocast (the GPU default, the CPU default on AMX) a q/k-normed layout's keys leave the fp32 RMSNorm while
    its values are bf16: the cache keeps each in its own dtype (it raised at the first decode step for qwen3), and
    the greedy ids equal the uncached decoder's under the same autocast."""
    from glm_lora.evaluation.decode import sample_decode
    model, ps = decoder(arch, 5), prompts(6, 6)[:6]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = greedy_decode(model, ps, max_new_tokens=6, eos_id=None)
        want = uncached_greedy_decode(model, ps, max_new_tokens=6, eos_id=None)
        sampled = sample_decode(model, ps, max_new_tokens=6, eos_id=None, temperature=1.0,
                                generator=torch.Generator().manual_seed(0))
    assert got == want
    assert [len(s) for s in sampled] == [6] * len(ps)
