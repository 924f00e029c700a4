"""model/model.py: shapes, causality, tying, config I/O and greedy generation parity."""
import pytest
import torch

from glm_lora.model import Decoder, DecoderConfig
from glm_lora.model.hf import save_hf
from glm_lora.configs.schema import LoRAConfig

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

VOCAB = 211


def tiny(seed=0, **kw) -> Decoder:
    torch.manual_seed(seed)
    base = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                max_seq_len=32)
    # A larger init makes greedy continuations varied instead of one repeated token.
    model = Decoder(DecoderConfig(**{**base, **kw})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(10)
    return model


def test_forward_shapes_and_head():
    m = tiny()
    x = torch.randint(0, VOCAB, (3, 9))
    h = m.hidden_states(x)
    assert h.shape == (3, 9, 32)
    logits = m(x)
    assert logits.shape == (3, 9, VOCAB)
    torch.testing.assert_close(logits, m.lm_head(h))


def test_causal_future_tokens_do_not_change_past_logits():
    m = tiny()
    x = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[0, 6:] = (y[0, 6:] + 1) % VOCAB
    with torch.no_grad():
        a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :6], b[:, :6], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_position_ids_matter_and_default_to_arange():
    m = tiny()
    x = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(m(x), m(x, torch.arange(7).expand(2, 7)))
        assert not torch.allclose(m(x), m(x, torch.arange(7).expand(2, 7) + 5))


def test_tied_embeddings_share_one_parameter():
    m = tiny(tie_embeddings=True)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    untied = tiny(tie_embeddings=False)
    assert m.num_params() == untied.num_params() - VOCAB * 32


def test_config_dict_round_trip_ignores_unknown_keys():
    cfg = DecoderConfig(vocab_size=99, hidden_size=64, num_heads=8, num_kv_heads=4, tie_embeddings=True)
    assert cfg.head_dim == 8
    assert DecoderConfig.from_dict({**cfg.to_dict(), "future_field": 1}) == cfg


def test_num_params_trainable_only():
    m = tiny()
    total = m.num_params()
    m.lm_head.weight.requires_grad_(False)
    assert m.num_params(trainable_only=True) == total - VOCAB * 32
    assert m.num_params() == total


def argmax_loop(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_generate_greedy_equals_argmax_loop():
    m = tiny()
    prompt = [5, 17, 99, 3]
    out = m.generate(prompt, max_new_tokens=12)
    assert len(out) == 12
    assert out == argmax_loop(m, prompt, 12)
    assert len(set(out)) > 1      # not a degenerate constant continuation


def test_generate_stops_at_eos_and_includes_it():
    m = tiny()
    prompt = [5, 17, 99, 3]
    full = m.generate(prompt, max_new_tokens=12)
    eos = full[3]
    first = full.index(eos)
    assert m.generate(prompt, max_new_tokens=12, eos_id=eos) == full[:first + 1]


def test_generate_past_max_seq_len_uses_a_window():
    m = tiny(max_seq_len=16)
    prompt = list(range(1, 15))
    out = m.generate(prompt, max_new_tokens=6)
    assert len(out) == 6
    ids = prompt + out
    with torch.no_grad():   # the last token was chosen from the last 16 tokens only
        assert out[-1] == int(m(torch.tensor([ids[-17:-1]]))[0, -1].argmax())


def _greedy_both(m, tmp_path, prompt=(7, 8, 9, 100, 42)) -> tuple[list[int], list[int]]:
    """Our greedy continuation and transformers' generate() on the exported model."""
    from transformers import AutoModelForCausalLM
    save_hf(m, tmp_path, bos_id=None, eos_id=None, pad_id=None)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert theirs[0, :len(prompt)].tolist() == list(prompt)
    return m.generate(list(prompt), max_new_tokens=10), theirs[0, len(prompt):].tolist()


@pytest.mark.parametrize("tie", [False, True])
def test_generate_matches_transformers_greedy(tmp_path, tie):
    m = tiny(tie_embeddings=tie, seed=2)
    ours, theirs = _greedy_both(m, tmp_path)
    assert ours == theirs


@pytest.mark.parametrize("lora", [False, True])
def test_activation_checkpointing_gives_the_same_loss_and_grads(lora):
    from glm_lora.model import inject_lora
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 12))
    runs = []
    for ckpt in (False, True):
        m = tiny()
        if lora:
            inject_lora(m, LoRAConfig(target_modules=["q_proj", "down_proj"], r=4, alpha=8))
            for mod in m.modules():       # a non-zero B so the adapter's gradients are non-trivial
                if hasattr(mod, "lora_B"):
                    torch.nn.init.normal_(mod.lora_B.weight, std=0.1, generator=torch.Generator().manual_seed(1))
        m.gradient_checkpointing = ckpt
        m.train()
        m(ids).float().pow(2).mean().backward()
        runs.append({n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad})
    assert runs[0].keys() == runs[1].keys() and runs[0]
    for n in runs[0]:
        torch.testing.assert_close(runs[1][n], runs[0][n], atol=1e-6, rtol=1e-5, msg=n)


