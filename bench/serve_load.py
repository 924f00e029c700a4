"""Bounded load on a served endpoint: N concurrent clients (the `openai` client, no retries) send chat
requests back to back for T seconds, each at most `max_requests`; every error counts. Loopback only.

    python -m bench.serve_load --url http://127.0.0.1:8765 --model tiny --clients 8 --seconds 30
    (with an API key: --key-env NAME)

Writes bench/results/serve_load_<date>_<commit>.json (never over an earlier file); tests/serve/
test_deployment.py runs `run_load` against the tiny model it deploys (0 errors required).
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from urllib.parse import urlparse

PROMPTS = ["What is 12 + 7?", "计算 45 + 38。", 'Copy the word "planet".', "请把“猫狗鱼”倒过来写。", "3 km = ? m"]


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))] if values else float("nan")


def run_load(url: str, *, models: list[str], key: str | None, clients: int = 8, seconds: float = 15.0,
             max_requests: int = 200, max_tokens: int = 16) -> dict:
    """Each client cycles through `models` and PROMPTS; returns counts, errors (first 5 kept), latency
    percentiles (ms) and completion tokens per second over the wall time."""
    from openai import OpenAI

    host = urlparse(url).hostname
    if host not in ("127.0.0.1", "::1", "localhost"):
        raise ValueError(f"load tests run on loopback only, not {host}")
    latencies: list[float] = []
    errors: list[str] = []
    tokens = [0]
    lock = threading.Lock()
    deadline = 0.0

    def client(i: int) -> None:
        api = OpenAI(base_url=url + "/v1", api_key=key or "unused", max_retries=0, timeout=120)
        n = 0
        while time.monotonic() < deadline and n < max_requests:
            model, prompt = models[(i + n) % len(models)], PROMPTS[(i + n) % len(PROMPTS)]
            t0 = time.perf_counter()
            try:
                r = api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0.0)
                with lock:
                    latencies.append((time.perf_counter() - t0) * 1000)
                    tokens[0] += r.usage.completion_tokens
            except Exception as e:      # noqa: BLE001 — every failure is a finding here
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:300])
            n += 1

    warm = OpenAI(base_url=url + "/v1", api_key=key or "unused", max_retries=0, timeout=120)
    for model in models:        # the first request per name loads its adapter and warms the kernels: not timed
        warm.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                     max_tokens=max_tokens, temperature=0.0)
    deadline = time.monotonic() + seconds
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "seconds": seconds, "models": models, "max_tokens": max_tokens,
            "requests": len(latencies) + len(errors), "errors": len(errors), "error_examples": errors[:5],
            "p50_ms": round(_percentile(latencies, 0.50), 1), "p90_ms": round(_percentile(latencies, 0.90), 1),
            "p99_ms": round(_percentile(latencies, 0.99), 1), "max_ms": round(max(latencies, default=float("nan")), 1),
            "mean_ms": round(statistics.fmean(latencies), 1) if latencies else None,
            "completion_tokens_per_s": round(tokens[0] / wall, 1), "wall_s": round(wall, 1)}


def main() -> None:
    from bench.common import write_result

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8765")
    ap.add_argument("--model", action="append", required=True, help="served name (repeat for several)")
    ap.add_argument("--key-env", help="environment variable holding the endpoint's API key")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    figures = run_load(args.url, models=args.model, key=os.environ.get(args.key_env) if args.key_env else None,
                       clients=args.clients, seconds=args.seconds, max_tokens=args.max_tokens)
    print(figures)
    print(write_result("serve_load", figures))


if __name__ == "__main__":
    main()
