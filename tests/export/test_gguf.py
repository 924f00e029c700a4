"""GGUF export (export/gguf.py), checked with llama.cpp's own runtime (llama-cpp-python): for each architecture a
tiny random model made with transformers' own class gives transformers' logits in llama.cpp (f32 file), the
tokenizer tokenises a chat prompt as ours does, the quantised types load and run; bad requests are refused before
any training, naming the key."""
import json
import shutil

import numpy as np
import pytest
import torch
import transformers

from glm_lora.configs.load import load_config
from glm_lora.data.tokenizer import IM_END, load_tokenizer, prompt_ids, train_tokenizer
from glm_lora.engine.preflight import preflight
from glm_lora.export import gguf
from glm_lora.model.hf import HF_ARCHITECTURES

from tests.llama_runtime import llama_cpp as llama_runtime

CHAT = [{"role": "user", "content": "What is 12 + 7? 请重复“山水”。"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from glm_lora.data.synthetic import generate
    tmp = tmp_path_factory.mktemp("tok")
    files = generate(tmp / "data", seed=0, n_pretrain=300, n_sft=1, n_dpo=1, n_eval=1)
    return train_tokenizer([files["pretrain"]], tmp / "tokenizer", vocab_size=800)


def hf_model(arch: str, tokenizer_dir, out) -> transformers.PreTrainedModel:
    """A tiny random `arch` model (transformers' class) with our tokenizer beside it; norms and biases randomised so
    a wrong mapping shows."""
    tok = load_tokenizer(tokenizer_dir)
    torch.manual_seed(0)
    cls = HF_ARCHITECTURES[arch]
    config = getattr(transformers, cls.replace("ForCausalLM", "Config"))(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids(IM_END),
        pad_token_id=tok.pad_token_id)
    if arch == "glm4_moe":     # GLM-4.5's shape in small: one dense layer, then 8 experts top-2 (+ a shared one)
        config = transformers.Glm4MoeConfig(**{**config.to_dict(), "model_type": "glm4_moe"} | dict(
            moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, n_shared_experts=1, use_qk_norm=True, attention_bias=True,
            routed_scaling_factor=2.5, num_hidden_layers=3))
    model = getattr(transformers, cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):     # 0 at init: make the router's bias matter
                b.copy_(0.5 * torch.randn_like(b))
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, out / f.name)
    return model


def load(path, **kw):
    return llama_runtime().Llama(str(path), n_ctx=128, n_threads=1, verbose=False, **kw)


def assert_same_tokens_and_logits(model, tok, path, text: str | None = None):
    """llama.cpp tokenises `text` and a rendered chat as `tok` does, and gives `model`'s logits on the chat (within
    0.2 % of the largest, same argmax everywhere)."""
    chat = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(chat, add_special_tokens=False)
    assert ids == prompt_ids(tok, CHAT)
    llm = load(path, logits_all=True)
    try:
        if text is not None:
            assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text, add_special_tokens=False)
        assert llm.tokenize(chat.encode(), add_bos=False, special=True) == ids
        llm.eval(ids)
        theirs = np.asarray(llm.scores[:len(ids)])
    finally:
        llm.close()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(theirs - want).max() < 2e-3 * np.abs(want).max(), np.abs(theirs - want).max()
    assert (theirs.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "glm", "glm4", "glm4_moe"])
def test_llama_cpp_gives_transformers_logits(arch, tokenizer_dir, tmp_path):
    model = hf_model(arch, tokenizer_dir, tmp_path / "hf")
    tok = load_tokenizer(tokenizer_dir)
    assert_same_tokens_and_logits(model, tok, gguf.write(tmp_path / "hf", tmp_path / "m-f32.gguf", "f32", "t"))


