"""End to end: a tiny random Llama (and Qwen3: Llama + q/k norm, our `arch: qwen3`) + our tokenizer
+ a PEFT adapter served by vLLM (CPU), started by the serve stage with an API key; and our own
GLM-4-0414 export (merged model + the split LoRA adapter vLLM needs) with greedy parity.

One server start serves both the base model and the adapter; vLLM's greedy answers
must equal transformers' (and transformers + PEFT's) token for token in fp32. The same
server shows the API key at work: refused without it, never written to a file, a log or argv.
"""
from __future__ import annotations

import functools
import json
import logging
import random
import secrets
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from configs.schema import Config, LoRAConfig
from data.tokenizer import IM_END, load_tokenizer, train_tokenizer
from serve import stage
from serve import vllm_server as vs

try:
    vs.vllm_python()
    _missing = ""
except FileNotFoundError as e:
    _missing = str(e)

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(_missing), reason=_missing)]

MAX_TOKENS = 24
MESSAGES = [{"role": "user", "content": "reverse hello 你好"}]
KEY_ENV = "GLM_LORA_TEST_VLLM_KEY"
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
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        head_dim=32,  # = 64 / 2: the serve stage loads it into our decoder (Qwen3Config defaults to 128); vLLM CPU has kernels for 32, not 16
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


def _vllm_greedy(handle: vs.ServerHandle, model: str, tok, api_key: str) -> tuple[list[int], str]:
    body = {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True,
            **_no_bytes(tok)}
    choice = vs.post_json(handle, "/v1/chat/completions", body, api_key=api_key)["choices"][0]
    return choice["token_ids"], choice["message"]["content"]


