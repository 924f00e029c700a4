"""The Prefect UI in a real browser: headless Chromium (Debian's package at /usr/bin/chromium, nothing downloaded)
driven by Playwright. `ui_server` serves the UI with an auth string; `check_flow_run` logs in as a user does and
reads a finished flow run's pages, returning what it did not find; screenshots go to `out`.

The UI checked is the one a user lands on: Prefect 3.9 serves its React UI ("v2") under /v2 and redirects / there.
Every wait is for what the page must show (the login form gone, a list's first row, the image decoded), bounded by
TIMEOUT_MS: a page that never shows it is reported, not waited on longer."""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from glm_lora.flows.local_server import local_prefect_server

CHROMIUM = "/usr/bin/chromium"
# --no-sandbox: Chromium's sandbox refuses to start as root (CI); the rest keep it off a network it cannot reach.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
TIMEOUT_MS = 60_000            # one page's wait on a loaded 2-core machine
VIEWPORT = {"width": 1600, "height": 1600}     # a flow run's graph and ten stages' rows, the sidebar beside them
REFUSED = "Invalid credentials"       # the login form's message for a wrong password


@dataclass
class Expected:
    """What the flow run's pages must show: each stage's state in its Task Runs tab (task runs are named
    `<stage>-<suffix>`), each artifact key with its type in its Artifacts tab, and the artifact whose page shows a PNG."""
    stages: dict[str, str]
    artifacts: dict[str, str] = field(default_factory=dict)
    image: str = ""


def dag_expected(run_name: str, stages: dict[str, str]) -> Expected:
    """A glm-lora flow run's pages: these stages in these states; each training stage among them with its metrics
    table and loss curve, the harness stage its benchmark table, the RL stage its rewards plot (tasks/report.py); the
    SFT loss curve's page showing its PNG."""
    artifacts = {}
    for stage in ("pretrain", "sft", "dpo"):
        if stage in stages:
            artifacts |= {f"{run_name}-{stage}-metrics": "table", f"{run_name}-{stage}-loss-curve": "markdown"}
    if "harness" in stages:
        artifacts[f"{run_name}-harness-benchmarks"] = "table"
    if "rl" in stages:
        artifacts[f"{run_name}-rl-rewards"] = "markdown"
    return Expected(stages, artifacts, image=f"{run_name}-sft-loss-curve")


@dataclass
class Server:
    url: str
    auth: str
    env: dict


