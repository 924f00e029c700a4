#!/usr/bin/env bash
# The test command: installs what the tests need (both virtualenvs), then runs the whole suite,
# including the end-to-end DAG test with vLLM. Extra args go to pytest (e.g. -m "not slow").
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
bash scripts/setup.sh
source scripts/env.sh
set +e
python -m pytest -q "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit $rc
