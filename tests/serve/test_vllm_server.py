"""Our GLM exports in vLLM (CPU), through the real serve stage: export/sft_merged served as `<run>-sft`, the DPO
adapter on it as `<run>` and `<run>-dpo` — for GLM-4-0414 (Glm4ForCausalLM, native in vLLM) in the split
`adapters/dpo-vllm` form (vLLM refuses a LoRA on the fused gate_up_proj), for GLM (GlmForCausalLM, vLLM's
Transformers backend) in the fused PEFT form as it is. Greedy token ids and log-probs must equal our decoder's
and transformers + PEFT's. (Llama and Qwen3, the API key and the deployment itself: test_deployment.py.)
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from glm_lora.configs.load import load_config
from glm_lora.data.tokenizer import load_tokenizer
from glm_lora.serve import deploy
from glm_lora.serve import vllm_server as vs
from serve_helpers import NEEDS_VLLM_AND_NGINX, build_export, free_port

pytestmark = NEEDS_VLLM_AND_NGINX

MAX_TOKENS = 24
MESSAGES = [{"role": "user", "content": "reverse hello 你好"}]


def _our_greedy(model, tok, stops) -> list[int]:
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            out.append(int(model(torch.tensor([ids + out]))[0, -1].argmax()))
            if out[-1] in stops:
                return out[:-1]
    return out


def _our_logprobs(model, tok, answer: list[int]) -> torch.Tensor:
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        logp = model(torch.tensor([ids + answer]))[0, len(ids) - 1:-1].log_softmax(-1)
    return logp.gather(-1, torch.tensor(answer)[:, None])[:, 0]


@pytest.mark.parametrize("arch", ["glm4", "glm"])
def test_vllm_serves_our_glm_export_and_its_adapter(tmp_path: Path, arch: str) -> None:
    import transformers
    from peft import PeftModel

    from glm_lora.data.tokenizer import end_of_turn_ids
    from glm_lora.model.adapters import apply_adapter
    from glm_lora.model.hf import HF_ARCHITECTURES, load_hf
    from glm_lora.serve.smoke import ask
    from glm_lora.serve.stage import serve

    t0 = time.monotonic()
    export = build_export(tmp_path, arch)
    assert (export / "adapters" / "dpo-vllm").is_dir() is (arch == "glm4")
    sft_merged = export / "sft_merged"
    tok = load_tokenizer(sft_merged)
    stops = end_of_turn_ids(tok)
    ours = {"tiny-sft": load_hf(sft_merged).eval(),
            "tiny": apply_adapter(load_hf(sft_merged), tmp_path / "dpo", merge=False).eval()}   # our adapter format
    expected = {name: _our_greedy(m, tok, stops) for name, m in ours.items()}
    hf = getattr(transformers, HF_ARCHITECTURES[arch]).from_pretrained(sft_merged, dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, export / "adapters" / "dpo").eval()      # the fused PEFT form
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = peft.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=stops, pad_token_id=tok.pad_token_id)
    hf_ids = out[0, len(prompt):].tolist()
    assert (hf_ids[:-1] if hf_ids[-1] in stops else hf_ids) == expected["tiny"], "transformers + PEFT != ours"
    assert expected["tiny"] != expected["tiny-sft"], "the adapter should change the greedy answer"
    print(f"\n{arch} export + references: {time.monotonic() - t0:.1f}s")

    cfg = load_config("tiny", {"runs_dir": str(tmp_path / "runs"), "serve.port": free_port(),
                               "serve.max_tokens": MAX_TOKENS})
    out_dir = tmp_path / "stage-out"
    out_dir.mkdir()
    t1 = time.monotonic()
    result = serve(cfg, export, out_dir)       # its smoke test already requires our greedy ids for every name
    dep = deploy.Deployment.of(cfg)
    try:
        print(f"serve stage (vLLM ready + smoke test + nginx) in {time.monotonic() - t1:.1f}s")
        log = Path(json.loads(dep.record.read_text())["active"]["log"]).read_text(errors="replace")
        form = "dpo-vllm" if arch == "glm4" else "dpo"
        assert f"tiny={(Path(result['served_from']) / 'adapters' / form).resolve()}" in log
        for name, model in ours.items():
            answer = ask(dep.url, name, MESSAGES, MAX_TOKENS, None)
            ids = answer["ids"][:-1] if answer["ids"] and answer["ids"][-1] in stops else answer["ids"]
            assert ids == expected[name], f"{name}: vLLM {ids} != ours {expected[name]}"
            # vLLM's log-probs are the raw model's: the same numbers as ours, to fp32 noise (the stop token's too, so
            # an answer that stops at once still compares one)
            scored = answer["ids"][:len(answer["logprobs"])]
            assert scored, f"{name}: vLLM returned no log-probs"
            diff = (torch.tensor(answer["logprobs"][:len(scored)]) - _our_logprobs(model, tok, scored)).abs().max().item()
            print(f"{arch} {name}: {len(ids)} tokens equal to ours, log-prob max abs diff {diff:.1e}")
            assert diff < 1e-4
    finally:
        deploy.stop(dep)
    assert not vs.is_running(result["pid"]) and not vs.port_in_use("127.0.0.1", cfg.serve.port)