def _status(handle: vs.ServerHandle, path: str, body: dict | None = None, api_key: str | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(handle.base_url + path, None if body is None else json.dumps(body).encode(), headers)
    try:
        with vs._LOCAL.open(req, timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _serve_stage(tmp_path: Path, model_dir: Path, adapter_dir: Path, monkeypatch) -> tuple[Config, dict]:
    """Run the real serve stage on model_dir as the export's merged model, the key in $KEY_ENV; the
    server also gets the adapter (the stage serves no adapters) and keeps running."""
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    (export_dir / "merged").symlink_to(model_dir)
    (export_dir / "manifest.json").write_text(json.dumps({"metrics": {"eval": {}}}))
    monkeypatch.setattr(stage, "start_server", functools.partial(vs.start_server, lora_modules={"tiny-lora": adapter_dir}))
    cfg = Config(run_name="tiny", runs_dir=tmp_path / "runs",
                 serve={"port": _free_port(), "api_key_env": KEY_ENV, "keep_running": True, "max_tokens": 8})
    out_dir = cfg.stage_dir("serve")
    out_dir.mkdir(parents=True)
    return cfg, stage.serve(cfg, export_dir, out_dir)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_vllm_serves_base_and_lora_like_transformers(tmp_path: Path, arch: str, monkeypatch, caplog) -> None:
    t0 = time.monotonic()
    tok, peft_model, model_dir, adapter_dir = _build(tmp_path, arch)
    with peft_model.disable_adapter():
        base_ids = _hf_greedy(peft_model, tok, MESSAGES)
    lora_ids = _hf_greedy(peft_model, tok, MESSAGES)
    assert base_ids != lora_ids, "the adapter should change the greedy answer"
    print(f"\nbuild + HF reference: {time.monotonic() - t0:.1f}s; base {len(base_ids)} tokens, lora {len(lora_ids)}")

    key = "glm-lora-test-" + secrets.token_urlsafe(24)
    monkeypatch.setenv(KEY_ENV, key)
    t1 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="glm_lora"):
        cfg, result = _serve_stage(tmp_path, model_dir, adapter_dir, monkeypatch)
    record = json.loads((cfg.stage_dir("serve") / "server.json").read_text())
    handle = vs.ServerHandle(record["pid"], cfg.serve.host, cfg.serve.port, "tiny", record["log"])
    try:
        print(f"serve stage (vLLM ready + answer) in {time.monotonic() - t1:.1f}s (pid {handle.pid}): {result['answer']!r}")
        assert result["running"] and result["api_key_from"] == f"environment variable {KEY_ENV}"
        im_end = tok.convert_tokens_to_ids(IM_END)
        for name, expected in (("tiny", base_ids), ("tiny-lora", lora_ids)):
            ids, text = _vllm_greedy(handle, name, tok, key)
            assert ids == expected, f"{name}: vLLM {ids} != transformers {expected}"
            assert text == tok.decode(expected, skip_special_tokens=True)
            print(f"{name}: {len(ids)} tokens, stopped at <|im_end|>: {ids[-1] == im_end}, text {text!r}")
        answer = vs.chat(handle, MESSAGES, max_tokens=MAX_TOKENS, api_key=key, **_no_bytes(tok))
        assert answer == tok.decode(base_ids, skip_special_tokens=True)

        # The key guards every route but /health, /invocations (vLLM leaves it open) included.
        chat_body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
        for path, body in (("/v1/chat/completions", chat_body), ("/v1/models", None), ("/invocations", chat_body),
                           ("/tokenize", {"model": "tiny", "prompt": "hello"}), ("/metrics", None)):
            assert _status(handle, path, body) == 401, path
            assert _status(handle, path, body, api_key=key[:-1]) == 401, path
            assert _status(handle, path, body, api_key=key) == 200, path
        assert _status(handle, "/health") == 200
        assert {m["id"] for m in vs.get_json(handle, "/v1/models", api_key=key)["data"]} == {"tiny", "tiny-lora"}

        # The key reached vLLM only through its environment: not argv, files or logs.
        assert Path(f"/proc/{handle.pid}/environ").read_bytes().count(f"VLLM_API_KEY={key}".encode()) == 1
        for pid in {handle.pid, *vs._group_members(handle.pid)}:
            assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
        files = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
        assert {"server.json", "answer.json", "serve.log"} <= {p.name for p in files}
        for p in files:
            assert key.encode() not in p.read_bytes(), p
        assert key not in caplog.text and "served" in caplog.text
    finally:
        t1 = time.monotonic()
        vs.stop_server(handle.pid)
        print(f"stopped in {time.monotonic() - t1:.1f}s")
    # Server and its EngineCore child are gone (an orphaned zombie may stay: PID 1 here does not reap).
    assert not vs.is_running(handle.pid)
    assert not vs.port_in_use(handle.host, handle.port)


# ---------------------------------------------------------------- GLM layouts: our export in vLLM

def _glm_export(tmp: Path, arch: str = "glm4"):
    """The DAG's path on a tiny random Glm4ForCausalLM or GlmForCausalLM (hidden 64, 2 heads of 32: a vLLM CPU
    head size; half of each head rotated, q/k/v bias, fused gate_up_proj; GLM-4-0414 adds sandwich norms):
    import it into our decoder, a LoRA on every projection (gate_up_proj included) as SFT and another as DPO,
    then the export stage writes export/merged, the PEFT adapters and (GLM-4-0414) their split vLLM forms."""
    import transformers

    from artifacts import MANIFEST
    from model.adapters import load_policy, save_adapter
    from export import export
    from model import inject_lora
    from model.hf import HF_ARCHITECTURES, load_hf, save_native
    from model.lora import lora_modules

    hf_dir = tmp / "hf"
    train_tokenizer([_corpus(tmp / "corpus.jsonl")], hf_dir, vocab_size=400)
    tok = load_tokenizer(hf_dir)
    im_end = tok.convert_tokens_to_ids(IM_END)
    torch.manual_seed(0)
    hf_class = HF_ARCHITECTURES[arch]
    config_class = getattr(transformers, hf_class.replace("ForCausalLM", "Config"))
    config = config_class(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                          initializer_range=0.1, bos_token_id=tok.bos_token_id, eos_token_id=im_end,
                          pad_token_id=tok.pad_token_id)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5 and config.attention_bias
    hf = getattr(transformers, hf_class)(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias") or "norm" in name:   # biases 0 and norms 1 at init: make them matter
                p.add_(0.2 * torch.randn_like(p))
    hf.save_pretrained(hf_dir, safe_serialization=True)   # (its adapted answer stops at <|im_end|> by itself)

    stage_dirs = {name: tmp / name for name in ("base", "sft", "dpo")}
    for d in stage_dirs.values():
        d.mkdir()
        (d / MANIFEST).write_text(json.dumps({"metrics": {}}))
    save_native(load_hf(hf_dir), stage_dirs["base"])
    lora = LoRAConfig(r=8, alpha=16)           # target_modules: all-linear
    for name, std in (("sft", 0.2), ("dpo", 0.1)):
        model = load_policy(stage_dirs["base"], *([stage_dirs["sft"]] if name == "dpo" else []))
        inject_lora(model, lora.target_modules, lora.r, lora.alpha)
        with torch.no_grad():
            for m in lora_modules(model).values():
                m.lora_B.weight.normal_(std=std)
        save_adapter(model, lora, stage_dirs[name])
    cfg = Config(run_name=arch, runs_dir=tmp / "runs", eval={"enabled": False})
    out = tmp / "out"
    out.mkdir()
    meta = export(cfg, stage_dirs["base"], stage_dirs["sft"], stage_dirs["dpo"], hf_dir, out)
    assert meta["vllm_split_adapters"] is (arch == "glm4")
    assert json.loads((out / "merged" / "config.json").read_text())["architectures"] == [hf_class]
    return tok, out


def _our_greedy(model, tok, messages) -> list[int]:
    """Our decoder's greedy tokens, byte tokens suppressed as on the other sides (no KV cache: tiny model)."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    im_end, banned = tok.convert_tokens_to_ids(IM_END), _byte_ids(tok)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids + out]))[0, -1]
            logits[banned] = float("-inf")
            out.append(int(logits.argmax()))
            if out[-1] == im_end:
                break
    return out


def _our_logprobs(model, tok, messages, answer: list[int]) -> torch.Tensor:
    """log p(token) of each answer token under our decoder (raw logits, no suppression)."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        logp = model(torch.tensor([ids + answer]))[0, len(ids) - 1:-1].log_softmax(-1)
    return logp.gather(-1, torch.tensor(answer)[:, None])[:, 0]


@pytest.mark.parametrize("arch", ["glm4", "glm"])
def test_vllm_serves_our_glm_export_and_its_lora(tmp_path: Path, arch: str, monkeypatch) -> None:
    """One server per layout: the serve stage promotes export/merged and also loads adapters/sft.
    glm4 (Glm4ForCausalLM, native in vLLM) gets the split form adapters/sft-vllm (it refuses LoRA on the
    fused gate_up_proj); glm (GlmForCausalLM, vLLM's Transformers backend) the fused PEFT adapter as it is.
    vLLM puts an adapter on the model it serves, so the LoRA answer is compared with the same adapter on the
    same weights (export/merged) in transformers + PEFT (fused form) and in our decoder."""
    import transformers
    from peft import PeftModel

    from model.adapters import apply_adapter
    from model.hf import HF_ARCHITECTURES, load_hf

    t0 = time.monotonic()
    tok, out = _glm_export(tmp_path, arch)
    merged_dir, adapter_dir = out / "merged", out / "adapters" / "sft"
    ours = load_hf(merged_dir).eval()
    base_ids = _our_greedy(ours, tok, MESSAGES)
    ours_lora = apply_adapter(load_hf(merged_dir), tmp_path / "sft", merge=False).eval()   # our adapter format
    lora_ids = _our_greedy(ours_lora, tok, MESSAGES)
    hf = getattr(transformers, HF_ARCHITECTURES[arch]).from_pretrained(merged_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, adapter_dir).eval()
    assert _hf_greedy(peft_model, tok, MESSAGES) == lora_ids, "transformers + PEFT (fused) != our decoder + adapter"
    with peft_model.disable_adapter():
        assert _hf_greedy(peft_model, tok, MESSAGES) == base_ids, "transformers != our decoder on export/merged"
    assert base_ids != lora_ids, "the adapter should change the greedy answer"
    print(f"\n{arch} export + references: {time.monotonic() - t0:.1f}s; base {len(base_ids)} tokens, "
          f"lora {len(lora_ids)}")

    key = "glm-lora-test-" + secrets.token_urlsafe(24)
    monkeypatch.setenv(KEY_ENV, key)
    t1 = time.monotonic()
    cfg, result = _serve_stage(tmp_path, merged_dir, adapter_dir, monkeypatch)
    record = json.loads((cfg.stage_dir("serve") / "server.json").read_text())
    handle = vs.ServerHandle(record["pid"], cfg.serve.host, cfg.serve.port, "tiny", record["log"])
    try:
        print(f"serve stage (vLLM ready + answer) in {time.monotonic() - t1:.1f}s: {result['answer']!r}, "
              f"in-process {result['inprocess_answer']!r}")
        log = Path(record["log"]).read_text(errors="replace")
        served = adapter_dir.with_name("sft-vllm") if arch == "glm4" else adapter_dir
        assert f"tiny-lora={served.resolve()}" in log
        for name, expected, model in (("tiny", base_ids, ours), ("tiny-lora", lora_ids, ours_lora)):
            body = {"model": name, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                    "return_token_ids": True, "logprobs": True, **_no_bytes(tok)}
            choice = vs.post_json(handle, "/v1/chat/completions", body, api_key=key)["choices"][0]
            ids, text = choice["token_ids"], choice["message"]["content"]
            assert ids == expected, f"{name}: vLLM {ids} != ours {expected}"
            assert text == tok.decode(expected, skip_special_tokens=True)
            # vLLM's logprobs are the raw model's (before logit_bias): the same numbers as ours, to fp32 noise
            theirs = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
            diff = (theirs - _our_logprobs(model, tok, MESSAGES, ids)).abs().max().item()
            print(f"{arch} {name}: {len(ids)} tokens equal to ours, chosen-token logprob max abs diff {diff:.1e}, "
                  f"text {text!r}")
            assert diff < 1e-4
    finally:
        vs.stop_server(handle.pid)
    assert not vs.is_running(handle.pid)
