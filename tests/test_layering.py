"""The layering of DESIGN.md holds: every package imports only packages on a lower floor; and a CLI call imports
only what it uses (a config error loads no torch)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "glm_lora"
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
        for f in sorted((PACKAGE / pkg).rglob("*.py")):
            bad += [f"{f.relative_to(PACKAGE)} imports {dep}" for dep in _imports(f) - {pkg} if FLOOR[dep] >= floor]
    assert bad == []


def test_the_stage_table_holds_the_stage_functions():
    from glm_lora.tasks.table import STAGES
    for name, stage in STAGES.items():
        assert callable(stage.run) and stage.run.__name__ in ("run", f"{name}_stage"), name


def _cli_imports(tmp_path, *args: str) -> dict:
    """Run the CLI in a fresh interpreter; its exit code and whether torch / torch._dynamo got imported."""
    import json
    import subprocess
    import sys
    code = ("import json, sys; from glm_lora.flows import cli; rc = cli.main(sys.argv[1:]); "
            "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules, 'dynamo': 'torch._dynamo' in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip(), out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_config_error_is_reported_without_loading_torch(tmp_path):
    """A typo in a key costs 0.2 s, not the 2.4 s of importing torch and every stage (tasks/table.py names the
    stage functions; the CLI imports the preflight after the config loaded)."""
    assert _cli_imports(tmp_path, "stage", "data", "--config", "tiny", "--set", "sft.no_such_key=1",
                        "--set", f"runs_dir={tmp_path}") == {"rc": 2, "torch": False, "dynamo": False}


def test_the_config_reference_loads_no_torch(tmp_path):
    """`glm-lora config KEY` reads the schema and the presets only."""
    for args in (["config", "sft.max_steps"], ["config", "sft.max_step"]):
        assert _cli_imports(tmp_path, *args)["torch"] is False, args


def test_the_data_stage_checks_the_config_without_importing_torch_dynamo(tmp_path):
    """The preflight's LoRA and memory checks build the model on the meta device without its initialisers
    (model.model.shapes_only): initialising meta tensors imports torch._dynamo, ~1 s of every CLI stage call."""
    assert _cli_imports(tmp_path, "stage", "data", "--config", "tiny", "--set", f"runs_dir={tmp_path}") == \
        {"rc": 0, "torch": True, "dynamo": False}
