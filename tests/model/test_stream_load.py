"""Large bases without the whole model in memory (docs/base-model.md, "Large bases"): the import goes tensor by
tensor into a checkpoint of several bounded files, in the checkpoint's dtype; a LoRA stage's load builds the decoder
on the meta device and fills it one weight at a time, in the dtypes the stage holds them, quantising each routed
expert alone under nf4 — never the full-precision expert stack. Peak memory is not measurable here: the mechanics
are (files written, tensors created, bytes and logits equal to the old whole-model path)."""
import json

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from glm_lora.configs.schema import LoRAConfig
from glm_lora.model import inject_lora
from glm_lora.model.hf import (HFCheckpoint, import_hf, load_hf, load_native, save_native, split_experts,
                               expert_weight_names)
from glm_lora.model.lora import LoRALinear, base_placement, cast_frozen_gemm_weights
from glm_lora.model.model import Decoder, Experts
from glm_lora.model.quant import NF4Params
from glm_lora.model.tensor_files import TensorFiles
from tests.model.test_moe import ids, mtp_tensors

torch.set_num_threads(1)
SMALL = 64 * 1024           # bytes per native file: the tiny model's checkpoint splits into several


def glm45(path, dtype=torch.float32):
    """A tiny GLM-4.5-style base (as tests/test_dag.py's: experts in groups, a shared expert, a dense layer, q/k norm,
    attention bias, one MTP layer) saved by transformers in `dtype`, in several source shards."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, use_qk_norm=True, attention_bias=True,
        routed_scaling_factor=2.5, num_nextn_predict_layers=1, max_position_embeddings=128, initializer_range=0.1,
        tie_word_embeddings=False)).eval()
    model.to(dtype).save_pretrained(path, max_shard_size="40KB")      # experts spread over source shards
    from safetensors.torch import save_file
    save_file({k: v.to(dtype) for k, v in mtp_tensors(model.float()).items()}, path / "mtp.safetensors",
              metadata={"format": "pt"})
    return model.float()


def hf_state(path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state |= load_file(f)
    return state


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_import_streams_into_several_files_in_the_checkpoint_dtype(tmp_path, dtype):
    glm45(tmp_path / "hub", dtype)
    assert len(list((tmp_path / "hub").glob("model-*.safetensors"))) > 2
    import_hf(tmp_path / "hub", tmp_path / "native", max_file_bytes=SMALL)
    native = tmp_path / "native"
    files = sorted(p.name for p in native.glob("model-*-of-*.safetensors"))
    assert len(files) > 2 and not (native / "model.safetensors").exists()
    index = json.loads((native / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    assert all((native / f).stat().st_size <= SMALL + 4096 or len(load_file(native / f)) == 1 for f in files)
    assert not list(native.glob(".*"))                                           # no temporary file left
    ours = {}
    for f in files:
        ours |= load_file(native / f)
    assert set(index["weight_map"]) == set(ours)
    # the same weights as the whole-model import gave (its fp32 values), each in the checkpoint's dtype
    source, cfg = hf_state(tmp_path / "hub"), load_hf(tmp_path / "hub").config
    whole = load_hf(tmp_path / "hub")
    for name, t in whole.state_dict().items():
        assert ours[name].dtype == dtype and torch.equal(ours[name].float(), t), name
    for name in expert_weight_names(cfg):                                        # and split back: the source bytes
        for hf_name, w in split_experts(name, ours[name], cfg).items():
            assert torch.equal(w, source[hf_name]), hf_name
    with TensorFiles.of(native, "carried") as f:
        carried = {k: f.get(k) for k in f}
    assert set(carried) == set(whole.carried) and all(torch.equal(carried[k], source[k]) for k in carried)
    assert all(v.dtype == dtype for v in carried.values())


def test_the_import_refuses_before_writing_and_a_failed_write_leaves_no_readable_checkpoint(tmp_path, monkeypatch):
    glm45(tmp_path / "hub")
    import glm_lora.model.tensor_files as tf
    calls = []

    def failing(batch, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        return save_file(batch, path, metadata=metadata)
    save_file = tf.save_file
    monkeypatch.setattr(tf, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        import_hf(tmp_path / "hub", tmp_path / "native", max_file_bytes=SMALL)
    assert list((tmp_path / "native").iterdir()) == []                             # nothing half-written is left
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_native(tmp_path / "native")
    monkeypatch.undo()
    f = next(p for p in sorted((tmp_path / "hub").glob("model-*.safetensors"))
             if "model.layers.1.mlp.experts.6.up_proj.weight" in load_file(p))
    state = load_file(f)
    del state["model.layers.1.mlp.experts.6.up_proj.weight"]
    save_file(state, f, metadata={"format": "pt"})
    from glm_lora.model.hf import BaseModelError
    with pytest.raises(BaseModelError, match="'model.layers.1.mlp.experts.6.up_proj.weight' missing"):
        import_hf(tmp_path / "hub", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()                                     # refused before any write


def test_a_shard_missing_or_out_of_place_is_named(tmp_path):
    model = Decoder(load_hf(glm45_dir(tmp_path)).config)
    save_native(model, tmp_path / "native", max_file_bytes=SMALL)
    index = tmp_path / "native" / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    elsewhere = next(f for f in sorted(set(weight_map.values())) if f != weight_map["model.norm.weight"])
    index.write_text(json.dumps({"weight_map": weight_map | {"model.norm.weight": elsewhere}}))
    with pytest.raises(ValueError, match="'model.norm.weight' is not where the index says"):
        load_native(tmp_path / "native")
    index.write_text(json.dumps({"weight_map": weight_map}))
    last = sorted(set(weight_map.values()))[-1]
    (tmp_path / "native" / last).unlink()
    with pytest.raises(FileNotFoundError, match=f"names {last}, which is missing"):
        load_native(tmp_path / "native")


def glm45_dir(tmp_path):
    if not (tmp_path / "hub" / "config.json").is_file():
        glm45(tmp_path / "hub")
    return tmp_path / "hub"


def old_load_native(path) -> Decoder:
    """The whole-model load the streamed one replaces: an fp32 Decoder, the whole state dict loaded into it."""
    cfg = json.loads((path / "config.json").read_text())
    from glm_lora.model.model import DecoderConfig
    model = Decoder(DecoderConfig.from_dict(cfg))
    with TensorFiles.of(path, "model") as files:
        model.load_state_dict({k: files.get(k).float() for k in files}, strict=not model.config.tie_embeddings)
    return model


@pytest.mark.parametrize("layout", ["one file", "several files"])
def test_the_streamed_load_equals_the_whole_model_load(tmp_path, layout):
    import_hf(glm45_dir(tmp_path), tmp_path / "native", max_file_bytes=SMALL if layout == "several files" else 2**30)
    assert (tmp_path / "native" / "model.safetensors").is_file() is (layout == "one file")
    streamed, whole = load_native(tmp_path / "native").eval(), old_load_native(tmp_path / "native").eval()
    assert streamed.state_dict().keys() == whole.state_dict().keys()
    for (name, a), b in zip(streamed.state_dict().items(), whole.state_dict().values()):
        assert a.dtype == torch.float32 and a.device.type == "cpu" and torch.equal(a, b), name
    assert streamed.carried.keys() == load_hf(tmp_path / "hub").carried.keys()
    x = ids(T=11)
    with torch.no_grad():
        torch.testing.assert_close(streamed(x), whole(x), atol=0, rtol=0)


class Watch(TorchDispatchMode):
    """Every tensor with memory of its own that a torch op makes while active, by shape and dtype: not views (a tensor
    read from a file is a view of the file, memory-mapped: model/tensor_files.py), not meta tensors."""

    def __init__(self):
        super().__init__()
        self.made: set[tuple[tuple[int, ...], torch.dtype]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in () if func.is_view else out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.made.add((tuple(t.shape), t.dtype))
        return out


def stacks(cfg) -> set[tuple[int, ...]]:
    E, C, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return {(E, 2 * I, C), (E, C, I)}


def full_precision(made, shapes) -> list:
    return [(s, d) for s, d in made if s in shapes and d.is_floating_point]


NF4 = LoRAConfig(r=4, alpha=8, target_modules="all-linear", quantization="nf4", modules_to_save=[])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_experts_are_quantised_one_expert_at_a_time_as_inject_lora_quantises_them(tmp_path, monkeypatch, dtype):
    hub = tmp_path / "hub"
    glm45(hub, dtype)
    import_hf(hub, tmp_path / "native", max_file_bytes=SMALL)
    cfg = load_hf(hub).config
    with Watch() as watch:                          # the watch sees the old path build the stacks: it can fail
        whole = old_load_native(tmp_path / "native")
    assert full_precision(watch.made, stacks(cfg))
    inject_lora(whole, NF4)

    read_whole = []                                 # what is read whole (on a GPU: moved there whole)
    get = TensorFiles.get
    monkeypatch.setattr(TensorFiles, "get", lambda self, name: read_whole.append(name) or get(self, name))
    with Watch() as watch:
        streamed = load_native(tmp_path / "native", place=lambda c: base_placement(c, NF4, torch.device("cpu"), None))
    assert not full_precision(watch.made, stacks(cfg))          # no stacked expert tensor in any float dtype
    assert read_whole and not [n for n in read_whole if n in expert_weight_names(cfg)]   # each expert read alone
    experts = [m for m in streamed.modules() if type(m) is Experts]
    assert experts and all(isinstance(m.gate_up_proj, NF4Params) and isinstance(m.down_proj, NF4Params)
                           for m in experts)
    inject_lora(streamed, NF4)                      # skips the stacks already in 4 bits, quantises the linears

    a, b = streamed.state_dict(), whole.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        if ".lora_A." not in name:                  # (the adapter's random init: drawn on another RNG state)
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert sum(isinstance(m, LoRALinear) and m.nf4_base is not None for m in streamed.modules()) > 4
    x = ids(T=11)
    with torch.no_grad():
        torch.testing.assert_close(streamed.eval()(x), whole.eval()(x), atol=0, rtol=0)


def test_the_stage_placement_holds_frozen_gemm_weights_in_the_compute_dtype_and_the_rest_in_fp32(tmp_path):
    """What adapter_stage does on CUDA under bf16 (Runtime.weights_in_compute_dtype), here on the CPU: the streamed
    base arrives with the frozen GEMM weights in bf16 already, and after inject_lora + cast the model is the old
    path's (fp32 load, inject, cast) — trainable adapter, norms, embeddings and the router in fp32."""
    import_hf(glm45_dir(tmp_path), tmp_path / "native")
    lora = LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "experts.gate_proj", "experts.up_proj"],
                      modules_to_save=["lm_head"])
    with Watch() as watch:
        streamed = load_native(tmp_path / "native",
                               place=lambda c: base_placement(c, lora, torch.device("cpu"), torch.bfloat16))
    cfg = streamed.config
    assert not full_precision({(s, d) for s, d in watch.made if d == torch.float32}, stacks(cfg))   # no fp32 stack
    assert streamed.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert streamed.model.layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16
    assert streamed.lm_head.weight.dtype == streamed.model.embed_tokens.weight.dtype == torch.float32
    inject_lora(streamed, lora)
    cast_frozen_gemm_weights(streamed, torch.bfloat16)
    whole = load_native(tmp_path / "native")
    inject_lora(whole, lora)
    cast_frozen_gemm_weights(whole, torch.bfloat16)
    a, b = streamed.state_dict(), whole.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        if ".lora_A." not in name:
            assert torch.equal(a[name], b[name]), name
    assert a["model.layers.1.mlp.experts.gate_proj.lora_A.weight"].dtype == torch.float32


