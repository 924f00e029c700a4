"""Small real exports for the serving tests, made in seconds without training.

`build_export` takes the DAG's own path on a tiny random model: a Hugging Face model of the layout,
imported into our decoder, an SFT adapter (LoRA on every projection, plus full embed_tokens/lm_head
like the tiny default's `modules_to_save`) and a DPO adapter on top, then the export stage's function
writes base/, sft_merged/, merged/, adapters/ and its manifest with the held-out metrics we give it.
"""
from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import pytest
import torch

from glm_lora.artifacts.manifest import MANIFEST, write_manifest
from glm_lora.configs.schema import Config, LoRAConfig
from glm_lora.data.tokenizer import IM_END, load_tokenizer, train_tokenizer

GOOD_EVAL = {"pretrain": {"perplexity": 3.0}, "sft": {"exact_match": 0.8},
             "dpo": {"exact_match": 0.8, "implicit_reward_accuracy": 0.8}}


def _missing_for_serving() -> str:
    """Why the serving tests cannot run here ('' if they can): vLLM's virtualenv and nginx are needed."""
    from glm_lora.serve import proxy
    from glm_lora.serve import vllm_server as vs
    try:
        vs.vllm_python()
        proxy.nginx_binary()
    except Exception as e:     # noqa: BLE001
        return str(e)
    return ""


_MISSING = _missing_for_serving()
NEEDS_VLLM_AND_NGINX = [pytest.mark.vllm, pytest.mark.skipif(bool(_MISSING), reason=_MISSING)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def corpus(path: Path) -> Path:
    rng = random.Random(0)
    words = "hello world reverse copy add sub units answer".split()
    zh = "你好世界请把这个单词反转复制加上减去等于答案是多少米公里"
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(1000):
            text = " ".join(rng.choices(words, k=4)) + f" {rng.randint(0, 999)} " + "".join(rng.choices(zh, k=5))
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path


def build_export(tmp: Path, arch: str = "qwen3", *, seed: int = 0, eval_metrics: dict | None = None,
                 sft_modules_to_save: bool = True, dpo_std: float = 0.1) -> Path:
    """A published-looking export directory (tmp/export) of a tiny random `arch` model; returns its path."""
    import transformers

    from glm_lora.export.hf_peft import export
    from glm_lora.model import inject_lora
    from glm_lora.model.adapters import load_policy, save_adapter
    from glm_lora.model.hf import HF_ARCHITECTURES, load_hf, save_native
    from glm_lora.model.lora import lora_modules, saved_modules

    tmp = Path(tmp)
    hf_dir = tmp / "hf"
    train_tokenizer([corpus(tmp / "corpus.jsonl")], hf_dir, vocab_size=400)
    tok = load_tokenizer(hf_dir)
    im_end = tok.convert_tokens_to_ids(IM_END)
    torch.manual_seed(seed)
    hf_class = HF_ARCHITECTURES[arch]
    config = getattr(transformers, hf_class.replace("ForCausalLM", "Config"))(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32,   # vLLM's CPU attention has kernels for 32, not 16
        max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=im_end, pad_token_id=tok.pad_token_id)
    hf = getattr(transformers, hf_class)(config).eval()
    with torch.no_grad():
        hf.lm_head.weight[im_end] *= 1.5    # answers of 5-24 tokens, some stopping at <|im_end|>
        for name, p in hf.named_parameters():
            if arch in ("glm", "glm4") and (name.endswith(".bias") or "norm" in name):
                p.add_(0.2 * torch.randn_like(p))    # biases 0 and norms 1 at init: make them matter
    hf.save_pretrained(hf_dir, safe_serialization=True)

    metrics = eval_metrics if eval_metrics is not None else GOOD_EVAL
    dirs = {name: tmp / name for name in ("base", "sft", "dpo")}
    for name, d in dirs.items():
        d.mkdir()
        (d / MANIFEST).write_text(json.dumps({"metrics": {"eval": metrics.get("pretrain" if name == "base" else name)}}))
    save_native(load_hf(hf_dir), dirs["base"])
    for name, std in (("sft", 0.2), ("dpo", dpo_std)):
        lora = LoRAConfig(r=8, alpha=16, modules_to_save=["embed_tokens", "lm_head"] if name == "sft" and
                          sft_modules_to_save else [])
        model = load_policy(dirs["base"], *([dirs["sft"]] if name == "dpo" else []))
        inject_lora(model, lora)
        with torch.no_grad():
            for m in lora_modules(model).values():
                m.lora_B.weight.normal_(std=std)
            for m in saved_modules(model, lora.modules_to_save).values():
                m.weight.add_(0.02 * torch.randn_like(m.weight))
        save_adapter(model, lora, dirs[name])
    out = tmp / "export"
    out.mkdir()
    cfg = Config(run_name="tiny", runs_dir=tmp / "runs", eval={"enabled": False})
    result = export(cfg, dirs["base"], dirs["sft"], dirs["dpo"], hf_dir, out)
    write_manifest(out, "export", metrics=result)
    return out
