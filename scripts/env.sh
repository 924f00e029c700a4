# Sourced by the scripts: where Prefect keeps its state for this checkout, and offline settings.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$REPO/.venv/bin:$PATH"
export PREFECT_HOME="${PREFECT_HOME:-$REPO/.prefect-home}"
export PREFECT_PORT="${PREFECT_PORT:-4200}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
export PREFECT_LOGGING_EXTRA_LOGGERS=glm_lora
export PREFECT_WORKER_QUERY_SECONDS=2
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The virtualenvs are installed without byte-compiling (scripts/setup.sh): each module is compiled at its first import
# and its .pyc kept, so with PYTHONDONTWRITEBYTECODE set every process would compile torch, transformers, vLLM, ... again.
unset PYTHONDONTWRITEBYTECODE
export PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW=ignore   # checkpoint writer thread logs outside the run context

# The local Prefect server's auth string (README "Security"): generated once into $PREFECT_HOME/auth,
# readable only by this user; the server checks it and every client (worker, CLI, flows) sends it.
_auth="$PREFECT_HOME/auth"
(umask 077 && mkdir -p "$PREFECT_HOME"
 if [ ! -s "$_auth" ]; then
   rm -f "$_auth"
   _tmp=$(mktemp "$PREFECT_HOME/.auth.XXXXXX")
   python3 -c 'import secrets; print("glm-lora:" + secrets.token_urlsafe(32))' >"$_tmp" &&
     { ln "$_tmp" "$_auth" 2>/dev/null || true; }   # link(2) is atomic: two concurrent first runs keep one string
   rm -f "$_tmp"
 fi
 chmod 600 "$_auth")
export PREFECT_API_AUTH_STRING="$(<"$_auth")"
export PREFECT_SERVER_API_AUTH_STRING="$PREFECT_API_AUTH_STRING"
unset _auth

# Fail unless the Prefect server at $PREFECT_API_URL checks our auth string: a server left by an older
# run without auth would let anyone on this machine run deployments (shell steps) as this user.
# The auth string goes to curl on stdin, not argv (argv is visible in `ps`).
require_prefect_auth() {
  local open authed
  open=$(curl -s -o /dev/null -w '%{http_code}' "$PREFECT_API_URL/version")
  authed=$(curl -s -o /dev/null -w '%{http_code}' -K - "$PREFECT_API_URL/version" <<<"user = \"$PREFECT_API_AUTH_STRING\"")
  if [ "$open" != 401 ]; then
    echo "The Prefect server at $PREFECT_API_URL answers API calls without credentials (HTTP $open; a server" \
         "started before auth was added?). Stop it with 'bash scripts/stop.sh' (or stop whatever listens on" \
         "that port), then run again." >&2
    return 1
  elif [ "$authed" != 200 ]; then
    echo "The Prefect server at $PREFECT_API_URL refuses the auth string in $PREFECT_HOME/auth (HTTP $authed;" \
         "started with another one?). Stop it with 'bash scripts/stop.sh', then run again." >&2
    return 1
  fi
}
