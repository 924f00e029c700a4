"""QLoRA (`lora.quantization: nf4`): the LoRA linear over a 4-bit base (kernels/qlora.py), the LoRALinear
that holds it (model/lora.py), and a short SFT of the tiny model against the full-precision base."""
import copy
import json
import math
import shutil

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from glm_lora.kernels import ops as kernels
from glm_lora.kernels import reference
from glm_lora.model import Decoder, DecoderConfig, inject_lora, lora_disabled, lora_state_dict, merge_lora
from glm_lora.model.lora import LoRAConfigError, LoRALinear, lora_modules
from glm_lora.model.quant import NF4Weight, quantize_nf4
from tests.model.test_lora import VOCAB, ids, randomise_b
from tests.kernel_check import Tol, check, close, lora_inputs, masked_lora_reference
from glm_lora.configs.schema import LoRAConfig

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

SCALE = 2.0
# dtype -> tolerance against a float64 reference on the same (dequantised) weight
TOL = {torch.float32: Tol(1e-5, 1e-4, scaled=True), torch.bfloat16: Tol(2e-2, 3e-2, scaled=True)}
# (leading dims, in, out, r); in × out a multiple of 64, odd sides
SHAPES = [((2, 5), 33, 64, 3), ((13,), 64, 48, 16), ((3, 1, 7), 50, 96, 8)]


class Counted:
    """A 4-bit weight that counts its dequantisations."""

    def __init__(self, q: NF4Weight):
        self.q, self.calls = q, 0

    def dequantize(self, dtype=None):
        self.calls += 1
        return self.q.dequantize(dtype)


def qlora_inputs(lead, k, n, r, dtype, seed=0):
    x, w, a, b, dy = lora_inputs(lead, k, n, r, dtype, seed)
    q = quantize_nf4(w)
    return x, q, q.dequantize(torch.float64), a, b, dy


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("lead,k,n,r", SHAPES)
def test_forward_and_gradients_match_the_reference_on_the_dequantised_weight(lead, k, n, r, dtype, backend):
    x, q, w, a, b, dy = qlora_inputs(lead, k, n, r, dtype)
    with kernels.using(backend):
        (out,), _ = check(lambda x, a, b: kernels.nf4_lora_linear(x, q, a, b, SCALE),
                          lambda x, a, b: reference.lora_linear(x, w, a, b, SCALE), (x, a, b), TOL[dtype],
                          grad_outputs=(dy,))
    assert out.shape == (*lead, n)


def test_dropout_matches_the_masked_reference():
    p, (lead, k, n, r) = 0.3, SHAPES[2]
    x, q, w, a, b, dy = qlora_inputs(lead, k, n, r, torch.float32)
    torch.manual_seed(7)
    keep = torch.rand(math.prod(lead), k) >= p              # the draw the forward makes first
    torch.manual_seed(7)
    check(lambda x, a, b: kernels.nf4_lora_linear(x, q, a, b, SCALE, dropout=p, training=True),
          lambda x, a, b: masked_lora_reference(x, w, a, b, SCALE, keep, p), (x, a, b), TOL[torch.float32],
          grad_outputs=(dy,))
    with torch.no_grad():                                    # eval: no dropout
        close(kernels.nf4_lora_linear(x, q, a, b, SCALE, dropout=p, training=False).double(),
              reference.lora_linear(x.double(), w, a.double(), b.double(), SCALE), TOL[torch.float32])


def test_no_full_size_weight_is_kept_for_backward():
    """Saved for backward: nothing as large as W (out × in); W is dequantised again in backward."""
    x, q, w, a, b, dy = qlora_inputs((5,), 64, 128, 4, torch.float32)
    saved = []

    def sizes(fn):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            return fn()
    counted = Counted(q)
    y = sizes(lambda: kernels.nf4_lora_linear(x, counted, a, b, SCALE))
    assert saved and max(saved) < w.numel() and counted.calls == 1
    y.backward(dy)
    assert counted.calls == 2 and x.grad is not None and a.grad is not None and b.grad is not None
    sizes(lambda: reference.lora_linear(x, w.float(), a, b, SCALE))     # the unquantised path keeps W: seen
    assert max(saved) == w.numel()


