#!/usr/bin/env bash
# llama.cpp's runtime (llama-cpp-python) in .venv, for the tests that load our GGUF files with it. The registry has
# only its source for Linux: building it takes ~6-7 min of two cores (bench/RESULTS.md "GGUF"), so scripts/test.sh
# starts this first, beside the setup and the other tests: the wheel is built in a build venv of its own (pip keeps
# it in its cache: a machine builds it once) and installed into .venv when scripts/setup.sh has made it.
# Writes .venv/.llama-cpp-ready or .venv/.llama-cpp-failed (the log: .llama-cpp.log).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
LOG="$REPO/.llama-cpp.log"
: > "$LOG"
echo $$ > .llama-cpp-building
trap 'rm -f .llama-cpp-building' EXIT
done_with() { mkdir -p .venv && rm -f .venv/.llama-cpp-ready .venv/.llama-cpp-failed && touch ".venv/.llama-cpp-$1"; }
have() { [ -x .venv/bin/python ] && .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('llama_cpp_python') != '$VERSION')" 2>/dev/null; }
setup_done() { [ -f .venv/.glm-lora-stamp ]; }

for _ in $(seq 60); do setup_done && break; [ -d .venv ] || break; sleep 2; done   # an existing .venv being refreshed
if setup_done && have; then done_with ready; exit 0; fi
WHEELS="$REPO/.build/wheels"
mkdir -p "$WHEELS"
if ! ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
  [ -x .build/venv/bin/pip ] || "$PY" -m venv .build/venv >>"$LOG" 2>&1
  # CPU only, no tools, examples, tests or the multimodal library: what loading and quantising a GGUF needs
  export CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
  if ! nice -n 10 .build/venv/bin/pip wheel -q --no-deps -w "$WHEELS" "llama-cpp-python==$VERSION" >>"$LOG" 2>&1; then
    done_with failed; exit 1
  fi
fi
until setup_done; do sleep 5; done
if .venv/bin/pip install -q "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >>"$LOG" 2>&1; then done_with ready; else done_with failed; exit 1; fi