def test_types_write_and_run(tokenizer_dir, tmp_path):
    """Every type we offer loads in llama.cpp and decodes; the stage writes the files, a Modelfile and a README."""
    llama_runtime()      # the K-quants are made by its quantizer
    hf_model("qwen3", tokenizer_dir, tmp_path / "export" / "merged")
    (tmp_path / "export" / "merged" / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    cfg = load_config("tiny", {"run_name": "t", "export.gguf": list(gguf.GGUF_TYPES)})
    out = tmp_path / "gguf"
    out.mkdir()
    metrics = gguf.run(cfg, {"export": tmp_path / "export"}, out)
    assert list(metrics["files"]) == list(gguf.GGUF_TYPES)
    assert sorted(p.name for p in out.iterdir()) == sorted([f"t-{t}.gguf" for t in gguf.GGUF_TYPES] +
                                                           ["Modelfile", "README.md"])
    sizes = {t: f["bytes"] for t, f in metrics["files"].items()}
    assert sizes["f32"] > sizes["f16"] > sizes["q8_0"] > sizes["q4_k_m"], sizes
    for t in gguf.GGUF_TYPES:
        llm = load(out / f"t-{t}.gguf")
        try:
            assert len(llm.create_completion([1, 7, 8], max_tokens=4, temperature=0.0)["choices"]) == 1
        finally:
            llm.close()
    modelfile = (out / "Modelfile").read_text()
    assert "FROM ./t-f32.gguf" in modelfile and "<|im_start|>{{ .Role }}" in modelfile
    assert f'PARAMETER stop "{IM_END}"' in modelfile


def test_a_type_we_cannot_write_stops_in_preflight(tmp_path):
    cfg = load_config("tiny", {"runs_dir": str(tmp_path), "export.gguf": ["f16", "q3_x"]})
    with pytest.raises(gguf.GGUFError, match=r"export.gguf: cannot write \['q3_x'\]; types are \['f32', 'f16'"):
        preflight(cfg)


def test_an_architecture_we_cannot_write_is_refused():
    with pytest.raises(gguf.GGUFError, match="the gemma architecture is not written as GGUF"):
        gguf.check(["f16"], "gemma")


def test_k_quants_need_llama_cpp(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)
    with pytest.raises(gguf.GGUFError, match="pip install llama-cpp-python"):
        gguf.check(["f16", "q4_k_m"], "qwen3")
    gguf.check(["f16", "q8_0"], "qwen3")


TEXT = "Hello world!  It's 2026: 12345 + 67 = 12412.\n\n  Tabs\tand 中文“引号”，emoji 🙂 done"


@pytest.mark.parametrize("family, arch", [("glm4", "glm4"), ("llama3", "llama"), ("chatml", "qwen2")])
def test_byte_level_bpe_tokenizers_tokenise_in_llama_cpp_as_in_transformers(family, arch, tmp_path):
    """A base model's own byte-level BPE tokenizer (GLM-4's, Llama 3's, Qwen's specials and templates; the split
    regex of Llama 3 / GLM-4, or Qwen2's one-digit split) goes into the GGUF: llama.cpp tokenises text and a
    rendered chat as transformers does, and the model's logits match."""
    from tests.chat_templates import build_tokenizer
    tok_dir = build_tokenizer(tmp_path / "tok", family)
    if arch == "qwen2":        # Qwen's split: one digit a piece
        spec = json.loads((tok_dir / "tokenizer.json").read_text())
        for step in spec["pre_tokenizer"]["pretokenizers"]:
            if step["type"] == "Split":
                step["pattern"]["Regex"] = step["pattern"]["Regex"].replace(r"\p{N}{1,3}", r"\p{N}")
        (tok_dir / "tokenizer.json").write_text(json.dumps(spec))
    tok = load_tokenizer(tok_dir)
    model = hf_model(arch, tok_dir, tmp_path / "hf")
    path = gguf.write(tmp_path / "hf", tmp_path / "m.gguf", "f32", "t")
    assert_same_tokens_and_logits(model, tok, path, text=TEXT)


def test_an_unknown_bpe_split_is_refused(tmp_path):
    from tests.chat_templates import build_tokenizer
    tok_dir = build_tokenizer(tmp_path / "tok", "chatml")
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\S+"
    (tok_dir / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(gguf.GGUFError, match=r"pre-tokenizer split '\\\\s\+\|\\\\S\+' is not one llama.cpp knows"):
        gguf.check(["f16"], "qwen2", tokenizer_dir=tok_dir)