def test_autocast_dequantises_into_the_autocast_dtype():
    x, q, w, a, b, dy = qlora_inputs((4,), 64, 64, 4, torch.float32)
    dtypes = []
    counted = Counted(q)
    counted.dequantize = lambda dtype=None: dtypes.append(dtype) or q.dequantize(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = kernels.nf4_lora_linear(x, counted, a, b, SCALE)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and dtypes == [torch.bfloat16, torch.bfloat16]
    assert a.grad.dtype == torch.float32


# ---------------------------------------------------------------- the module


def tiny(seed=0, **kw) -> Decoder:
    torch.manual_seed(seed)
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128) | kw
    return Decoder(DecoderConfig(vocab_size=VOCAB, max_seq_len=32, **shape)).eval()




def quantised(model: Decoder) -> Decoder:
    """A copy of `model` whose target layers hold their dequantised NF4 weights (what QLoRA computes with)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for m in out.modules():
            for name, child in m.named_children():
                if isinstance(child, nn.Linear) and name.endswith("_proj"):
                    child.weight.copy_(quantize_nf4(child.weight).dequantize())
    return out


def test_inject_keeps_the_base_in_4_bits_and_saves_only_the_adapter():
    m, plain = tiny(), tiny()
    wrapped = inject_lora(m, LoRAConfig(target_modules="all-linear", r=4, alpha=8, quantization="nf4"))
    inject_lora(plain, LoRAConfig(target_modules="all-linear", r=4, alpha=8))
    layer = m.model.layers[0].self_attn.q_proj
    assert layer.weight is None and layer.nf4.packed.numel() == 64 * 64 // 2
    assert not any(n.endswith("_proj.weight") for n, _ in m.named_parameters())
    assert {n for n, p in m.named_parameters() if p.requires_grad} == {
        n for n, p in plain.named_parameters() if p.requires_grad}
    assert lora_state_dict(m).keys() == lora_state_dict(plain).keys() == {
        f"{w}.lora_{ab}.weight" for w in wrapped for ab in "AB"}
    arrays = {"packed", "absmax_codes", "nested_absmax", "offset", "code", "nested_code"}    # frozen, integer dtypes
    assert set(m.state_dict()) == set(plain.state_dict()) - {f"{w}.weight" for w in wrapped} | {
        f"{w}.nf4_base.{a}" for w in wrapped for a in arrays}
    assert not any(p.is_floating_point() or p.requires_grad for n, p in m.named_parameters() if ".nf4_base." in n)
    for layer in lora_modules(m).values():             # 0.5 byte a weight + scales + the two code maps
        n = layer.in_features * layer.out_features
        assert layer.nf4.nbytes <= n / 2 + n / 64 + 4 * math.ceil(n / 64 / 256) + 4 + 4 * (16 + 256)


def test_forward_uses_the_dequantised_base_and_disabled_drops_the_adapter():
    m = tiny()
    expected_base = quantised(m)
    inject_lora(m, LoRAConfig(target_modules="all-linear", r=4, alpha=8, quantization="nf4"))
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(m(x), expected_base(x), atol=1e-5, rtol=1e-5)     # B = 0
        randomise_b(m)
        adapted = m(x)
        assert not torch.allclose(adapted, expected_base(x), atol=1e-3)
        with lora_disabled(m):
            torch.testing.assert_close(m(x), expected_base(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(m(x), adapted, atol=0, rtol=0)


def test_merge_gives_dequantised_weight_plus_delta():
    lin = nn.Linear(64, 48, bias=True)
    lora = LoRALinear(copy.deepcopy(lin), r=3, alpha=6, quantization="nf4")
    with torch.no_grad():
        lora.lora_B.weight.normal_()
    w = quantize_nf4(lin.weight).dequantize()
    expected = w + 2.0 * lora.lora_B.weight @ lora.lora_A.weight
    torch.testing.assert_close(lora.merged_weight(), expected)
    assert lora.merged_weight().dtype == lin.weight.dtype
    x = torch.randn(4, 64)
    torch.testing.assert_close(lora(x), x @ expected.T + lin.bias, atol=1e-5, rtol=1e-5)

    m = tiny()
    inject_lora(m, LoRAConfig(target_modules=["q_proj", "down_proj"], r=4, alpha=8, quantization="nf4"))
    randomise_b(m)
    with torch.no_grad():
        before = m(ids())
        merge_lora(m)
        assert not lora_modules(m) and type(m.model.layers[0].self_attn.q_proj) is nn.Linear
        torch.testing.assert_close(m(ids()), before, atol=1e-5, rtol=1e-5)


def test_moves_and_casts_with_the_module():
    lora = LoRALinear(nn.Linear(64, 64, bias=False), r=2, alpha=2, quantization="nf4")
    lora.to(torch.bfloat16)
    assert lora.nf4.dtype == torch.bfloat16 and lora.lora_A.weight.dtype == torch.bfloat16
    assert lora.nf4.code.dtype == lora.nf4.nested_absmax.dtype == torch.float32     # the format's own dtypes
    assert lora.merged_weight().dtype == torch.bfloat16
    assert lora(torch.randn(3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    moved = copy.deepcopy(lora).to("meta")
    assert moved.nf4.device.type == "meta" and moved.nf4.packed.dtype == torch.uint8


def test_a_layer_whose_size_is_not_a_multiple_of_64_is_named():
    m = tiny(hidden_size=40, intermediate_size=72)        # k/v_proj: 20 × 40 = 800 weights
    with pytest.raises(LoRAConfigError, match=r"model.layers.0.self_attn.k_proj \(20×40\).*lora.quantization"):
        inject_lora(m, LoRAConfig(target_modules="all-linear", r=2, alpha=2, quantization="nf4"))
    assert not lora_modules(m)                             # refused before anything was wrapped
    inject_lora(m, LoRAConfig(target_modules=["q_proj", "gate_proj"], r=2, alpha=2, quantization="nf4"))     # 40×40, 72×40: fine


def test_an_nf4_adapter_is_applied_to_the_dequantised_base(tmp_path):
    from glm_lora.configs.schema import LoRAConfig
    from glm_lora.model.adapters import apply_adapter, save_adapter
    lora = LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "up_proj"], quantization="nf4")
    trained = tiny()
    inject_lora(trained, lora)
    randomise_b(trained)
    nf4, plain = tmp_path / "nf4", tmp_path / "plain"
    for d, q in ((nf4, "nf4"), (plain, "none")):
        d.mkdir()
        save_adapter(trained, lora.model_copy(update={"quantization": q}), d)
    with torch.no_grad():
        expected = merge_lora(trained)(ids())
        torch.testing.assert_close(apply_adapter(tiny(), nf4)(ids()), expected, atol=0, rtol=0)
        assert not torch.allclose(apply_adapter(tiny(), plain)(ids()), expected, atol=1e-4)   # another base


# ---------------------------------------------------------------- the tiny model's SFT

SMALL = {"threads": 1, "serve.enabled": False, "eval.enabled": False, "tokenizer.vocab_size": 600,
         "data.synthetic.n_pretrain": 300, "data.synthetic.n_sft": 600, "data.synthetic.n_dpo": 24,
         "data.synthetic.n_eval": 8, "pretrain.max_steps": 10, "pretrain.batch_size": 8, "pretrain.eval_every": 0,
         "sft.max_steps": 40, "sft.batch_size": 8, "sft.compile": False, "sft.eval_every": 0, "sft.warmup_steps": 5,
         "checkpoint.save_every": 10, "checkpoint.save_optimizer_every": 10}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """data, tokenizer and a briefly pretrained base of the tiny preset (its model shape), built once."""
    from glm_lora.configs.load import load_config
    from glm_lora.flows.cli import run_one_stage
    cfg = load_config("tiny", {**SMALL, "runs_dir": str(tmp_path_factory.mktemp("qlora"))})
    for stage in ("data", "tokenizer", "pretrain"):
        run_one_stage(stage, cfg)
    return cfg


def sft(prepared, quantization: str, **overrides):
    from glm_lora.configs.load import load_config
    from glm_lora.engine import sft as sft_stage
    cfg = load_config("tiny", {**SMALL, "runs_dir": str(prepared.runs_dir), "sft.lora.quantization": quantization,
                               **overrides})
    out = prepared.runs_dir / f"sft-{quantization}-{len(list(prepared.runs_dir.glob('sft-*')))}"
    out.mkdir()
    inputs = {k: prepared.stage_dir(s) for k, s in (("base", "pretrain"), ("tokenizer", "tokenizer"), ("data", "data"))}
    with kernels.using(cfg.kernels, cfg.attention):
        sft_stage.run(cfg, inputs, out)
    return out, json.loads((out / "losses.json").read_text())


def test_sft_with_a_4_bit_base_learns_like_the_full_precision_one(prepared):
    full_dir, full = sft(prepared, "none")
    nf4_dir, nf4 = sft(prepared, "nf4")
    assert len(full) == len(nf4) == SMALL["sft.max_steps"]
    assert nf4 != full                                      # the base really was quantised
    last = lambda losses: sum(losses[-10:]) / 10          # noqa: E731
    assert last(full) < 0.7 * full[0]                       # both learned ...
    assert abs(last(nf4) - last(full)) <= 0.02 * last(full), (last(nf4), last(full))    # ... the same
    assert json.loads((nf4_dir / "adapter.json").read_text())["quantization"] == "nf4"
    assert load_file(nf4_dir / "adapter.safetensors").keys() == load_file(full_dir / "adapter.safetensors").keys()


def test_a_qlora_sft_resumes_from_its_adapter_checkpoint(prepared, caplog):
    """Checkpoints hold the adapter only; on resume the 4-bit base is made again from the base weights."""
    run = {"sft.max_steps": 20, "sft.lora.r": 8}
    _, straight = sft(prepared, "nf4", **run)                # checkpoints at steps 10 and 20
    last = max(prepared.run_dir.glob("checkpoints/sft-*/step-00000020"), key=lambda p: p.stat().st_mtime)
    saved = load_file(last / "model.safetensors")            # the adapter (+ modules_to_save), no base weight
    assert any(".lora_A." in k for k in saved) and not any(k.endswith("_proj.weight") for k in saved)
    shutil.rmtree(last)                                     # as if stopped right after step 10's checkpoint
    with caplog.at_level("INFO", logger="glm_lora.engine"):
        _, resumed = sft(prepared, "nf4", **run)
    assert "resumed from step 10" in caplog.text
    assert resumed == pytest.approx(straight, rel=1e-6)


def test_a_qlora_run_exports_merged_models_and_serves_them_not_the_adapters(prepared):
    """SFT and DPO on 4-bit bases → export: sft_merged/ is the 4-bit-trained model made full precision (HF loads
    it with the logits of our nf4 model), each adapter names the bitsandbytes config of its base, and the server
    plan serves merged/ alone (an nf4 adapter on a full-precision base is not the model that was trained)."""
    from transformers import AutoModelForCausalLM

    from glm_lora.configs.load import load_config
    from glm_lora.flows.cli import run_one_stage
    from glm_lora.model.adapters import BASE_QUANTIZATION, NF4_BNB_CONFIG, apply_adapter, load_native, vllm_unservable
    from glm_lora.serve.deploy import serving_plan
    # SMALL's 40 SFT steps: after the test above, its nf4 run's last checkpoint (step 40, the same checkpoint
    # directory) is this stage's, so no step runs again (a shorter run would be refused that checkpoint)
    cfg = load_config("tiny", {**SMALL, "runs_dir": str(prepared.runs_dir), "sft.lora.quantization": "nf4",
                               "dpo.lora.quantization": "nf4", "dpo.max_steps": 4,
                               "dpo.batch_size": 4, "dpo.eval_every": 0})
    for stage in ("sft", "dpo", "export"):
        run_one_stage(stage, cfg)
    export = cfg.stage_dir("export")
    for name in ("sft", "dpo"):
        assert json.loads((export / "adapters" / name / BASE_QUANTIZATION).read_text()) == {
            "quantization_config": NF4_BNB_CONFIG}
        assert "4-bit (nf4) base" in vllm_unservable(export / "adapters" / name)
    plan = serving_plan(export, "tiny")
    assert plan["model"] == "merged" and list(plan["names"]) == ["tiny"] and "adapters/dpo" in plan["not_served"]

    ours = apply_adapter(load_native(cfg.stage_dir("pretrain")), cfg.stage_dir("sft"), merge=False).eval()
    assert any(m.nf4 is not None for m in lora_modules(ours).values())
    hf = AutoModelForCausalLM.from_pretrained(export / "sft_merged", dtype=torch.float32).eval()
    x = torch.randint(3, 500, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, ours(x), atol=1e-4, rtol=1e-4)
