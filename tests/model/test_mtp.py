"""GLM's multi-token prediction (MTP) layer run by our decoder (model/mtp.py): its logits against vLLM's definition
written out over transformers' own decoder layer, the draft-acceptance metric on cases built to agree and to
disagree, `mtp: train` (the layer moves, its loss falls) against `carry` (exported MTP bytes unchanged), and the
export of a trained layer (its LoRA merged into the MTP tensors, none of it in the PEFT adapter)."""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from glm_lora.configs.schema import Config, LoRAConfig
from glm_lora.data.packing import IGNORE, place
from glm_lora.engine.losses import PreferenceLoss, WithMTP
from glm_lora.evaluation.mtp import acceptance
from glm_lora.export.hf_peft import write_peft_adapter
from glm_lora.model import Decoder, DecoderConfig, inject_lora, merge_lora, mtp
from glm_lora.model.adapters import MTP_LORA, PEFT_WEIGHTS, load_policy, save_adapter, vllm_unservable
from glm_lora.model.heads import causal_lm_loss
from glm_lora.model.hf import load_hf, save_hf, save_native
from glm_lora.model.lora import lora_modules
from glm_lora.serve import vllm_server
from glm_lora.serve.stage import serving_notes
from tests.model import test_mla, test_moe

torch.set_num_threads(1)
VOCAB = 96


