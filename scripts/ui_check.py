"""The Prefect UI's screenshots for docs/: runs the tiny flow (shortened, every stage on: RL, the harness, GGUF,
serve) against a local Prefect server with an auth string, then checks the finished flow run's pages in headless
Chromium as CI does for its own DAG run (tests/prefect_ui.py, tests/test_dag.py): logs in, every stage Completed,
its artifacts listed (tests/prefect_ui.py dag_expected), the SFT loss curve's image drawn.

    python scripts/ui_check.py OUT_DIR      # OUT_DIR/ui-flow-run.png, ui-artifacts.png, ui-loss-curve.png
    cp OUT_DIR/ui-flow-run.png OUT_DIR/ui-loss-curve.png docs/

Needs Debian's chromium and the test extra (Playwright), as scripts/setup.sh installs them, and .venv-vllm for the
serve stage. Exits non-zero naming what it did not find.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.prefect_ui import check_flow_run, dag_expected, ui_server  # noqa: E402

STAGES = ("data", "tokenizer", "pretrain", "sft", "dpo", "rl", "export", "gguf", "harness", "serve")
# Validation every 20 SFT steps: a curve, not a point. GRPO on the families this short SFT answers now and then
# (~10 %), 8 answers a prompt: groups that differ in reward, so its adapter learns (the serve stage checks it does).
SHORT = {"pretrain.max_steps": 60, "sft.max_steps": 120, "sft.eval_every": 20, "dpo.max_steps": 20,
         "data.synthetic.n_pretrain": 1500, "data.synthetic.n_sft": 1000, "data.synthetic.n_dpo": 200,
         "rl.enabled": True, "rl.max_steps": 8, "rl.batch_size": 4, "rl.group_size": 8, "rl.max_new_tokens": 8,
         "rl.families": ["add_en", "add_zh", "units_en", "units_zh"],
         "eval.harness.tasks": ["glm_lora_arithmetic"], "eval.harness.limit": 8, "serve.keep_running": False,
         "serve.max_tokens": 16}
FLOW = """
import json, sys
from glm_lora.flows.glm_lora import glm_lora
state = glm_lora(config="tiny", overrides=json.loads(sys.argv[1]), return_state=True)
print("FLOW_RUN", state.state_details.flow_run_id, state.name)
"""


def main(out: Path) -> int:
    home = Path(tempfile.mkdtemp(prefix="ui-check-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        serve_port = s.getsockname()[1]
    with ui_server(home) as server:
        run = subprocess.run([sys.executable, "-c", FLOW, json.dumps({**SHORT, "runs_dir": str(home / "runs"),
                                                                   "serve.port": serve_port})],
                             env=server.env, cwd=REPO, capture_output=True, text=True, timeout=3600)
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("FLOW_RUN")), None)
        if run.returncode or line is None:
            print(run.stderr[-3000:], file=sys.stderr)
            return 1
        flow_run_id = line.split()[1]
        missing = check_flow_run(server, flow_run_id, dag_expected("tiny", {s: "Completed" for s in STAGES}), out)
    for m in missing:
        print("not found:", m, file=sys.stderr)
    print("screenshots in", out)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "ui-check")))
