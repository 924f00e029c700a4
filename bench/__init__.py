"""Benchmarks run from a source tree (`python -m bench.<name>` in the repository root), also where glm-lora is not
installed (the GPU machine gets a copy of the tree): then `glm_lora` is imported from this tree's src/."""
import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("glm_lora") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
