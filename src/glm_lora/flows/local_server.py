"""A local Prefect server as a child process, for checks that need a real one (a database of their choice,
an auth string, a browser): `with local_prefect_server(env, port): ...`. scripts/run.sh starts the
long-lived one users watch."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from typing import Iterator, Sequence


@contextlib.contextmanager
def local_prefect_server(env: dict, port: int, timeout_s: float = 120,
                        args: Sequence[str] = ()) -> Iterator[subprocess.Popen]:
    """`prefect server start` on 127.0.0.1:port with `env` (PREFECT_HOME, database URL, auth ...) and its
    options `args` (e.g. --no-services) in its own session; yields once /api/health answers, raises RuntimeError if
    it does not within timeout_s; stopped on exit."""
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               str(port), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"the Prefect server on port {port} did not become healthy in "
                                       f"{timeout_s:.0f} s (exit code {server.poll()})") from None
                time.sleep(1)
        yield server
    finally:
        server.terminate()
        server.wait(timeout=30)
