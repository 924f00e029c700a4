"""A real MLflow tracking server for tests, the way a team runs one: `mlflow server` on a free loopback port, its
runs in sqlite and its artifacts proxied through it, all under one directory. Started without waiting (`wait()`
later), so a test session can start it beside something else slow (tests/test_dag.py: the Prefect harness)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


class MlflowServer:
    def __init__(self, root: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{port}", root / "server.log"
        # Its background job runner (for GenAI features) is a second process this test does not need.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                 "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
                 "--workers", "1"], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait(self, timeout_s: float = 180) -> str:
        """The server's URL once /health answers; RuntimeError with its log's tail if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return self.url
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
                    raise RuntimeError(f"mlflow server at {self.url} not healthy (exit code {self.proc.poll()}):\n"
                                       f"{tail}") from None
                time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to its process group (the CLI and its uvicorn worker), SIGKILL if still there after 20 s."""
        for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=grace)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue
