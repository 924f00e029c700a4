"""What every benchmark records beside its figures: command, date, machine, commit."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def provenance() -> dict:
    # The GPU machine gets a copy of the tree without .git: pass GLM_LORA_COMMIT there.
    commit = os.environ.get("GLM_LORA_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=BENCH).stdout.strip()
    dirty = "" if os.environ.get("GLM_LORA_COMMIT") else subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=BENCH).stdout.strip()
    try:
        import torch
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    except ImportError:
        device = "unknown"
    return {"command": " ".join(["python -m", f"bench.{Path(sys.argv[0]).stem}", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{device}, {platform.machine()}", "commit": commit + ("+dirty" if dirty else "")}


def write_result(name: str, figures: dict) -> Path:
    out = BENCH / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**provenance(), **figures}, indent=2) + "\n")
    return out
