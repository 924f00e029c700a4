# Sourced by the scripts: where Prefect keeps its state for this checkout, and offline settings.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$REPO/.venv/bin:$PATH"
export PREFECT_HOME="${PREFECT_HOME:-$REPO/.prefect-home}"
export PREFECT_PORT="${PREFECT_PORT:-4200}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
export PREFECT_LOGGING_EXTRA_LOGGERS=glm_lora
export PREFECT_WORKER_QUERY_SECONDS=2
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW=ignore   # checkpoint writer thread logs outside the run context
