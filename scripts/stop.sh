#!/usr/bin/env bash
# Stop what scripts/run.sh left running: the served endpoints (nginx + vLLM), the worker, the Prefect server.
#   bash scripts/stop.sh                      every endpoint listed on this machine (any runs_dir), then Prefect
#   bash scripts/stop.sh --config C --set runs_dir=/data/runs ...   only that run's endpoint (Prefect stays up)
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
source scripts/env.sh
if [ $# -gt 0 ]; then
  python -m glm_lora.flows.cli serve stop "$@"
  exit $?
fi
python -m glm_lora.flows.cli serve stop --all
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