def checkpoint_with_mtp(d, hf, own: bool = False, dtype=torch.float32, seed: int = 7) -> dict[str, torch.Tensor]:
    """`hf`'s last decoder layer as the MTP block of a checkpoint one layer shorter (model.layers.{L}.*, L =
    num_hidden_layers, as GLM's are laid out), plus the MTP layer's own tensors (eh_proj, enorm, hnorm,
    shared_head.norm; with `own` its own embed_tokens and shared_head.head), those in `dtype`. Returns them all."""
    hf.save_pretrained(d)
    config = json.loads((d / "config.json").read_text())
    L = config["num_hidden_layers"] - 1
    for key, value in list(config.items()):            # per-layer lists (indexer_types, mlp_layer_types, ...)
        if key.endswith("types") and isinstance(value, list) and len(value) == L + 1:
            config[key] = value[:L]
    (d / "config.json").write_text(json.dumps(config | {"num_hidden_layers": L, "num_nextn_predict_layers": 1}))
    state = load_file(d / "model.safetensors")
    g, C = torch.Generator().manual_seed(seed), hf.config.hidden_size
    extra = {"eh_proj.weight": torch.randn(C, 2 * C, generator=g) * (2 * C) ** -0.5,
             **{f"{n}.weight": 1 + 0.3 * torch.randn(C, generator=g) for n in ("enorm", "hnorm", "shared_head.norm")}}
    if own:
        extra |= {"embed_tokens.weight": torch.randn(VOCAB, C, generator=g),
                  "shared_head.head.weight": torch.randn(VOCAB, C, generator=g) * C ** -0.5}
    layer = {k: v for k, v in state.items() if k.startswith(f"model.layers.{L}.")}
    layer |= {f"model.layers.{L}.{k}": v for k, v in extra.items()}
    layer = {k: v.to(dtype) for k, v in layer.items()}
    save_file({**state, **layer}, d / "model.safetensors", metadata={"format": "pt"})
    return layer


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def reference_logits(hf, layer: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """vLLM's Glm4MoeMultiTokenPredictorLayer.forward + compute_logits (glm4_moe_mtp.py), written out, with
    transformers' own decoder layer L as its mtp_block: slot t (position t) gets token t+1's embedding, zeroed at
    position 0, and the main model's final normed hidden state h_t; x = eh_proj([enorm(e) | hnorm(h)]); the block;
    logits = shared_head.head(shared_head.norm(block output)), head and embedding the model's where the layer has
    none. Mutates `hf` (its layer list)."""
    L, eps = hf.config.num_hidden_layers - 1, hf.config.rms_norm_eps
    w = {k.split(f"model.layers.{L}.", 1)[1]: v.float() for k, v in layer.items()}
    hf.config.num_hidden_layers = L                      # transformers runs layers[:num_hidden_layers]: the main model
    h = hf.model(ids, use_cache=False).last_hidden_state[:, :-1]
    positions = torch.arange(ids.shape[1] - 1)[None]
    e = F.embedding(ids[:, 1:], w.get("embed_tokens.weight", hf.model.embed_tokens.weight))
    e = torch.where(positions[..., None] == 0, 0, e)
    x = F.linear(torch.cat([rms(e, w["enorm.weight"], eps), rms(h, w["hnorm.weight"], eps)], -1), w["eh_proj.weight"])
    hf.model.layers = nn.ModuleList([hf.model.layers[L]])    # the block alone, then its final norm: shared_head.norm
    hf.config.num_hidden_layers = 1
    hf.model.norm.weight.copy_(w["shared_head.norm.weight"])
    out = hf.model(inputs_embeds=x, position_ids=positions, use_cache=False).last_hidden_state
    return F.linear(out, w.get("shared_head.head.weight", hf.lm_head.weight))


def our_logits(model: Decoder, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), mtp.using_layer(model) as layer:
        states = mtp.states(model, layer, model.hidden_states(ids), {"input_ids": ids})
        return F.linear(states, mtp.head_weight(model, layer))


CASES = {   # GLM-4.5 (MoE block, partial RoPE, q/k norm, bias), its own head and embedding, GLM-4.7-Flash (latent
    # attention), GLM-5 (latent attention whose MTP block has its own DSA indexer; 13 tokens > index_topk 5: sparse)
    "glm4_moe": lambda: test_moe.hf_model("grouped"),
    "glm4_moe_own_head": lambda: test_moe.hf_model("grouped"),
    "glm4_moe_lite": lambda: test_mla.hf_model("lite", "latent"),
    "glm_moe_dsa": lambda: test_mla.hf_model("dsa", "shared"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mtp_logits_equal_vllms_definition_over_transformers_layer(tmp_path, case):
    hf = CASES[case]()
    layer = checkpoint_with_mtp(tmp_path, hf, own=case.endswith("own_head"))
    ours = load_hf(tmp_path).eval()
    assert set(ours.carried) == set(layer)
    x = test_moe.ids(T=13)
    got, want = our_logits(ours, x), reference_logits(hf, layer, x)
    assert got.shape == (2, 12, VOCAB)
    assert (got - want).abs().max().item() <= (1e-4 if case == "glm_moe_dsa" else 1e-5)
    if case == "glm_moe_dsa":
        assert ours.attention_paths == {"sparse": 2}             # the main forward and the MTP block's
    with torch.no_grad():
        assert (got - ours(x)[:, 1:]).abs().max() > 0.1         # not the main model's logits at t+1


def one_layer_with_mtp(seed: int = 0) -> Decoder:
    """A 1-layer llama decoder with no attention (o_proj 0) and unit-RMS embeddings, and an MTP layer copying it:
    its eh_proj passes enorm(e) through, its block is layer 0, its head norm the final norm. Slot t then computes
    what the model computes at position t+1 (up to enorm's eps): its draft must be the model's greedy token."""
    torch.manual_seed(seed)
    model = Decoder(DecoderConfig(vocab_size=40, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                  intermediate_size=48, max_seq_len=64, num_nextn_predict_layers=1))
    layer = mtp.attach(model, fresh=True)
    with torch.no_grad():
        e = model.model.embed_tokens.weight
        e.copy_(e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True)))
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        for name, t in model.model.layers[0].state_dict().items():
            layer.state_dict()[name].copy_(t)
        layer.eh_proj.weight.copy_(torch.cat([torch.eye(32), torch.zeros(32, 32)], 1))
        layer.enorm.weight.fill_(1)
        layer.shared_head.norm.weight.copy_(model.model.norm.weight)
    mtp.detach(model)                   # the metric builds its layer from the carried tensors, as for an import
    return model


def examples(n: int = 6, seed: int = 1) -> list[tuple[list[int], list[int]]]:
    """Rows of random tokens whose first 3 are unlabelled (the prompt), so slot 0 (position 0: no input) has no
    target."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        ids = torch.randint(0, 40, (9 + k,), generator=g).tolist()
        out.append((ids, [IGNORE] * 3 + ids[3:]))
    return out


def test_acceptance_is_one_for_a_copied_mtp_layer_and_zero_for_a_shifted_head():
    model = one_layer_with_mtp()
    rows = examples()
    agree = acceptance(model, rows, seq_len=32)
    assert agree == {"mtp_acceptance": 1.0, "mtp_positions": sum(len(ids) - 3 for ids, _ in rows)}
    L = model.config.num_layers          # its own head: the model's rows shifted by one, so each draft is greedy + 1
    model.carried[f"model.layers.{L}.shared_head.head.weight"] = model.lm_head.weight.detach().roll(1, dims=0)
    assert acceptance(model, rows, seq_len=32)["mtp_acceptance"] == 0.0


def test_targets_are_the_labelled_tokens_two_ahead_within_a_document():
    docs = [(torch.arange(5).numpy(), torch.tensor([IGNORE, 1, 2, 3, 4]).numpy()),
            (torch.arange(10, 14).numpy(), torch.tensor([IGNORE, IGNORE, 12, 13]).numpy())]
    batch = place([docs], seq_len=10, group_size=1)
    keep = mtp.target_mask(batch)[0].tolist()          # slot t → token t+2; docs at 0..4 and 5..8, padding at 9
    assert keep == [True, True, True, False, False, True, True, False]
    assert mtp.target_mask(batch, docs=torch.tensor([2]))[0].tolist() == [False] * 5 + [True, True, False]


def tiny_with_mtp(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(DecoderConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                  intermediate_size=48, max_seq_len=64, num_nextn_predict_layers=1))
    mtp.attach(model, fresh=True)
    mtp.detach(model)
    return model


def test_the_preference_stage_trains_the_mtp_layer_on_the_chosen_answers_only():
    model = tiny_with_mtp()
    mtp.attach(model)
    inject_lora(model, LoRAConfig(r=4, alpha=8))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 40, (4,), generator=g)
    chosen, rejected = torch.randint(0, 40, (5,), generator=g), torch.randint(0, 40, (6,), generator=g)
    pair = [(torch.cat([prompt, a]).numpy(), torch.cat([torch.full((4,), IGNORE), a]).numpy()) for a in (chosen, rejected)]
    batch = place([pair], seq_len=24, group_size=2)
    loss, metrics = WithMTP(PreferenceLoss(), 0.3, chosen_only=True)(model, batch)
    _, count = mtp.mtp_loss(model, model.hidden_states(batch["input_ids"]), batch, docs=batch["group_docs"][:, 0])
    assert int(count) == 5                              # the chosen answer's 5 tokens (the rejected one's 6: none)
    assert loss.item() == pytest.approx(metrics["loss"].item()) and metrics["mtp_loss"] > 0
    loss.backward()
    assert model.mtp["2"].eh_proj.lora_B.weight.grad.abs().sum() > 0


def batches(n: int = 4, seed: int = 5) -> list[dict]:
    """Rows counting up from a random token (mod VOCAB): the token after next is learnable."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = (torch.randint(0, VOCAB, (4, 1), generator=g) + torch.arange(12)) % VOCAB
        labels = x.clone()
        labels[:, :3] = IGNORE
        out.append({"input_ids": x, "labels": labels})
    return out


def sft(model: Decoder, loss, steps: int = 24) -> list[float]:
    """A few AdamW steps of `loss` (the stage's) on fixed batches; the MTP loss after each."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    curve = []
    for step in range(steps):
        value, metrics = loss(model, batches()[step % 4])
        value.backward()
        opt.step()
        opt.zero_grad()
        curve.append(float(metrics.get("mtp_loss", 0.0)))
    return curve


@pytest.fixture(scope="module")
def glm45(tmp_path_factory):
    """A GLM-4.5 base (2 layers + an MoE MTP layer, model.layers.2, bf16 on disk as GLM ships it) imported into a
    native checkpoint."""
    d = tmp_path_factory.mktemp("glm45")
    layer = checkpoint_with_mtp(d / "hub", test_moe.hf_model("grouped"), dtype=torch.bfloat16)
    save_native(load_hf(d / "hub"), d / "base")
    return d, layer


def trained_adapter(base, out, mode: str):
    model = load_policy(base)
    loss = causal_lm_loss
    if mode == "train":
        mtp.attach(model)
        loss = WithMTP(causal_lm_loss, 0.3)
    lora = LoRAConfig(r=4, alpha=8)
    inject_lora(model, lora)
    torch.manual_seed(0)
    curve = sft(model, loss)
    out.mkdir()
    save_adapter(model, lora, out)
    return model, curve


def test_mtp_train_moves_the_layer_and_carry_exports_its_bytes_unchanged(glm45):
    d, layer = glm45
    trained, curve = trained_adapter(d / "base", d / "train", "train")
    assert curve[-1] < 0.8 * curve[0], curve                  # its loss falls ...
    moved = [n for n, m in lora_modules(mtp.attached(trained)).items()
             if any(p.abs().sum() > 0 for n2, p in m.named_parameters() if "lora_B" in n2)]
    assert {"eh_proj", "self_attn.q_proj", "mlp.experts"} <= set(moved)         # ... as its adapter trains
    assert any(k.startswith("mtp.2.") for k in load_file(d / "train" / "adapter.safetensors"))
    trained_adapter(d / "base", d / "carry", "carry")
    assert not any(k.startswith("mtp.") for k in load_file(d / "carry" / "adapter.safetensors"))
    carried = load_policy(d / "base", d / "carry")
    save_hf(carried, d / "export-carry", bos_id=None, eos_id=None, pad_id=None)
    exported = load_file(d / "export-carry" / "model.safetensors")
    assert all(exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], v) for k, v in layer.items())

    # train: exported = our merged module's weights (bf16, as carried), and not the import
    merged = mtp.attached(merge_lora(trained)).state_dict()
    save_hf(load_policy(d / "base", d / "train"), d / "export-train", bos_id=None, eos_id=None, pad_id=None)
    exported = load_file(d / "export-train" / "model.safetensors")
    assert set(layer) <= set(exported)
    for name in ("eh_proj.weight", "self_attn.q_proj.weight", "enorm.weight"):
        assert torch.equal(exported[f"model.layers.2.{name}"], merged[name].to(torch.bfloat16)), name
    gate_up = merged["mlp.experts.gate_up_proj"].to(torch.bfloat16)
    assert torch.equal(exported["model.layers.2.mlp.experts.5.up_proj.weight"], gate_up[5].chunk(2)[1])
    assert not torch.equal(exported["model.layers.2.eh_proj.weight"], layer["model.layers.2.eh_proj.weight"])
    assert torch.equal(exported["model.layers.2.enorm.weight"], layer["model.layers.2.enorm.weight"])  # no LoRA

    # the PEFT adapter: no MTP key (vLLM applies no LoRA to the draft); the MTP LoRA beside it; served merged
    write_peft_adapter(d / "train", d / "peft", str(d / "export-train"), moe=True, mtp=True)
    assert not any("layers.2." in k for k in load_file(d / "peft" / PEFT_WEIGHTS))
    assert any(k.startswith("base_model.model.model.layers.2.mlp.experts.5.") for k in load_file(d / "peft" / MTP_LORA))
    assert "MTP" in vllm_unservable(d / "peft")
    write_peft_adapter(d / "carry", d / "peft-carry", str(d / "export-carry"), moe=True, mtp=True)
    assert not (d / "peft-carry" / MTP_LORA).exists() and vllm_unservable(d / "peft-carry") is None


def test_mtp_train_is_refused_without_an_mtp_layer():
    model = Decoder(DecoderConfig(vocab_size=40, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                  intermediate_size=48))
    with pytest.raises(mtp.MTPError, match=r"sft.mtp: train needs a model with an MTP .* the base model \(x/config"
                                           r".json, num_nextn_predict_layers\) gives it none; set sft.mtp: carry"):
        mtp.require_mtp(model, "sft.mtp", "the base model (x/config.json, num_nextn_predict_layers)")


def test_the_flow_says_before_training_that_a_dpo_adapter_training_the_mtp_layer_is_served_merged(glm45, monkeypatch):
    monkeypatch.setattr(vllm_server, "vllm_device", lambda: "cuda")     # (vLLM's CPU build serves a MoE merged anyway)
    d, _ = glm45
    notes = serving_notes(Config(base_model=d / "hub", dpo={"mtp": "train"}, sft={"mtp": "train"},
                                 serve={"enabled": True}))
    assert len(notes) == 1 and notes[0].startswith("dpo.mtp: train: the DPO adapter will not be served as a LoRA")
    assert serving_notes(Config(base_model=d / "hub", sft={"mtp": "train"}, serve={"enabled": True})) == []
