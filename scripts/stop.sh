#!/usr/bin/env bash
# Stop what scripts/run.sh left running: the vLLM server(s) of runs/*, the worker, the Prefect server.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
source scripts/env.sh
for record in runs/*/serve/server.json; do
  [ -f "$record" ] && python -c "import json,sys; from serve.vllm_server import stop_server; stop_server(json.load(open(sys.argv[1]))['pid'])" "$record"
done
stop_pid() {  # TERM, then KILL after 10 s
  local pid=$1
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid"
  for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL "$pid" 2>/dev/null
}
[ -f "$PREFECT_HOME/worker.pid" ] && stop_pid "$(cat "$PREFECT_HOME/worker.pid")" && rm -f "$PREFECT_HOME/worker.pid"
[ -f "$PREFECT_HOME/server.pid" ] && stop_pid "$(cat "$PREFECT_HOME/server.pid")" && rm -f "$PREFECT_HOME/server.pid"
echo "[stop] done"
