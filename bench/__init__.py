"""Benchmarks run from a source tree (`python -m bench.<name>` in the repository root), also where glm-lora is not
installed (the GPU machine gets a copy of the tree): then `glm_lora` is this tree, the namespace the installed
package has (pyproject.toml maps glm_lora.<folder> onto the repository's folders)."""
import importlib.util
import sys
import types
from pathlib import Path

if importlib.util.find_spec("glm_lora") is None:
    _tree = types.ModuleType("glm_lora")
    _tree.__path__ = [str(Path(__file__).resolve().parents[1])]
    sys.modules["glm_lora"] = _tree