def test_activation_checkpointing_saves_fewer_activations():
    ids = torch.randint(0, 50, (2, 12))
    saved = {}
    for ckpt in (False, True):
        m = tiny()
        m.gradient_checkpointing = ckpt
        m.train()
        count = [0]

        def pack(t):
            count[0] += t.numel()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(ids).sum()
        saved[ckpt] = count[0]
    assert saved[True] < 0.5 * saved[False]


# ---------------------------------------------------------------- layouts (DecoderConfig.arch)

def test_layouts_build_the_modules_of_their_hf_architecture():
    shape = dict(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=96, num_layers=1)
    names = {arch: {n for n, _ in tiny(arch=arch, **shape).named_parameters()} for arch in
             ("llama", "qwen2", "qwen3", "glm", "glm4")}
    layer = "model.layers.0."
    assert layer + "mlp.gate_proj.weight" in names["llama"] and layer + "self_attn.q_proj.bias" not in names["llama"]
    assert names["qwen2"] - names["llama"] == {layer + f"self_attn.{x}_proj.bias" for x in "qkv"}
    assert names["qwen3"] - names["llama"] == {layer + "self_attn.q_norm.weight", layer + "self_attn.k_norm.weight"}
    assert {layer + "mlp.gate_up_proj.weight", layer + "self_attn.v_proj.bias"} <= names["glm"]
    assert layer + "mlp.gate_proj.weight" not in names["glm"] and layer + "self_attn.o_proj.bias" not in names["glm"]
    assert names["glm4"] - names["glm"] == {layer + "post_self_attn_layernorm.weight", layer + "post_mlp_layernorm.weight"}


def test_glm_config_defaults_and_rotary_dim():
    cfg = DecoderConfig(vocab_size=9, hidden_size=64, num_heads=2, num_kv_heads=1, arch="glm4")
    assert (cfg.attention_bias, cfg.partial_rotary_factor, cfg.rotary_dim) == (True, 0.5, 16)
    assert DecoderConfig.from_dict(cfg.to_dict()) == cfg
    assert DecoderConfig(vocab_size=9, hidden_size=64, num_heads=2, arch="glm", partial_rotary_factor=0.25).rotary_dim == 8
    assert DecoderConfig(vocab_size=9, hidden_size=24, num_heads=2, num_kv_heads=1, arch="glm").rotary_dim == 6
    with pytest.raises(ValueError, match="even number of rotated dims"):
        DecoderConfig(vocab_size=9, hidden_size=20, num_heads=2, num_kv_heads=1, arch="glm")


# ---------------------------------------------------------------- GLM RoPE: interleaved, partial

