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

from glm_lora.configs import load_config
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
    model = getattr(transformers, cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, out / f.name)
    return model


def load(path, **kw):
    return llama_runtime().Llama(str(path), n_ctx=128, n_threads=1, verbose=False, **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "glm4", "glm"])
def test_llama_cpp_gives_transformers_logits(arch, tokenizer_dir, tmp_path):
    model = hf_model(arch, tokenizer_dir, tmp_path / "hf")
    tok = load_tokenizer(tokenizer_dir)
    ids = prompt_ids(tok, CHAT)
    path = gguf.write(tmp_path / "hf", tmp_path / "m-f32.gguf", "f32", "t")
    llm = load(path, logits_all=True)
    try:
        assert llm.tokenize(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True).encode(),
                            add_bos=False, special=True) == ids
        llm.eval(ids)
        theirs = np.asarray(llm.scores[:len(ids)])
    finally:
        llm.close()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(theirs - want).max() < 2e-3 * np.abs(want).max(), np.abs(theirs - want).max()
    assert (theirs.argmax(-1) == want.argmax(-1)).all()


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
    with pytest.raises(gguf.GGUFError, match="the glm4_moe architecture is not written as GGUF"):
        gguf.check(["f16"], "glm4_moe")


def test_k_quants_need_llama_cpp(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)
    with pytest.raises(gguf.GGUFError, match="pip install llama-cpp-python"):
        gguf.check(["f16", "q4_k_m"], "qwen3")
    gguf.check(["f16", "q8_0"], "qwen3")


def test_a_bpe_base_tokenizer_is_refused(tokenizer_dir, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    shutil.copy2(tokenizer_dir / "tokenizer.json", base / "tokenizer.json")
    with pytest.raises(gguf.GGUFError, match="no tokenizer.model"):
        gguf.check(["f16"], "qwen2", tokenizer_dir=base)
