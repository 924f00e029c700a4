"""What every benchmark records beside its figures: command, date, machine, commit."""
from __future__ import annotations

import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=BENCH).stdout.strip()
    except OSError:          # no git on this machine
        return ""


def commit() -> str:
    """Short hash of HEAD; $GLM_LORA_COMMIT on a copy of the tree without .git (the GPU machine); else "nogit"."""
    return os.environ.get("GLM_LORA_COMMIT") or _git("rev-parse", "--short", "HEAD") or "nogit"


def provenance() -> dict:
    dirty = "" if os.environ.get("GLM_LORA_COMMIT") else _git("status", "--porcelain", "--untracked-files=no")
    try:
        import torch
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    except ImportError:
        device = "unknown"
    script = Path(sys.argv[0]).resolve()
    module = ".".join(script.with_suffix("").relative_to(BENCH.parent).parts) if script.is_relative_to(BENCH) else script.stem
    return {"command": " ".join(["python -m", module, *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{device}, {platform.machine()}", "commit": commit() + ("+dirty" if dirty else "")}


def write_result(name: str, figures: dict) -> Path:
    """Write a new bench/results/<name>_<UTC date>_<commit>.json (_2, _3, ... for more runs that day):
    a run never overwrites an earlier one, so rerunning some providers leaves the full run beside it."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_{time.strftime('%Y-%m-%d', time.gmtime())}_{commit()}"
    text = json.dumps({**provenance(), **figures}, indent=2) + "\n"
    for n in itertools.count(1):
        out = RESULTS / (f"{stem}.json" if n == 1 else f"{stem}_{n}.json")
        try:
            with open(out, "x", encoding="utf-8") as f:      # "x": refuses an existing file, even in a race
                f.write(text)
            return out
        except FileExistsError:
            pass
