"""The local Prefect server of scripts/run.sh checks the auth string that scripts/env.sh generates
(README "Security"): a real `prefect server start` with it refuses API calls without it, and clients
set up by env.sh (the CLI, a Secret block load) get through."""
from __future__ import annotations

import base64
import http.server
import json
import os
import signal
import socket
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(home: Path, api_url: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}   # not the test session's own
    return {**env, "PREFECT_HOME": str(home), "PREFECT_API_URL": api_url}


def _bash(command: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"source scripts/env.sh && {command}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)


def _status(url: str, auth: str | None = None) -> int:
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        with _LOCAL.open(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except urllib.error.URLError:
        return 0   # not listening (yet)


@pytest.fixture
def prefect_server(tmp_path: Path):
    """`prefect server start` as scripts/run.sh starts it (env.sh sourced), on a free port; stopped after."""
    port = _free_port()
    env = _env(tmp_path / "home", f"http://127.0.0.1:{port}/api")
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(["bash", "-c", f"source scripts/env.sh && exec prefect server start --host 127.0.0.1 --port {port}"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        while _status(env["PREFECT_API_URL"] + "/health") != 200:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() - t0 < 120, "Prefect server not healthy after 120 s"
            time.sleep(0.5)
        print(f"\nPrefect server healthy in {time.monotonic() - t0:.1f}s")
        yield env, proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_server_requires_the_auth_string(prefect_server, tmp_path: Path) -> None:
    env, proc = prefect_server
    api, home = env["PREFECT_API_URL"], Path(env["PREFECT_HOME"])
    auth_file = home / "auth"
    assert stat.S_IMODE(auth_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    auth = auth_file.read_text().strip()
    assert len(auth) > 40

    assert _status(api + "/version") == 401
    assert _status(api + "/version", auth + "x") == 401
    assert _status(api + "/version", auth) == 200
    assert _status(api + "/health") == 200                        # open: liveness probe
    assert _status(api.removesuffix("/api") + "/") == 200          # the UI's static files, which then ask for it:
    with _LOCAL.open(api.removesuffix("/api") + "/ui-settings", timeout=10) as r:
        assert json.load(r)["auth"] == "BASIC"
    assert auth.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()

    # Clients that source env.sh send it: the CLI (as run.sh uses it) and a Secret block for serve.api_key_secret.
    cli = _bash("prefect --no-prompt work-pool create auth-test --type process && prefect work-pool inspect auth-test", env)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    # prefect.yaml registers as run.sh registers it: full, nightly, and the serve deployment (promote / roll back)
    deploy = _bash("prefect --no-prompt work-pool create glm-lora --type process >/dev/null && prefect --no-prompt "
                   "deploy --all >/dev/null && prefect deployment ls", env)
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    for name in ("glm-lora/full", "glm-lora/nightly", "glm-lora-serve/serve"):
        assert name in deploy.stdout, deploy.stdout
    script = """
from prefect.blocks.system import Secret
from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import ServeConfig
from glm_lora.serve.stage import api_key
Secret(value="k3y-from-block").save("glm-serve-key")
print(api_key(ServeConfig(api_key_secret="glm-serve-key")))
try:
    api_key(ServeConfig(api_key_secret="no-such-block"))
except UserError as e:
    print(e)
"""
    secret = _bash(f"python -c '{script}'", env)
    assert secret.returncode == 0, secret.stdout + secret.stderr
    assert "('k3y-from-block', 'Prefect Secret block glm-serve-key')" in secret.stdout
    assert "serve.api_key_secret: cannot load the Prefect Secret block 'no-such-block'" in secret.stdout

    # run.sh's check accepts this server, refuses it with another auth string and refuses one without auth.
    assert _bash("require_prefect_auth", env).returncode == 0
    other = _bash("require_prefect_auth", {**env, "PREFECT_HOME": str(tmp_path / "other-home")})
    assert other.returncode == 1 and "refuses the auth string" in other.stderr and "scripts/stop.sh" in other.stderr


def test_run_refuses_a_server_without_auth(tmp_path: Path) -> None:
    """An older run's server (no auth) answers every call: run.sh must stop, not use it."""
    class Open(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"true")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Open)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = _bash("require_prefect_auth", _env(tmp_path / "home", f"http://127.0.0.1:{server.server_port}/api"))
    finally:
        server.shutdown()
    assert r.returncode == 1
    assert "without credentials" in r.stderr and "bash scripts/stop.sh" in r.stderr
