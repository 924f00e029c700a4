#!/usr/bin/env bash
# llama.cpp's runtime (llama-cpp-python) in .venv, for the tests that load our GGUF files with it. The registry has
# only its source for Linux: the build takes ~7 min of two cores (bench/RESULTS.md "GGUF"), so scripts/test.sh runs
# this in the background at low priority while the other tests run; pip caches the wheel it builds, so a machine
# builds it once. Writes .venv/.llama-cpp-ready or .venv/.llama-cpp-failed (the log beside it).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
rm -f .venv/.llama-cpp-ready .venv/.llama-cpp-failed
echo $$ > .venv/.llama-cpp-building
trap 'rm -f .venv/.llama-cpp-building' EXIT
if .venv/bin/python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
  touch .venv/.llama-cpp-ready
  exit 0
fi
# CPU only, no tools, examples, tests or the multimodal library: what loading and quantising a GGUF needs
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
if nice -n 19 .venv/bin/pip install -q "llama-cpp-python==$VERSION" > .venv/.llama-cpp.log 2>&1; then
  touch .venv/.llama-cpp-ready
else
  touch .venv/.llama-cpp-failed
  exit 1
fi