def test_a_native_checkpoint_of_several_files_round_trips_with_mtp(tmp_path):
    model = load_hf(glm45_dir(tmp_path))
    save_native(model, tmp_path / "native", max_file_bytes=SMALL)
    assert (tmp_path / "native" / "carried.safetensors.index.json").is_file()   # the MTP layer split as well
    save_native(model, tmp_path / "native")                                       # again, into one file each
    assert not list((tmp_path / "native").glob("*-of-*")) and not list((tmp_path / "native").glob("*.index.json"))
    back = load_native(tmp_path / "native")
    save_native(back, tmp_path / "native", max_file_bytes=SMALL)   # over the files it was read from (mapped)
    back = load_native(tmp_path / "native")
    assert all(torch.equal(back.carried[k], v) for k, v in model.carried.items())
    x = ids(T=9)
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x), model.eval()(x), atol=0, rtol=0)
    back.carried = {}
    save_native(back, tmp_path / "native")
    assert not list((tmp_path / "native").glob("carried*")) and load_native(tmp_path / "native").carried == {}


def test_hf_checkpoint_refuses_a_weight_in_two_files(tmp_path):
    from glm_lora.model.hf import BaseModelError
    hub = glm45_dir(tmp_path)
    first = sorted(hub.glob("model-*.safetensors"))[0]
    (hub / "stale.safetensors").write_bytes(first.read_bytes())
    with pytest.raises(BaseModelError, match=r"stale.safetensors: tensor '.*' is in .*model-00001.* too; supported"):
        HFCheckpoint(hub)


def test_hf_checkpoint_refuses_a_shape_config_json_does_not_describe(tmp_path):
    from safetensors.torch import save_file
    hub = glm45_dir(tmp_path)
    f = next(p for p in sorted(hub.glob("model-*.safetensors")) if "model.layers.1.mlp.experts.3.down_proj.weight"
             in load_file(p))
    state = load_file(f)
    state["model.layers.1.mlp.experts.3.down_proj.weight"] = state["model.layers.1.mlp.experts.3.down_proj.weight"][:, :8].contiguous()
    save_file(state, f, metadata={"format": "pt"})
    from glm_lora.model.hf import BaseModelError
    with pytest.raises(BaseModelError, match=r"'model.layers.1.mlp.experts.3.down_proj.weight' has shape \(64, 8\), "
                                             r"config.json describes \(64, 32\)"):
        HFCheckpoint(hub)
