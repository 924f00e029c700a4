#!/usr/bin/env bash
# The main job: local Prefect server + process worker, register deployments, run glm-lora/full,
# wait for it, print the served model's answer. Extra args go to `prefect deployment run`,
# e.g.  bash scripts/run.sh --param config=small --param 'overrides={"sft.max_steps": 100}'
set -euo pipefail
t0=$(date +%s)
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
bash scripts/setup.sh
source scripts/env.sh
export PREFECT_API_URL="${PREFECT_API_URL:-http://127.0.0.1:$PREFECT_PORT/api}"
mkdir -p "$PREFECT_HOME"

if ! curl -sf "$PREFECT_API_URL/health" >/dev/null; then
  echo "[run] starting Prefect server on 127.0.0.1:$PREFECT_PORT (SQLite in $PREFECT_HOME)"
  setsid nohup prefect server start --host 127.0.0.1 --port "$PREFECT_PORT" >"$PREFECT_HOME/server.log" 2>&1 &
  echo $! >"$PREFECT_HOME/server.pid"
  for _ in $(seq 120); do curl -sf "$PREFECT_API_URL/health" >/dev/null && break; sleep 1; done
  curl -sf "$PREFECT_API_URL/health" >/dev/null || { tail -30 "$PREFECT_HOME/server.log"; exit 1; }
fi
require_prefect_auth || exit 1
prefect work-pool inspect glm-lora >/dev/null 2>&1 || prefect work-pool create glm-lora --type process >/dev/null
# Training stages take this slot (tasks/stages.py): a manual run and the nightly never train at once.
prefect gcl inspect glm-lora-train >/dev/null 2>&1 || prefect gcl create glm-lora-train --limit 1 >/dev/null
prefect --no-prompt deploy --all >/dev/null

if ! { [ -f "$PREFECT_HOME/worker.pid" ] && kill -0 "$(cat "$PREFECT_HOME/worker.pid")" 2>/dev/null; }; then
  setsid nohup prefect worker start --pool glm-lora --type process >"$PREFECT_HOME/worker.log" 2>&1 &
  echo $! >"$PREFECT_HOME/worker.pid"
fi

echo "[run] prefect deployment run glm-lora/full (UI: http://127.0.0.1:$PREFECT_PORT, password: the content of $PREFECT_HOME/auth)"
# The watch's event stream goes to a log; the terminal gets one line per stage state (training stages also
# draw a progress artifact in the UI).
events="$PREFECT_HOME/last-run-events.log"
prefect deployment run glm-lora/full --watch "$@" 2>&1 | tee "$events" | awk '
  /^Created flow run/ || /URL: / { print "[run] " $0; fflush() }
  { if (match($0, /prefect\.task-run\.(Running|Completed|Cached|Failed|Crashed|AwaitingRetry|Retrying) \* [a-z]+/)) {
      split(substr($0, RSTART, RLENGTH), f, /[. *]+/); printf "[run] %-10s %s\n", f[4], f[3]; fflush() } }
  /Flow run finished/ { print "[run] " $0; fflush() }'
echo "[run] every event of the run: $events"
python -m glm_lora.flows.answer
echo "[run] total $(( $(date +%s) - t0 )) s"
