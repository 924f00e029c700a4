"""GLM-4.7-Flash (glm4_moe_lite: multi-head latent attention + experts) and GLM-5 (glm_moe_dsa: latent attention
with DeepSeek sparse attention + experts): our decoder against transformers' own classes (random init, no downloads)
in fp32 — logits with the indexer choosing fewer keys than the sequence has (full and shared indexer layers), cached
decoding, packed documents, export round trip with the MTP layer carried, LoRA targets — and the config keys we
refuse, named with their file.

Tie rule of the indexer: keys whose scores are equal are chosen as torch.topk chooses them, in ours as in
transformers' (the same fp32 scores); the shapes here have no exact ties at the k-th score."""
import json

import pytest
import torch
from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from glm_lora.configs.schema import LoRAConfig
from glm_lora.evaluation.decode import greedy_decode
from glm_lora.kernels import reference
from glm_lora.model.hf import BaseModelError, load_hf, read_hf_config
from glm_lora.model.lora import LoRAConfigError, inject_lora, merge_lora
from tests.model.test_moe import round_trip_with_mtp

torch.set_num_threads(1)
VOCAB = 96

_MLA = dict(q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
_DSA = dict(_MLA, index_head_dim=16, index_n_heads=2)
LITE = {   # GLM-4.7-Flash's switches: a query latent or one q_proj, attention bias, dense layers, v ≠ k width
    "latent": dict(_MLA, num_hidden_layers=3),
    "no_q_latent": dict(_MLA, q_lora_rank=None, num_hidden_layers=2, mlp_layer_types=["dense", "sparse"]),
    "bias_two_dense": dict(_MLA, kv_lora_rank=40, v_head_dim=20, attention_bias=True, num_hidden_layers=3,
                           mlp_layer_types=["dense", "dense", "sparse"]),
}
DSA = {    # GLM-5's: full and shared indexer layers, top-k well below the sequence, top-1, wider indexer heads
    "shared": dict(_DSA, index_topk=5, num_hidden_layers=3, first_k_dense_replace=1,
                   indexer_types=["full", "shared", "full"]),
    "top1": dict(_DSA, index_topk=1, num_hidden_layers=2, first_k_dense_replace=0),
    "two_shared": dict(_DSA, index_topk=7, index_head_dim=24, index_n_heads=4, num_hidden_layers=3,
                       first_k_dense_replace=1, indexer_types=["full", "shared", "shared"], attention_bias=True),
}


def hf_model(kind: str, shape: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config_class, model_class = ((Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM) if kind == "lite"
                                 else (GlmMoeDsaConfig, GlmMoeDsaForCausalLM))
    shape_kwargs = {**(LITE if kind == "lite" else DSA)[shape], **overrides}
    model = model_class(config_class(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
        initializer_range=0.1, **shape_kwargs)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():      # what random init leaves flat: norms at 1, biases at 0
        for n, p in model.named_parameters():
            if "norm" in n and n.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif n.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5, generator=g)
    return model


def ids(B=2, T=13, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


CASES = [("lite", s) for s in sorted(LITE)] + [("dsa", s) for s in sorted(DSA)]


@pytest.mark.parametrize("kind, shape", CASES)
def test_imported_logits_equal_transformers(tmp_path, kind, shape):
    hf = hf_model(kind, shape)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    x = ids()
    with torch.no_grad():
        diff = (ours(x) - hf(x).logits).abs().max().item()
    assert diff <= (1e-4 if kind == "dsa" else 1e-5), diff
    if kind == "dsa":                # 13 tokens, top-k ≤ 7: the sparse path, not the dense one
        assert ours.attention_paths == {"sparse": 1}


def test_dsa_takes_the_dense_path_while_every_document_fits_in_top_k(tmp_path):
    hf = hf_model("dsa", "shared", index_topk=16)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    x = ids(T=16)
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max().item() <= 1e-5
        ours(torch.cat([x, x], dim=1), doc_ids=torch.tensor([[1] * 16 + [2] * 16] * 2))   # 32 tokens, documents of 16
    assert ours.attention_paths == {"dense": 2}


def test_packed_documents_equal_each_document_alone_on_the_sparse_path(tmp_path):
    """Two documents longer than index_topk in one row: each query's keys stay in its own document and before it.
    16 indexer heads: with the tiny default of 2, many keys score exactly 0 after the ReLU, and such ties fall as
    torch.topk breaks them, which depends on where the keys sit in the row."""
    hf_model("dsa", "shared", index_n_heads=16).save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    a, b = ids(B=1, T=11, seed=2), ids(B=1, T=9, seed=3)
    row = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(11), torch.arange(9)])[None]
    docs = torch.tensor([[1] * 11 + [2] * 9])
    with torch.no_grad():
        packed = ours(row, positions, docs)
        alone = torch.cat([ours(a), ours(b)], dim=1)
    assert ours.attention_paths == {"sparse": 3}
    assert (packed - alone).abs().max().item() <= 1e-5
    q, k, w = torch.randn(1, 20, 2, 16), torch.randn(1, 20, 16), torch.rand(1, 20, 2)
    chosen = reference.index_topk(q, k, w, docs, 5, 0.25)
    t = torch.arange(20)[None, :, None]
    valid = chosen >= 0
    assert (chosen[valid] <= t.expand_as(chosen)[valid]).all()                       # never a future key
    assert (docs[0][chosen.clamp(min=0)][valid] == docs[0][t.expand_as(chosen)][valid]).all()   # nor another doc's


@pytest.mark.parametrize("kind, shape", [("lite", "latent"), ("dsa", "shared")])
def test_cached_greedy_decoding_gives_transformers_tokens(tmp_path, kind, shape):
    """Batched decoding with our KV cache (and DSA's indexer-key cache) past index_topk = transformers' generate."""
    hf = hf_model(kind, shape)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    prompts = [[5, 7, 9, 11, 3, 2, 8], [4, 4, 1]]
    fast = greedy_decode(ours, prompts, max_new_tokens=10, eos_id=None)
    with torch.no_grad():
        theirs = [hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, len(p):]
                  .tolist() for p in prompts]
    assert fast == theirs