# The Triton kernel computes in fp32 whatever the input dtype, so it is held to fp32 inputs.
@pytest.mark.parametrize("impl, dtype", [("reference", torch.float32), ("reference", torch.float64),
                                         ("triton", torch.float32)])
@pytest.mark.parametrize("D, factor", [(32, 0.5), (12, 0.5), (16, 1.0), (32, 0.25)])
def test_glm_rope_matches_transformers(D, factor, impl, dtype):
    """Our tables + apply_rope(interleaved=True) (the reference, and the Triton kernel under the interpreter)
    against modeling_glm4's own, forward and gradients."""
    from transformers import Glm4Config
    from transformers.models.glm4.modeling_glm4 import Glm4RotaryEmbedding, apply_rotary_pos_emb
    from glm_lora.kernels import reference as ref, triton_rope
    apply_rope = {"reference": ref.apply_rope, "triton": triton_rope.apply_rope}[impl]
    B, H, Hkv, T = 2, 3, 1, 7
    cfg = Glm4Config(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D,
                     max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                                  "partial_rotary_factor": factor})
    pos = torch.stack([torch.arange(T) + 4 * b for b in range(B)])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, generator=g, dtype=dtype, requires_grad=True)
    cos, sin = ref.rope_cos_sin(pos, int(D * factor), 500.0, interleaved=True)
    hcos, hsin = Glm4RotaryEmbedding(cfg)(q, pos)            # rotate-half tables; GLM re-lays them inside
    oq, ok = apply_rope(q, k, cos.to(dtype), sin.to(dtype), True)
    tq, tk = apply_rotary_pos_emb(q, k, hcos, hsin)
    torch.testing.assert_close(oq, tq, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ok, tk, atol=1e-6, rtol=1e-6)
    if factor < 1:
        torch.testing.assert_close(oq[..., int(D * factor):], q[..., int(D * factor):])   # the rest passes through
    ours = torch.autograd.grad(oq.pow(2).sum() + (ok * 3).sum(), (q, k))
    theirs = torch.autograd.grad(tq.pow(2).sum() + (tk * 3).sum(), (q, k))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_rope_dispatch_sends_every_layout_to_the_triton_kernel(monkeypatch):
    """kernels: triton takes the kernel for GLM's interleaved and partial tables as for whole-head halves."""
    from glm_lora.kernels import ops as kernels
    calls = []
    monkeypatch.setattr(kernels, "_triton_op", lambda name: (calls.append(name), lambda *a: a[-1])[1])
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 1, 5, 16)
    pos = torch.arange(5)[None]
    with kernels.using("triton"):
        for rotary, interleaved in ((16, True), (8, True), (8, False), (16, False)):
            cos, sin = kernels.rope_cos_sin(pos, rotary, 1e4, interleaved=interleaved)
            assert kernels.apply_rope(q, k, cos, sin, interleaved=interleaved) is interleaved
    assert calls == ["apply_rope"] * 4


@pytest.mark.parametrize("arch", ["glm", "glm4"])
def test_glm_generate_matches_transformers_greedy(tmp_path, arch):
    m = tiny(arch=arch, hidden_size=64, num_heads=2, num_kv_heads=1, seed=2)
    ours, theirs = _greedy_both(m, tmp_path)
    assert ours == theirs and len(set(ours)) > 1


def test_shapes_only_builds_on_meta_without_initialisers_and_puts_them_back():
    import torch.nn as nn
    from glm_lora.model.model import shapes_only
    before = nn.init.normal_
    with shapes_only():
        model = Decoder(DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                                      num_kv_heads=1, max_seq_len=16))
        real = nn.init.normal_(torch.zeros(4, 4, device="cpu"), std=1.0)   # e.g. another thread's model: initialised
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert real.abs().sum() > 0
    assert nn.init.normal_ is before
    with torch.no_grad():
        real = torch.empty(4, 4)
        assert nn.init.normal_(real.zero_(), std=1.0).abs().sum() > 0        # initialisers work again
