"""The nightly deployment never overlaps itself: prefect.yaml as `prefect deploy` reads it, on a real
Prefect server (the test harness), with the server's own concurrency orchestration deciding."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def api_url():
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness
    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


def test_nightly_declares_one_run_at_a_time():
    nightly = {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}["nightly"]
    assert nightly["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    assert nightly["schedules"][0]["cron"]


def test_a_second_nightly_while_one_runs_is_cancelled(api_url, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.states import Pending

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="glm-lora", type="process"))
    env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_HOME": str(tmp_path)}
    deploy = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--name", "nightly"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert deploy.returncode == 0, deploy.stdout[-2000:] + deploy.stderr[-2000:]

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("glm-lora/nightly")
        assert dep.global_concurrency_limit is not None and dep.global_concurrency_limit.limit == 1
        assert dep.concurrency_options.collision_strategy.value == "CANCEL_NEW"
        first, second = (client.create_flow_run_from_deployment(dep.id) for _ in range(2))
        assert client.set_flow_run_state(first.id, Pending()).state.type.value == "PENDING"
        # the second trigger while the first holds the slot: the server cancels it (no queueing, no overlap)
        assert client.set_flow_run_state(second.id, Pending()).state.type.value == "CANCELLED"


def test_training_takes_the_global_slot_only_where_the_server_has_the_limit(api_url, monkeypatch):
    """tasks.stages.train_slot: without a `glm-lora-train` limit on the server nothing is asked of it (Prefect's
    attempt is a database write that SQLite refuses while another is open, retried ~2 s later); with the limit
    (scripts/run.sh creates it) the slot is held while the stage trains and given back after."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    import glm_lora.tasks.stages as stages

    asked = []
    real = stages.concurrency
    monkeypatch.setattr(stages, "concurrency", lambda *a, **k: asked.append(a) or real(*a, **k))
    with stages.train_slot():
        pass
    assert asked == []
    with get_client(sync_client=True) as client:
        limit = client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=stages.TRAIN_SLOT, limit=1))
        try:
            with stages.train_slot():
                held = client.read_global_concurrency_limit_by_name(stages.TRAIN_SLOT).active_slots
            after = client.read_global_concurrency_limit_by_name(stages.TRAIN_SLOT).active_slots
        finally:
            client.delete_global_concurrency_limit_by_name(stages.TRAIN_SLOT)
    assert asked == [(stages.TRAIN_SLOT,)] and (held, after) == (1, 0), (asked, held, after, limit)