@pytest.mark.parametrize("kind, shape", [("lite", "no_q_latent"), ("dsa", "two_shared")])
def test_export_round_trip_with_the_mtp_layer_carried_unchanged(tmp_path, kind, shape):
    """transformers' loader skips MTP layers (`_keys_to_ignore_on_load_unexpected`): ours carries them to every export."""
    hf = hf_model(kind, shape)
    hf.config.num_nextn_predict_layers = 1
    _, reloaded = round_trip_with_mtp(hf, tmp_path)
    x = ids()
    with torch.no_grad():
        assert (reloaded(x).logits - hf(x).logits).abs().max().item() <= 1e-5


def test_lora_reaches_every_latent_projection_and_the_experts_never_the_indexer(tmp_path):
    hf_model("dsa", "shared").save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    wrapped = inject_lora(model, LoRAConfig(r=4, alpha=8))
    ends = {w.rsplit(".", 1)[-1] for w in wrapped}
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "down_proj"} <= ends
    assert any(".mlp.experts." in w for w in wrapped) and not any(".indexer." in w for w in wrapped)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    x = ids()
    model.train()
    model(x).sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():
        adapted = model(x)
        merged = merge_lora(model)(x)
    assert (adapted - merged).abs().max().item() <= 1e-4
    with pytest.raises(LoRAConfigError, match=r"\['wk'\] names the DSA indexer, which stays frozen"):
        inject_lora(load_hf(tmp_path), LoRAConfig.model_construct(**{**LoRAConfig().model_dump(),
                                                                     "target_modules": ["q_a_proj", "wk"]}))
    with pytest.raises(ValueError, match="name the DSA indexer"):
        LoRAConfig(target_modules=["weights_proj"])


def _write_config(d, kind, **changes):
    hf_model(kind, "latent" if kind == "lite" else "shared").save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | changes))        # None: null in the file
    return d / "config.json"


@pytest.mark.parametrize("kind, changes, message", [
    ("lite", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
     "rope type 'yarn' is not supported"),
    ("lite", {"num_key_value_heads": 2}, "num_key_value_heads 2 != num_attention_heads 4"),
    ("lite", {"rope_interleave": False}, "rope_interleave False is not supported"),
    ("lite", {"mlp_layer_types": ["sparse", "dense", "sparse"]}, "mlp_layer_types ['sparse', 'dense', 'sparse']"),
    ("dsa", {"q_lora_rank": None}, "q_lora_rank None is not supported for model_type 'glm_moe_dsa'"),
    ("dsa", {"indexer_types": ["shared", "full", "full"]}, "indexer_types ['shared', 'full', 'full'] is not supported"),
    ("dsa", {"index_topk": 0}, "index_topk 0 must be a positive integer"),
    ("dsa", {"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported for model_type 'glm_moe_dsa'"),
])
def test_keys_we_cannot_reproduce_are_refused_naming_key_and_file(tmp_path, kind, changes, message):
    path = _write_config(tmp_path, kind, **changes)
    with pytest.raises(BaseModelError) as e:
        read_hf_config(tmp_path)
    assert message in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_absorbed_sparse_attention_equals_the_expanded_form_with_lora_on_kv_b_proj(tmp_path, monkeypatch, kernel):
    """The sparse path folds kv_b_proj (its LoRA included) into queries and outputs: same logits and gradients as the
    expanded per-head keys and values; `triton`: our sparse attention kernel in both (Triton's interpreter on the
    CPU), every other op the reference."""
    from glm_lora.kernels import ops as kernels
    from glm_lora.kernels import triton_sparse_attention
    from glm_lora.model import model as decoder
    if kernel == "triton":
        monkeypatch.setattr(kernels, "sparse_attention", triton_sparse_attention.sparse_attention)
    hf_model("dsa", "two_shared").save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    inject_lora(ours, LoRAConfig(r=4, alpha=8))
    for n, p in ours.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    x = ids(B=1, T=15)
    runs = []
    for absorbed in (False, True):
        monkeypatch.setitem(decoder.ABSORBED_SPARSE, "cpu", absorbed)
        ours.zero_grad()
        with kernels.using("reference"):
            y = ours(x)
        y.square().mean().backward()
        runs.append((y.detach(), {n: p.grad.clone() for n, p in ours.named_parameters() if p.requires_grad}))
    (expanded, g1), (absorbed, g2) = runs
    assert (expanded - absorbed).abs().max().item() <= 1e-5
    assert max((g1[n] - g2[n]).abs().max().item() for n in g1) <= 1e-6
    assert ours.attention_paths == {"sparse": 2}
