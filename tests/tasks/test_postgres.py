"""Prefect on PostgreSQL (README "Prefect's database"): a local PostgreSQL from Debian's package, a
Prefect server pointed at it with PREFECT_SERVER_DATABASE_CONNECTION_URL, the tiny flow run against
that server, and its task states read back from the database through the API."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from glm_lora.flows.local_server import local_prefect_server
from tests.reliability.conftest import REPO, write_config

pytestmark = pytest.mark.slow
PG_BIN = Path("/usr/lib/postgresql/15/bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(*cmd: str) -> list[str]:
    """PostgreSQL refuses to run as root; CI runs as root."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else list(cmd)


@pytest.fixture(scope="module")
def postgres():
    assert (PG_BIN / "initdb").is_file(), "PostgreSQL server binaries missing: apt-get install postgresql"
    root = Path(tempfile.mkdtemp(prefix="glm-lora-pg-"))     # pytest's tmp dirs are closed to other users
    data = root / "data"
    data.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(data, "postgres")
    port = _free_port()
    subprocess.run(_as_postgres(str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"),
                   check=True, capture_output=True)
    subprocess.run(_as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-o",
                                f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "-w", "start",
                                "-l", str(data / "server.log")), check=True, capture_output=True)
    try:
        subprocess.run(_as_postgres(str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
                                    "prefect"), check=True, capture_output=True)
        yield f"postgresql+asyncpg://postgres@127.0.0.1:{port}/prefect"
    finally:
        subprocess.run(_as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"), capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def prefect_on_postgres(postgres, tmp_path_factory):
    home, port = tmp_path_factory.mktemp("prefect-home"), _free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_DATABASE_CONNECTION_URL": postgres,
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    for auth in ("PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING"):   # this server has none
        env.pop(auth, None)
    with local_prefect_server(env, port):
        yield env


RUN_AND_READ_BACK = """
import sys, time
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from glm_lora.flows.glm_lora import glm_lora
state = glm_lora(config=sys.argv[1], return_state=True)
assert state.is_completed(), state
with get_client(sync_client=True) as client:
    for _ in range(60):
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
        if runs and all(r.state.is_final() for r in runs):
            break
        time.sleep(1)
    print("STATES", sorted((r.name.rsplit("-", 1)[0], r.state.name) for r in runs))
"""


def test_the_flow_runs_on_a_prefect_server_backed_by_postgresql(prefect_on_postgres, tmp_path, postgres):
    (tmp_path / "runs").mkdir()
    cfg = write_config(tmp_path)
    proc = subprocess.run([sys.executable, "-c", RUN_AND_READ_BACK, str(cfg)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env={**prefect_on_postgres, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    states = proc.stdout.split("STATES", 1)[1].strip()
    for stage in ("data", "tokenizer", "pretrain", "sft", "dpo", "export"):
        assert f"('{stage}', 'Completed')" in states, states
    # the rows are in PostgreSQL itself, not in a SQLite file beside it
    port = postgres.rsplit(":", 1)[1].split("/")[0]
    rows = subprocess.run(_as_postgres("psql", "-h", "127.0.0.1", "-p", port, "-U", "postgres", "-d", "prefect", "-tAc",
                                       "select count(*) from task_run"), capture_output=True, text=True, check=True)
    assert int(rows.stdout.strip()) >= 6
    assert not list(Path(prefect_on_postgres["PREFECT_HOME"]).glob("*.db"))
