#!/usr/bin/env bash
# The test command: installs what the tests need (both virtualenvs), then runs the whole suite,
# including the end-to-end DAG test with vLLM. Extra args go to pytest (e.g. -m "not slow", -n 0 for one process).
# Two pytest-xdist workers, one module each at a time, longest modules first (tests/conftest.py): the default
# DAG's quality run (~12 min) runs beside the rest instead of after it; each worker gets half the cores.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
# llama.cpp's runtime builds from source beside the setup and the tests (its tests wait: tests/llama_runtime.py)
setsid bash scripts/llama_cpp.sh </dev/null >/dev/null 2>&1 &
LLAMA_BUILD=$!
# `|| true`: under set -e a failing command in the EXIT trap (the build already finished) would turn the exit status
# into 1 whatever pytest returned.
trap 'kill -- -$LLAMA_BUILD 2>/dev/null || true' EXIT
GLM_LORA_TEST_BROWSER=1 bash scripts/setup.sh      # with chromium, for the Prefect UI test
source scripts/env.sh
set +e
python -m pytest -q -n "${GLM_LORA_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit $rc
