"""A real-browser check of the Prefect UI (issue: Prefect in depth): runs the tiny flow (shortened) against
a local Prefect server with an auth string, opens the finished flow run in headless Chromium (Debian's
package, driven by Playwright), logs in, checks that every stage shows Completed and that the loss-curve
and table artifacts are listed, and saves screenshots.

    apt-get install chromium && pip install playwright
    python scripts/ui_check.py OUT_DIR      # OUT_DIR/flow-run.png, OUT_DIR/artifacts.png

Exits non-zero naming what it did not find. Nothing is downloaded: Playwright drives /usr/bin/chromium.
"""
from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from glm_lora.flows.local_server import local_prefect_server  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
SHORT = {"pretrain.max_steps": 30, "sft.max_steps": 60, "dpo.max_steps": 10, "sft.eval_every": 20,
         "dpo.eval_every": 5, "data.synthetic.n_pretrain": 1500, "data.synthetic.n_sft": 1000,
         "data.synthetic.n_dpo": 200, "serve.enabled": False}
FLOW = """
import json, sys
from glm_lora.flows.glm_lora import glm_lora
state = glm_lora(config="tiny", overrides=json.loads(sys.argv[1]), return_state=True)
print("FLOW_RUN", state.state_details.flow_run_id, state.name)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out: Path) -> int:
    import json
    out.mkdir(parents=True, exist_ok=True)
    home, port, auth = Path(tempfile.mkdtemp(prefix="ui-check-")), free_port(), "glm-lora:" + secrets.token_urlsafe(16)
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_API_AUTH_STRING": auth, "PREFECT_API_AUTH_STRING": auth,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "PYTHONPATH": str(REPO)}
    with local_prefect_server(env, port):
        overrides = {**SHORT, "runs_dir": str(home / "runs")}
        run = subprocess.run([sys.executable, "-c", FLOW, json.dumps(overrides)], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=1200)
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("FLOW_RUN")), None)
        if run.returncode or line is None:
            print(run.stderr[-3000:], file=sys.stderr)
            return 1
        _, flow_run_id, state = line.split()
        return browse(f"http://127.0.0.1:{port}", auth, flow_run_id, out)


def browse(base: str, auth: str, flow_run_id: str, out: Path) -> int:
    from playwright.sync_api import sync_playwright
    missing = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(f"{base}/")                              # the UI keeps the password as its login page does
        page.evaluate("auth => localStorage.setItem('prefect-password', btoa(auth))", auth)
        page.goto(f"{base}/runs/flow-run/{flow_run_id}")
        page.wait_for_timeout(8000)
        page.screenshot(path=str(out / "flow-run.png"))
        page.goto(f"{base}/runs/flow-run/{flow_run_id}?tab=Task%20Runs")
        page.wait_for_timeout(4000)
        text = page.inner_text("body")
        (out / "task-runs.txt").write_text(text)
        for stage in ("data", "tokenizer", "pretrain", "sft", "dpo", "export"):
            if not re.search(rf"\b{stage}-\w+", text):
                missing.append(f"task run {stage} in the flow run's Task Runs tab")
        if text.count("Completed") < 6:
            missing.append(f"6 Completed task runs (found {text.count('Completed')})")
        page.goto(f"{base}/artifacts")
        page.wait_for_timeout(5000)
        text = page.inner_text("body")
        for key in ("tiny-sft-loss-curve", "tiny-sft-metrics", "tiny-sft-eval", "tiny-sft-progress"):
            if key not in text:
                missing.append(f"artifact {key}")
        page.screenshot(path=str(out / "artifacts.png"), full_page=True)
        page.goto(f"{base}/artifacts/key/tiny-sft-loss-curve")
        page.wait_for_timeout(4000)
        page.locator("a").filter(has_text=re.compile(r"^[0-9a-f]{8}$")).first.click()   # the latest version
        page.wait_for_timeout(4000)
        if page.locator("img[src^='data:image/png']").count() == 0:
            missing.append("the loss-curve image in its artifact page")
        page.screenshot(path=str(out / "loss-curve.png"))
        browser.close()
    for m in missing:
        print("not found:", m, file=sys.stderr)
    print("screenshots in", out)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "ui-check")))
