"""llama.cpp's runtime for the GGUF tests: scripts/test.sh builds llama-cpp-python in the background
(scripts/llama_cpp.sh); a test that needs it waits for the build, and fails — never skips — if it failed or
is not there."""
import importlib
import os
import sys
import time
from pathlib import Path

import pytest

VENV = Path(sys.prefix)
REPO = Path(__file__).resolve().parents[1]
WAIT_S = 40 * 60


def _building() -> bool:
    pid = REPO / ".llama-cpp-building"
    try:
        os.kill(int(pid.read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


def llama_cpp():
    deadline = time.monotonic() + WAIT_S
    while _building() and time.monotonic() < deadline:
        time.sleep(5)
    if (VENV / ".llama-cpp-failed").exists():
        log = (REPO / ".llama-cpp.log").read_text()[-3000:]
        pytest.fail(f"building llama-cpp-python failed (scripts/llama_cpp.sh):\n{log}")
    importlib.invalidate_caches()
    try:
        return importlib.import_module("llama_cpp")
    except ImportError:
        pytest.fail("llama-cpp-python is not installed: run `bash scripts/llama_cpp.sh` (scripts/test.sh does)")
