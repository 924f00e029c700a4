"""The layering of DESIGN.md holds: every package imports only packages on a lower floor."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLOOR = {"configs": 0, "artifacts": 1, "kernels": 1, "data": 2, "model": 2, "engine": 3, "export": 4, "serve": 4,
         "tasks": 5, "flows": 6}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.removeprefix("glm_lora.").split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "glm_lora":     # from glm_lora import kernels
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.removeprefix("glm_lora.").split(".")[0])
    return out & FLOOR.keys()


def test_no_package_imports_upward_or_sideways():
    bad = []
    for pkg, floor in FLOOR.items():
        for f in sorted((REPO / pkg).rglob("*.py")):
            bad += [f"{f.relative_to(REPO)} imports {dep}" for dep in _imports(f) - {pkg} if FLOOR[dep] >= floor]
    assert bad == []


def test_the_stage_table_holds_the_stage_functions():
    from glm_lora.tasks.table import STAGES
    for name, stage in STAGES.items():
        assert callable(stage.run) and stage.run.__name__ in ("run", f"{name}_stage"), name
