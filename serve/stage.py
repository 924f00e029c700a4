"""The serve stage: promote the merged export to a vLLM OpenAI server and ask it one question.

The previous server of this run (if its record says it is ours) is stopped first; the new one
is recorded in `server.json`. Our own in-process greedy answer is recorded beside vLLM's, so
parity is visible in every run.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from artifacts import read_manifest
from configs.errors import UserError
from configs.schema import Config, ServeConfig
from engine.gate import promotion_gate
from data.tokenizer import end_of_turn_ids, load_tokenizer
from engine.evaluate import greedy_decode
from model.hf import load_hf
from serve.vllm_server import chat_choice, port_in_use, start_server, stop_server, wait_healthy

log = logging.getLogger("glm_lora.serve")
RECORD = "server.json"


def stop_recorded_server(serve_dir: Path) -> bool:
    record = Path(serve_dir) / RECORD
    if not record.is_file():
        return False
    info = json.loads(record.read_text())
    if info.get("running"):
        stop_server(info["pid"])
        log.info("stopped the previous server (pid %s, %s)", info["pid"], info["url"])
        return True
    return False


def inprocess_answer(model_dir: Path, messages: list[dict], max_tokens: int) -> tuple[str, list[int]]:
    """Our own greedy answer (text, token ids without the stop token) from the exported model."""
    tok = load_tokenizer(model_dir)
    model = load_hf(model_dir).eval()
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt, list):
        prompt = prompt["input_ids"]
    stops = end_of_turn_ids(tok)
    with torch.no_grad():     # stops where the template's turn ends, like the server (generation_config.json)
        out = greedy_decode(model, [list(prompt)], max_new_tokens=max_tokens, eos_id=stops)[0]
    return tok.decode(out, skip_special_tokens=True), _without_stop(out, stops)


def _without_stop(ids: list[int], stops: list[int]) -> list[int]:
    return list(ids[:-1]) if ids and ids[-1] in stops else list(ids)


def _same_answer(served_ids: list[int] | None, our_ids: list[int], served: str, ours: str, stops: list[int]) -> bool:
    """Greedy parity, token for token (text can differ where a byte-level piece ends mid-character);
    by text only if the server returned no token ids."""
    if served_ids is None:
        return served.strip() == ours.strip()
    return _without_stop(served_ids, stops) == our_ids


def api_key(sc: ServeConfig) -> tuple[str | None, str | None]:
    """(key, where it came from) for the served endpoint; the key never goes into a file or log."""
    if sc.api_key_env:
        key = os.environ.get(sc.api_key_env)
        if not key:
            raise UserError(f"serve.api_key_env: the environment variable {sc.api_key_env} is unset or empty; "
                            "export the key in it where the flow runs (the worker's environment) or unset the option")
        return key, f"environment variable {sc.api_key_env}"
    if sc.api_key_secret:
        from prefect.blocks.system import Secret
        try:
            key = Secret.load(sc.api_key_secret).get()
        except ValueError as e:   # no such block
            raise UserError(f"serve.api_key_secret: cannot load the Prefect Secret block {sc.api_key_secret!r} ({e})") from None
        if not key or not isinstance(key, str):
            raise UserError(f"serve.api_key_secret: the Prefect Secret block {sc.api_key_secret!r} must hold a non-empty string")
        return key, f"Prefect Secret block {sc.api_key_secret}"
    return None, None


class GateFailed(UserError, RuntimeError):
    pass


def served_record(serve_dir: Path) -> dict | None:
    record = Path(serve_dir) / RECORD
    return json.loads(record.read_text()) if record.is_file() else None


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    """The serve stage (tasks/table.py)."""
    return serve(cfg, inputs["export"], out_dir)


def serve(cfg: Config, export_dir: Path, out_dir: Path) -> dict:
    sc = cfg.serve
    final_dir = cfg.stage_dir("serve")
    key, key_source = api_key(sc)   # before anything is stopped or started
    # ---- promotion gate: the old model keeps serving unless the new one passes
    candidate = read_manifest(Path(export_dir))["metrics"].get("eval", {})
    previous = served_record(final_dir)
    served = previous.get("eval") if previous and previous.get("running") else None
    gate = promotion_gate(candidate, served, thresholds=sc.gate.min, no_regression=sc.gate.no_regression,
                          tolerance=sc.gate.tolerance)
    (Path(out_dir) / "gate.md").write_text(gate.table)
    log.info("promotion gate:\n%s", gate.table)
    if not gate.ok:
        raise GateFailed("promotion gate failed; the served model stays: " + "; ".join(gate.reasons))
    stop_recorded_server(final_dir)
    if port_in_use(sc.host, sc.port):
        raise RuntimeError(f"port {sc.port} on {sc.host} is taken by another process; set serve.port to a free port")
    model_dir = Path(export_dir) / "merged"
    messages = [{"role": "user", "content": sc.prompt}]
    t0 = time.perf_counter()
    handle = start_server(model_dir, port=sc.port, host=sc.host, served_model_name=cfg.run_name, dtype=sc.dtype,
                          max_model_len=sc.max_model_len, kv_cache_bytes=sc.kv_cache_bytes,
                          log_path=final_dir.parent / "serve.log", api_key=key)
    try:
        wait_healthy(handle, timeout_s=sc.startup_timeout_s)
        ready_s = time.perf_counter() - t0
        choice = chat_choice(handle, messages, max_tokens=sc.max_tokens, temperature=0.0, api_key=key,
                             return_token_ids=True)
        answer, served_ids = choice["message"]["content"], choice.get("token_ids")
        ours, our_ids = inprocess_answer(model_dir, messages, sc.max_tokens)
    except BaseException:   # no record is written: nothing else could stop this server
        stop_server(handle.pid)
        raise
    running = sc.keep_running
    if not running:
        stop_server(handle.pid)
    record = {"pid": handle.pid, "url": handle.base_url, "model": cfg.run_name, "running": running,
              "log": str(handle.log_path), "model_dir": str(model_dir), "eval": candidate, "api_key_from": key_source}
    (Path(out_dir) / RECORD).write_text(json.dumps(record, indent=2))
    result = {"endpoint": f"{handle.base_url}/v1/chat/completions", "model": cfg.run_name, "prompt": sc.prompt,
              "answer": answer, "inprocess_answer": ours, "matches_inprocess": _same_answer(
                  served_ids, our_ids, answer, ours, end_of_turn_ids(load_tokenizer(model_dir))),
              "token_ids": served_ids, "inprocess_token_ids": our_ids,
              "ready_s": round(ready_s, 1), "running": running, "gate": gate.table, "api_key_from": key_source}
    (Path(out_dir) / "answer.json").write_text(json.dumps(result, indent=2, ensure_ascii=False))
    log.info("served %s: %r -> %r (in-process: %r)", result["endpoint"], sc.prompt, answer, ours)
    return result