@contextlib.contextmanager
def ui_server(home: Path, database_url: str | None = None) -> Iterator[Server]:
    """`prefect server start` with the UI and a fresh auth string on a free port, its state under `home`. With
    `database_url` (another server's database, e.g. the test harness's, which serves no UI) it only reads: no
    services, no migrations. `env` is what a client of this server needs (its API URL and the auth string)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    auth = "glm-lora:" + secrets.token_urlsafe(16)
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_API_AUTH_STRING": auth, "PREFECT_API_AUTH_STRING": auth, "PREFECT_SERVER_UI_ENABLED": "true",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    args: list[str] = []
    if database_url:
        env |= {"PREFECT_SERVER_DATABASE_CONNECTION_URL": database_url,
                "PREFECT_SERVER_DATABASE_MIGRATE_ON_START": "false"}
        args = ["--no-services"]
    with local_prefect_server(env, port, args=args):
        yield Server(f"http://127.0.0.1:{port}", auth, env)


def check_flow_run(server: Server, flow_run_id: str, expected: Expected, out: Path) -> list[str]:
    """Log in, open the flow run (screenshot ui-flow-run.png: its graph and Task Runs tab), read each stage's state,
    its Artifacts tab (ui-artifacts.png) and the image artifact's page (ui-loss-curve.png). Returns what was not
    found or not as expected, one line each; empty when the UI shows everything."""
    from playwright.sync_api import Error, sync_playwright
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(TIMEOUT_MS)
            try:
                return _check(page, server, flow_run_id, expected, out)
            except Error as e:          # a page that never showed what it must: name it, keep its screenshot
                page.screenshot(path=str(out / "ui-failure.png"))
                what = [line.strip() for line in e.message.splitlines() if "waiting for" in line][:1]
                return [f"{' '.join([e.message.splitlines()[0], *what])} (page {page.url}; screenshot "
                        f"{out / 'ui-failure.png'})"]
        finally:
            browser.close()


def _check(page, server: Server, flow_run_id: str, expected: Expected, out: Path) -> list[str]:
    if refused := login(page, server):
        return [refused]
    missing = []
    ui = f"{server.url}/v2"
    with page.expect_response(re.compile(r"/api/flow_runs/[^/]+/graph-v2$")):
        page.goto(f"{ui}/runs/flow-run/{flow_run_id}")
    page.get_by_role("tab", name="Task Runs").click()
    shown = {name.rsplit("-", 1)[0]: state for name, state in _rows(page)}
    for stage, state in expected.stages.items():
        if stage not in shown:
            missing.append(f"task run {stage}-… in the flow run's Task Runs tab (shown: {sorted(shown)})")
        elif shown[stage] != state:
            missing.append(f"task run {stage} shown as {shown[stage]}, expected {state}")
    _settle(page)
    page.screenshot(path=str(out / "ui-flow-run.png"))

    page.get_by_role("tab", name="Artifacts").click()
    cards = page.get_by_test_id("flow-run-artifacts-grid").locator("a")
    cards.first.wait_for()
    listed = {c.locator("h3").inner_text(): c.locator("[data-slot=card-header]").inner_text().strip().lower()
              for c in cards.all()}
    for key, kind in expected.artifacts.items():
        if key not in listed:
            missing.append(f"artifact {key} in the flow run's Artifacts tab")
        elif listed[key] != kind:
            missing.append(f"artifact {key} listed as {listed[key]}, expected {kind}")
    page.screenshot(path=str(out / "ui-artifacts.png"), full_page=True)

    if expected.image and expected.image not in listed:
        missing.append(f"artifact {expected.image} to open in the flow run's Artifacts tab")
    elif expected.image:
        cards.filter(has=page.locator("h3", has_text=re.compile(f"^{re.escape(expected.image)}$"))).click()
        page.wait_for_url(re.compile(r"/artifacts/artifact/"))
        image = page.locator("main img[src^='data:image/png']").first
        image.wait_for()
        width = image.evaluate("img => img.decode().then(() => img.naturalWidth)")
        if not width:
            missing.append(f"the {expected.image} image drawn in its artifact page")
        page.screenshot(path=str(out / "ui-loss-curve.png"), clip={"x": 0, "y": 0, "width": 1600, "height": 1000})
    return missing


def login(page, server: Server) -> str:
    """The UI's login form, as a user fills it: it checks the password against the API and keeps it (base64) in
    localStorage for every later request. (Setting that key by script races the first page's requests, whose 401s
    clear it; the form does not.) Returns why it refused, '' once logged in."""
    page.goto(server.url)
    page.wait_for_url(re.compile(r"/login"))
    page.locator("input[type=password]").fill(server.auth)
    page.get_by_role("button", name="Login").click()
    page.wait_for_function(f"() => !location.pathname.endsWith('/login') || "
                           f"document.body.innerText.includes({REFUSED!r})")
    return f"the UI's login form refused the auth string ({REFUSED})" if page.url.split("?")[0].endswith("/login") else ""


def _rows(page) -> list[tuple[str, str]]:
    """(task run name, state) of each row in the open Task Runs tab, once its list has rendered."""
    rows = page.locator("main ul > li").filter(has=page.locator("a[href*='/runs/task-run/']"))
    rows.first.wait_for()
    return [(r.locator("a[href*='/runs/task-run/']").inner_text().strip(),
             r.locator("[data-slot=badge]").first.inner_text().strip()) for r in rows.all()]


def _settle(page) -> None:
    """No request in flight, then two animation frames: the flow run's graph (a canvas) is drawn. The clicked tab
    loses its focus ring."""
    page.wait_for_load_state("networkidle")
    page.evaluate("() => document.activeElement && document.activeElement.blur()")
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
