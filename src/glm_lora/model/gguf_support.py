"""What a GGUF file of ours can hold (export/gguf.py writes it): the types, the layouts (HF model_type → llama.cpp
architecture) and the tokenizers — declared here, below the engine, so preflight checks a request before any
training with the same tables the writer uses."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from glm_lora.configs.errors import UserError

# Written by gguf's writer (GGMLQuantizationType name) or made by llama.cpp's quantizer (llama_ftype constant name).
DIRECT = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}
QUANTIZED = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
             "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}
GGUF_TYPES = tuple(DIRECT) + tuple(QUANTIZED)


@dataclass(frozen=True)
class Arch:
    gguf: str                  # gguf.MODEL_ARCH member name
    permute_qk: bool           # llama.cpp's LLAMA rope is interleaved: HF's half-split q/k rows are reordered


# HF model_type → llama.cpp architecture (each checked against transformers' logits in llama.cpp: tests/export).
ARCHS = {"llama": Arch("LLAMA", True), "qwen2": Arch("QWEN2", False), "qwen3": Arch("QWEN3", False),
         "glm": Arch("CHATGLM", False), "glm4": Arch("GLM4", False), "glm4_moe": Arch("GLM4_MOE", False)}


class GGUFError(UserError):
    """A GGUF type or architecture this export cannot write (known before training)."""


def check(types: list[str], model_type: str, tokenizer_dir: Path | None = None) -> None:
    """What preflight asks: every requested type writable for this architecture and tokenizer (`tokenizer_dir`: a
    base model's; ours is always sentencepiece), llama.cpp's quantizer there when a K-quant is asked for."""
    unknown = [t for t in types if t not in GGUF_TYPES]
    if unknown:
        raise GGUFError(f"export.gguf: cannot write {unknown}; types are {list(GGUF_TYPES)}")
    if types and model_type not in ARCHS:
        raise GGUFError(f"export.gguf: the {model_type} architecture is not written as GGUF (supported: "
                        f"{sorted(ARCHS)}); set export.gguf to [] (llama.cpp's convert_hf_to_gguf.py may convert "
                        "merged/ where llama.cpp runs the architecture)")
    if types and tokenizer_dir is not None:
        check_tokenizer(tokenizer_dir)
    needs_llama = [t for t in types if t in QUANTIZED]
    if needs_llama:
        if importlib.util.find_spec("llama_cpp") is None:
            raise GGUFError(f"export.gguf {needs_llama}: K-quants are made by llama.cpp's quantizer; install it with "
                            f"`pip install llama-cpp-python` (or keep to {list(DIRECT)})")


# A byte-level BPE tokenizer's split regex (tokenizer.json pre_tokenizer) → llama.cpp's pre-tokenizer of that regex
# (llama-vocab.cpp): llama.cpp splits text by its own copy of the regex, so only a known one can be written.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
BPE_PRE = {_LLAMA3_SPLIT: "llama-bpe",                                   # Llama 3, GLM-4 (same split)
           _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"): "qwen2",      # Qwen2 / 2.5 / 3: one digit a piece
           None: "gpt2"}                                                 # ByteLevel's own GPT-2 regex


def bpe_pre(tokenizer_json: dict, source: Path) -> str:
    """llama.cpp's pre-tokenizer name for a byte-level BPE tokenizer.json, or a GGUFError naming what it has."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    split = [p["pattern"].get("Regex") for p in steps if p.get("type") == "Split"]
    byte_level = [p for p in steps if p.get("type") == "ByteLevel"]
    if tokenizer_json.get("model", {}).get("type") != "BPE" or not byte_level:
        raise GGUFError(f"export.gguf: {source} is not a byte-level BPE or sentencepiece tokenizer")
    key = split[0] if split else (None if byte_level[0].get("use_regex", True) else "no split")
    if key not in BPE_PRE:
        raise GGUFError(f"export.gguf: {source}'s pre-tokenizer split {key!r} is not one llama.cpp knows "
                        f"(known: Llama 3 / GLM-4, Qwen2, GPT-2); set export.gguf to []")
    return BPE_PRE[key]


def check_tokenizer(tokenizer_dir: Path) -> None:
    """A tokenizer the writer can put in a GGUF file: sentencepiece, or byte-level BPE with a known split."""
    tokenizer_dir = Path(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.model").is_file():
        bpe_pre(json.loads((tokenizer_dir / "tokenizer.json").read_text()), tokenizer_dir / "tokenizer.json")


