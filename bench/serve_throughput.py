"""Serving throughput on the CPU: vLLM against a plain transformers `generate` loop, same export, same run.

32 concurrent chat requests × 64 generated tokens each (greedy, the end-of-turn token ignored so every
answer is exactly 64 tokens), one provider at a time, each after a warm-up round, median of --rounds:

    vllm_merged     vLLM (CPU build) serving export/merged as one model (serve.adapters: false)
    vllm_adapters   vLLM serving export/sft_merged with the DPO adapter as the final model (the default
                    deployment: every request goes through the LoRA path)
    hf_loop         transformers generate, one request after another (the plain loop)
    hf_batched      transformers generate, the 32 requests in one left-padded batch

    python -m bench.serve_throughput                    # a random-weight export at the tiny default's shape
    python -m bench.serve_throughput --export runs/tiny/export

Writes bench/results/serve_throughput_<date>_<commit>.json (never over an earlier file).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

PROMPTS = ["What is 12 + 7?", "计算 45 + 38。", "What is 91 minus 17?", "计算 80 - 26。", 'Copy the word "planet".',
           "请重复“山水”。", 'Spell "garden" in reverse order.', "请把“猫狗鱼”倒过来写。"]
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def tiny_shaped_export(tmp: Path) -> Path:
    """Random weights in the tiny default's exact shape (configs/tiny.yaml: qwen3, 192 wide, 3 layers, its LoRA
    ranks and modules_to_save), through our own export: throughput does not depend on what was learnt."""
    import random

    from glm_lora.artifacts.manifest import write_manifest
    from glm_lora.configs.load import load_config
    from glm_lora.data.tokenizer import train_tokenizer, load_tokenizer
    from glm_lora.engine.fit import decoder_config
    from glm_lora.export.hf_peft import export
    from glm_lora.model import inject_lora
    from glm_lora.model.adapters import load_policy, save_adapter
    from glm_lora.model.hf import save_native
    from glm_lora.model.lora import lora_modules
    from glm_lora.model.model import Decoder

    cfg = load_config("tiny", {"runs_dir": str(tmp / "runs"), "eval.enabled": False})
    rng = random.Random(0)
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": p + " " + " ".join(str(rng.randint(0, 999)) for _ in range(4))},
                                         ensure_ascii=False) + "\n" for p in PROMPTS * 200))
    tok_dir = tmp / "tokenizer"
    train_tokenizer([corpus], tok_dir, vocab_size=cfg.tokenizer.vocab_size)
    torch.manual_seed(0)
    dirs = {n: tmp / n for n in ("base", "sft", "dpo")}
    for d in dirs.values():
        d.mkdir()
        (d / "manifest.json").write_text(json.dumps({"metrics": {}}))
    save_native(Decoder(decoder_config(cfg, len(load_tokenizer(tok_dir)))), dirs["base"])
    for name, lora in (("sft", cfg.sft.lora), ("dpo", cfg.dpo.lora)):
        model = load_policy(dirs["base"], *([dirs["sft"]] if name == "dpo" else []))
        inject_lora(model, lora)
        with torch.no_grad():
            for m in lora_modules(model).values():
                m.lora_B.weight.normal_(std=0.02)
        save_adapter(model, lora, dirs[name])
    out = tmp / "export"
    out.mkdir()
    write_manifest(out, "export", metrics=export(cfg, dirs["base"], dirs["sft"], dirs["dpo"], tok_dir, out))
    return out


def _chat(url: str, model: str, prompt: str, tokens: int) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "min_tokens": tokens, "ignore_eos": True, "temperature": 0.0}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with _LOCAL.open(req, timeout=600) as r:
        return json.load(r)["usage"]["completion_tokens"]


def vllm_round(url: str, model: str, n: int, tokens: int) -> tuple[float, int]:
    """n concurrent requests; (wall seconds, generated tokens)."""
    counts = [0] * n

    def one(i: int) -> None:
        counts[i] = _chat(url, model, PROMPTS[i % len(PROMPTS)], tokens)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, sum(counts)


def hf_round(model, tok, n: int, tokens: int, batched: bool) -> tuple[float, int]:
    chats = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                     add_generation_prompt=True, tokenize=False) for i in range(n)]
    t0 = time.perf_counter()
    produced = 0
    with torch.no_grad():
        for group in ([chats] if batched else [[c] for c in chats]):
            enc = tok(group, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                                 pad_token_id=tok.pad_token_id)
            produced += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    return time.perf_counter() - t0, produced


def measure(name: str, round_fn, rounds: int) -> dict:
    round_fn()                                      # warm-up
    walls, tokens = [], 0
    for _ in range(rounds):
        wall, tokens = round_fn()
        walls.append(wall)
    wall = statistics.median(walls)
    row = {"provider": name, "wall_s": [round(w, 3) for w in walls], "median_wall_s": round(wall, 3),
           "tokens_per_round": tokens, "tokens_per_s": round(tokens / wall, 1)}
    print(row, flush=True)
    return row


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.common import write_result
    from glm_lora.serve import vllm_server as vs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", help="an export directory (default: a random one in the tiny default's shape)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="glm-lora-serve-bench-"))
    export = Path(args.export).resolve() if args.export else tiny_shaped_export(tmp)
    n, k = args.requests, args.tokens
    rows = []

    tok = AutoTokenizer.from_pretrained(export / "merged")
    tok.padding_side = "left"
    hf = AutoModelForCausalLM.from_pretrained(export / "merged", dtype=torch.float32).eval()
    for name, batched in (("hf_loop", False), ("hf_batched", True)):
        rows.append(measure(name, lambda: hf_round(hf, tok, n, k, batched=batched), args.rounds))

    for name, model_dir, lora in (("vllm_merged", export / "merged", None),
                                  ("vllm_adapters", export / "sft_merged", {"tiny": export / "adapters" / "dpo"})):
        port = vs_port()
        t0 = time.perf_counter()
        handle = vs.start_server(model_dir, port=port, served_model_name="tiny-base" if lora else "tiny",
                                 lora_modules=lora, log_path=tmp / f"{name}.log", max_num_seqs=max(n, 1))
        try:
            vs.wait_healthy(handle, timeout_s=600)
            ready = time.perf_counter() - t0
            row = measure(name, lambda: vllm_round(handle.base_url, "tiny", n, k), args.rounds)
            rows.append({**row, "server_ready_s": round(ready, 1)})
        finally:
            vs.stop_server(handle.pid)

    best_hf = {r["provider"]: r["tokens_per_s"] for r in rows if r["provider"].startswith("hf")}
    ratios = {f"{r['provider']}_vs_{h}": round(r["tokens_per_s"] / v, 2)
              for r in rows if r["provider"].startswith("vllm") for h, v in best_hf.items()}
    figures = {"export": str(export) if args.export else "random weights, tiny default shape (configs/tiny.yaml)",
               "requests": n, "tokens_per_request": k, "rounds": args.rounds, "torch_threads": torch.get_num_threads(),
               "rows": rows, "ratios": ratios, "target": "vLLM ≥ 5× the transformers generate loop"}
    print(json.dumps(ratios, indent=2))
    print(write_result("serve_throughput", figures))


def vs_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
