"""GGUF for llama.cpp / Ollama / LM Studio: an exported Hugging Face model directory (the export's merged/) written
with `gguf`, llama.cpp's own Python writer.

    <out>/<run>-<type>.gguf     one file per `export.gguf` type: weights, tokenizer and chat template
    <out>/Modelfile             `ollama create <run> -f Modelfile` (the first type's file)
    <out>/README.md             how to run it with llama.cpp and Ollama

The tensors are renamed by gguf's own table (`gguf.get_tensor_name_map`) and the hyper-parameters written under the
keys llama.cpp's loader reads for the architecture, as llama.cpp's convert_hf_to_gguf.py does it: Llama's q/k rows
permuted into llama.cpp's interleaved RoPE order (Qwen2/3 and the GLMs need none), GLM-4.5's routed experts stacked
per layer; norms, biases and the router stay f32. Tensors are converted and written one at a time (a temporary
file, not memory, holds the data until the header is written). f32/f16/bf16/q8_0 are written directly; K-quants (q4_k_m, ...) are made from the f16
file by llama.cpp's own quantizer (`llama_model_quantize`, from the llama-cpp-python package), which picks the
per-tensor types of each mix.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from glm_lora.configs.schema import Config
from glm_lora.model.gguf_support import (ARCHS, DIRECT, GGUF_TYPES, QUANTIZED, GGUFError, bpe_pre,  # noqa: F401
                                         check)

EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's half-split RoPE rows → llama.cpp's interleaved pairs (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(hf_dir: Path, n_layers: int, n_experts: int):
    """(name, tensor) in HF naming, one at a time; routed experts stacked per layer and projection as llama.cpp keeps
    them (`mlp.experts.gate_proj.weight`: (E, out, in)), each stack as soon as its experts are read; layers past
    n_layers (GLM-4.5's MTP) left out."""
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                layer = re.match(r"model\.layers\.(\d+)\.", name)
                if layer and int(layer[1]) >= n_layers:
                    continue
                m = EXPERT.fullmatch(name)
                if m is None:
                    yield name, st.get_tensor(name)
                    continue
                per = experts.setdefault((int(m[1]), m[3]), {})
                per[int(m[2])] = st.get_tensor(name)
                if len(per) == n_experts:
                    del experts[(int(m[1]), m[3])]
                    yield f"model.layers.{m[1]}.mlp.experts.{m[3]}.weight", torch.stack([per[e] for e in range(n_experts)])
    if experts:
        raise GGUFError(f"{hf_dir}: experts missing from {sorted(experts)}: each layer needs all {n_experts}")


def _hparams(writer, cfg: dict, arch: Arch) -> None:
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise GGUFError(f"export.gguf: rope scaling {rope or cfg.get('rope_scaling')} is not written as GGUF yet")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))   # GLM: half
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(cfg["vocab_size"])
    if "n_routed_experts" in cfg:       # GLM-4.5 (llama.cpp's glm4moe; its MTP layers are not written)
        import gguf
        writer.add_expert_count(cfg["n_routed_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        writer.add_expert_shared_count(cfg.get("n_shared_experts", 0))
        writer.add_leading_dense_block_count(cfg.get("first_k_dense_replace", 0))
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(float(cfg.get("routed_scaling_factor", 1.0)))
        writer.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", True)))
        writer.add_expert_group_count(cfg.get("n_group", 1))
        writer.add_expert_group_used_count(cfg.get("topk_group", 1))


def _sentencepiece(hf_dir: Path, added: dict):
    import gguf
    from sentencepiece import SentencePieceProcessor
    sp = SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        kind = (gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
                else gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.UNUSED if sp.is_unused(i)
                # sentencepiece's user-defined pieces match anywhere in the text, as llama.cpp's USER_DEFINED do
                else gguf.TokenType.USER_DEFINED if piece in added and not added[piece][1]
                else gguf.TokenType.NORMAL)
        tokens.append(piece.encode("utf-8"))
        scores.append(sp.get_score(i))
        types.append(kind)
    # sentencepiece's add_dummy_prefix (off in ours): whether "a" is encoded as "▁a"
    return tokens, scores, types, sp.id_to_piece(sp.encode("a")[0]).startswith("\u2581")


def _byte_level_bpe(hf_dir: Path, added: dict, n_vocab: int):
    """Tokens in tokenizer.json's byte-level spelling (what llama.cpp's "gpt2" model reads); ids the tokenizer
    leaves unused up to the model's vocab_size (Qwen pads its embedding) are [PAD<i>] placeholders."""
    import gguf
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for text, i in spec["model"]["vocab"].items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for text, (i, special) in added.items():
        tokens[i], types[i] = text, gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
    return [t.encode("utf-8") for t in tokens], types, bpe_pre(spec, hf_dir / "tokenizer.json")


def _vocab(writer, hf_dir: Path, n_vocab: int) -> None:
    """The tokenizer as llama.cpp reads it: a sentencepiece model ("llama": pieces, scores, types) or a byte-level
    BPE tokenizer.json ("gpt2": tokens, merges and the pre-tokenizer), then special ids, add-bos/eos flags and the
    chat template."""
    import gguf
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    added = {t.content: (i, t.special) for i, t in tok.added_tokens_decoder.items()}     # text → (id, special)
    if (hf_dir / "tokenizer.model").is_file():
        tokens, scores, types, space_prefix = _sentencepiece(hf_dir, added)
        if len(tokens) != n_vocab:
            raise GGUFError(f"{hf_dir}: tokenizer has {len(tokens)} pieces, the model's vocab_size is {n_vocab}")
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_add_space_prefix(space_prefix)
        writer.add_token_scores(scores)
    else:
        tokens, types, pre = _byte_level_bpe(hf_dir, added, n_vocab)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=not (hf_dir / "tokenizer.model").is_file(), n_vocab=n_vocab) \
        .add_to_gguf(writer, quiet=True)


def write(hf_dir: Path, out_path: Path, gguf_type: str, name: str) -> Path:
    """One HF model directory → one GGUF file of `gguf_type` (a DIRECT type); written beside, then renamed."""
    import gguf
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    check([gguf_type], model_type)
    arch = ARCHS[model_type]
    qtype = gguf.GGMLQuantizationType[DIRECT[gguf_type]]
    tmp = out_path.with_name(out_path.name + ".partial")
    # use_temp_file: each tensor goes to disk as it is converted, so memory holds one tensor (one layer's experts)
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch.gguf]], use_temp_file=True)
    writer.add_name(name)
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                          "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype.name])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _hparams(writer, cfg, arch)
    _vocab(writer, hf_dir, cfg["vocab_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.gguf], cfg["num_hidden_layers"])
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    for hf_name, t in _tensors(hf_dir, cfg["num_hidden_layers"], cfg.get("n_routed_experts", 0)):
        # the router's bias is `<gate>.e_score_correction_bias` in HF, `exp_probs_b.bias` in llama.cpp
        new = names.get_name(hf_name.replace("e_score_correction_bias", "e_score_correction.bias"),
                             try_suffixes=(".weight", ".bias"))
        if new is None:
            raise GGUFError(f"{hf_dir}: tensor {hf_name} has no GGUF name for {arch.gguf}")
        t = t.float()
        if arch.permute_qk and hf_name.endswith("q_proj.weight"):
            t = _permute(t, heads)
        elif arch.permute_qk and hf_name.endswith("k_proj.weight"):
            t = _permute(t, kv)
        data = t.numpy()
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32 or hf_name.endswith("mlp.gate.weight"):
            writer.add_tensor(new, data.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(new, data.astype(np.float16))
        else:
            try:
                writer.add_tensor(new, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            except gguf.QuantError:      # rows not a multiple of the block size: f16 (as convert_hf_to_gguf does)
                writer.add_tensor(new, data.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out_path)
    return out_path


def quantize(f16_path: Path, out_path: Path, gguf_type: str) -> Path:
    """A K-quant (or q4_0) from the f16 file by llama.cpp's own quantizer."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANTIZED[gguf_type])
    params.nthread = max(1, torch.get_num_threads())
    tmp = Path(out_path).with_name(Path(out_path).name + ".partial")
    rc = llama_cpp.llama_model_quantize(str(f16_path).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise GGUFError(f"llama.cpp's quantizer failed ({rc}) making {gguf_type} from {f16_path}")
    os.replace(tmp, out_path)
    return Path(out_path)


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    """The gguf stage (tasks/table.py): the export's final model (merged/) as `export.gguf`'s files, a Modelfile for
    Ollama and a README; K-quants come from an f16 file (kept only if f16 was asked for)."""
    merged, out_dir, name = Path(inputs["export"]) / "merged", Path(out_dir), cfg.run_name
    types = list(dict.fromkeys(cfg.export.gguf))
    check(types, json.loads((merged / "config.json").read_text())["model_type"], tokenizer_dir=merged)
    path = {t: out_dir / f"{name}-{t}.gguf" for t in types}
    source = path.get("f16", out_dir / f".{name}-f16-source.gguf")
    for t in [t for t in types if t in DIRECT] + (["f16"] if any(t in QUANTIZED for t in types) and "f16" not in path else []):
        write(merged, path.get(t, source), t, name)
    for t in (t for t in types if t in QUANTIZED):
        quantize(source, path[t], t)
    if "f16" not in path:
        source.unlink(missing_ok=True)
    files = {t: {"file": p.name, "bytes": p.stat().st_size} for t, p in path.items()}
    (out_dir / "Modelfile").write_text(modelfile(merged, path[types[0]].name))
    (out_dir / "README.md").write_text(readme(name, files))
    return {"files": files}


CHATML = "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"


def modelfile(hf_dir: Path, gguf_file: str) -> str:
    """Ollama's Modelfile: the file, its chat template in Ollama's syntax when it is ChatML (ours; other templates
    Ollama reads from the GGUF's tokenizer.chat_template) and the end-of-turn tokens as stops."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    chat = [{"role": "user", "content": "x"}]
    chatml = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((hf_dir / "generation_config.json").read_text()) if (hf_dir / "generation_config.json").is_file() else {}
    eos = gen.get("eos_token_id", tok.eos_token_id)
    stops = [tok.convert_ids_to_tokens(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None]
    lines = ["# ollama create <name> -f Modelfile && ollama run <name>", f"FROM ./{gguf_file}"]
    lines += [f'TEMPLATE """{CHATML}"""'] if chatml else ["# chat template: the GGUF file's tokenizer.chat_template"]
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    return "\n".join(lines) + "\n"


def readme(name: str, files: dict) -> str:
    rows = "\n".join(f"| `{f['file']}` | {t} | {f['bytes'] / 2**20:,.1f} MiB |" for t, f in files.items())
    first = next(iter(files.values()))["file"]
    return f"""# {name} — GGUF

The final model (export/merged) as GGUF for llama.cpp, Ollama and LM Studio; weights, tokenizer and chat template
in each file.

| file | type | size |
|---|---|---|
{rows}

llama.cpp: `llama-cli -m {first} -cnv` or `llama-server -m {first}` (OpenAI-compatible on :8080).
Python: `llama_cpp.Llama("{first}").create_chat_completion(messages=[{{"role": "user", "content": "..."}}])`.
Ollama: `ollama create {name} -f Modelfile && ollama run {name}`.
"""
