"""End to end: a tiny random Llama (and Qwen3: Llama + q/k norm, our `qk_norm`) + our tokenizer
+ a PEFT adapter served by vLLM (CPU).

One server start serves both the base model and the adapter; vLLM's greedy answers
must equal transformers' (and transformers + PEFT's) token for token in fp32.
"""
from __future__ import annotations

import json
import random
import socket
import time
from pathlib import Path

import pytest
import torch

from data.tokenizer import IM_END, load_tokenizer, train_tokenizer
from serve import vllm_server as vs

try:
    vs.vllm_python()
    _missing = ""
except FileNotFoundError as e:
    _missing = str(e)

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(_missing), reason=_missing)]

MAX_TOKENS = 24
MESSAGES = [{"role": "user", "content": "reverse hello 你好"}]
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _corpus(path: Path) -> Path:
    rng = random.Random(0)
    words = "hello world reverse copy add sub units answer".split()
    zh = "你好世界请把这个单词反转复制加上减去等于答案是多少米公里"
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(1000):
            text = " ".join(rng.choices(words, k=4)) + f" {rng.randint(0, 999)} " + "".join(rng.choices(zh, k=5))
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path


def _build(tmp: Path, arch: str):
    """Tokenizer + random tiny Llama/Qwen3 (fp32) in tmp/model, a random-B LoRA adapter in tmp/adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    model_dir = tmp / "model"
    train_tokenizer([_corpus(tmp / "corpus.jsonl")], model_dir, vocab_size=400)
    tok = load_tokenizer(model_dir)
    im_end = tok.convert_tokens_to_ids(IM_END)
    torch.manual_seed(0)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    config = config_cls(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        head_dim=32,  # vLLM CPU attention has no kernel for 64 / 4 = 16
        tie_word_embeddings=False, initializer_range=0.1,  # decisive logits: no near-ties between backends
        bos_token_id=tok.bos_token_id, eos_token_id=im_end, pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    model = model_cls(config).eval()
    with torch.no_grad():
        model.lm_head.weight[im_end] *= 3  # make <|im_end|> win early, so stopping is exercised
    model.save_pretrained(model_dir, safe_serialization=True)
    GenerationConfig(eos_token_id=im_end, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id).save_pretrained(model_dir)

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS, lora_dropout=0.0, bias="none")
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)  # PEFT initialises B = 0 (a no-op adapter)
    peft_model.peft_config["default"].base_model_name_or_path = str(model_dir)
    peft_model.save_pretrained(tmp / "adapter")
    return tok, peft_model, model_dir, tmp / "adapter"


def _byte_ids(tok) -> list[int]:
    """Byte-fallback tokens: a random model emits them often, and a run of bytes that is not
    valid UTF-8 has no one right text (vLLM's detokenizer and transformers' differ), so both
    sides are told never to sample them; the token ids are then compared exactly."""
    return [i for i, t in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))) if t.startswith("<0x")]


def _hf_greedy(model, tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    im_end = tok.convert_tokens_to_ids(IM_END)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
            max_new_tokens=MAX_TOKENS, eos_token_id=im_end, pad_token_id=tok.pad_token_id,
            suppress_tokens=_byte_ids(tok),
        )
    return out[0, len(ids):].tolist()


def _no_bytes(tok) -> dict:
    return {"logit_bias": {str(i): -100 for i in _byte_ids(tok)}}


def _vllm_greedy(handle: vs.ServerHandle, model: str, tok) -> tuple[list[int], str]:
    body = {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True,
            **_no_bytes(tok)}
    choice = vs.post_json(handle, "/v1/chat/completions", body)["choices"][0]
    return choice["token_ids"], choice["message"]["content"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_vllm_serves_base_and_lora_like_transformers(tmp_path: Path, arch: str) -> None:
    t0 = time.monotonic()
    tok, peft_model, model_dir, adapter_dir = _build(tmp_path, arch)
    with peft_model.disable_adapter():
        base_ids = _hf_greedy(peft_model, tok, MESSAGES)
    lora_ids = _hf_greedy(peft_model, tok, MESSAGES)
    assert base_ids != lora_ids, "the adapter should change the greedy answer"
    print(f"\nbuild + HF reference: {time.monotonic() - t0:.1f}s; base {len(base_ids)} tokens, lora {len(lora_ids)}")

    handle = vs.start_server(
        model_dir, port=_free_port(), served_model_name="tiny", lora_modules={"tiny-lora": adapter_dir},
        log_path=tmp_path / "vllm.log",
    )
    try:
        print(f"vLLM server ready in {vs.wait_healthy(handle, timeout_s=300):.1f}s (pid {handle.pid})")
        im_end = tok.convert_tokens_to_ids(IM_END)
        for name, expected in (("tiny", base_ids), ("tiny-lora", lora_ids)):
            ids, text = _vllm_greedy(handle, name, tok)
            assert ids == expected, f"{name}: vLLM {ids} != transformers {expected}"
            assert text == tok.decode(expected, skip_special_tokens=True)
            print(f"{name}: {len(ids)} tokens, stopped at <|im_end|>: {ids[-1] == im_end}, text {text!r}")
        assert vs.chat(handle, MESSAGES, max_tokens=MAX_TOKENS, **_no_bytes(tok)) == tok.decode(base_ids, skip_special_tokens=True)
    finally:
        t1 = time.monotonic()
        vs.stop_server(handle.pid)
        print(f"stopped in {time.monotonic() - t1:.1f}s")
    # Server and its EngineCore child are gone (an orphaned zombie may stay: PID 1 here does not reap).
    assert not vs.is_running(handle.pid)
    assert not vs.port_in_use(handle.host, handle.port)
