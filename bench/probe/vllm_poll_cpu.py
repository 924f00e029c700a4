"""CPU a CPU vLLM server spends on the deployment tests' polling clients, alone or beside busy processes (CI's two
workers), and what its OpenMP threads' waiting does to it (bench/RESULTS.md "The deployment tests' server under load").

    PYTHONPATH=.:tests/serve python bench/probe/vllm_poll_cpu.py [--seconds 30] [--hogs 0,2] [--env '' 'OMP_WAIT_POLICY=PASSIVE']

For each environment given to the server (KEY=VALUE pairs, space-separated; '' for none) and each number of busy
processes beside it: the serve stage puts a tiny export on the stable endpoint (vLLM + nginx, as
tests/serve/test_deployment.py does), --clients clients (3: the tests' Poller) ask it back to back for --seconds (12
greedy tokens a request), and the server's processes' CPU seconds (user + system, from /proc) are divided by the answered
requests.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from glm_lora.configs.load import load_config
from glm_lora.serve import deploy
from glm_lora.serve import vllm_server as vs
from glm_lora.serve.stage import serve
from tests.serve.serve_helpers import build_export, free_port
from tests.serve.test_deployment import KEY_ENV, _chat, _overrides


def group_cpu(pgid: int) -> float:
    """User + system CPU seconds of the server's process group (the API server and its engine core)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in vs._group_members(pgid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue                                 # exited meanwhile
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def measure(export: Path, tmp: Path, env: dict, hogs: int, seconds: float, clients: int = 3) -> dict:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    key = "probe-key"
    os.environ[KEY_ENV] = key
    cfg = load_config("tiny", _overrides(tmp / f"runs-{time.monotonic_ns()}", free_port()))
    out = tmp / f"out-{time.monotonic_ns()}"
    out.mkdir()
    pid = serve(cfg, export, out)["pid"]
    dep = deploy.Deployment.of(cfg)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        time.sleep(2)
        stop, count = threading.Event(), [0]

        def poll():
            while not stop.is_set():
                if _chat(dep.url, key)[0] == 200:
                    count[0] += 1
        threads = [threading.Thread(target=poll) for _ in range(clients)]
        c0, t0 = group_cpu(os.getpgid(pid)), time.monotonic()
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        cpu, wall = group_cpu(os.getpgid(pid)) - c0, time.monotonic() - t0
    finally:
        for b in busy:
            b.kill()
        deploy.stop(dep)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return {"env": env, "hogs": hogs, "clients": clients, "requests": count[0], "wall_s": round(wall, 1), "server_cpu_s": round(cpu, 1),
            "cores": round(cpu / wall, 2), "cpu_ms_per_request": round(1000 * cpu / max(count[0], 1), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--hogs", default="0,2")
    ap.add_argument("--clients", type=int, default=3, help="clients asking back to back")
    ap.add_argument("--env", nargs="+", default=["", "OMP_WAIT_POLICY=PASSIVE"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "a").mkdir()
        export = build_export(tmp / "a", "qwen3", seed=0)
        for hogs in (int(h) for h in args.hogs.split(",")):
            for spec in args.env:
                env = dict(kv.split("=", 1) for kv in spec.split())
                print(measure(export, tmp, env, hogs, args.seconds, args.clients), flush=True)


if __name__ == "__main__":
    main()
