"""The layering of docs/architecture.md holds: every package imports only the layers below it (an import-linter
contract in pyproject.toml), and the import-graph tool sees every internal import; a CLI call imports only what it
uses (a config error loads no torch)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "glm_lora"


def test_no_package_imports_upward_or_sideways(capsys):
    from importlinter.cli import lint_imports
    assert lint_imports(no_cache=True) == 0, capsys.readouterr().out[-4000:]


def _our_imports(path: Path, module: str) -> set[str]:
    """Every glm_lora module `path` imports, at module level or inside a function, as the module it names."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("glm_lora.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("glm_lora"):
            out |= {f"{node.module}.{a.name}" if (PACKAGE.parent / node.module.replace(".", "/") / a.name).with_suffix(".py")
                    .exists() or (PACKAGE.parent / node.module.replace(".", "/") / a.name).is_dir() else node.module
                    for a in node.names}
    return out - {module}


def test_the_import_graph_tool_sees_every_internal_import():
    """Nothing imports our code in a way a standard tool can't follow (the root-as-package layout hid every import
    from them)."""
    import grimp
    graph = grimp.build_graph("glm_lora", cache_dir=None)
    missed = []
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if not (f.parent / "__init__.py").is_file():   # loaded by file by another program: lm_eval, or vLLM in its venv
            ours = _our_imports(f, module)                # (which has no glm_lora)
            missed += [f"{module} imports {m}" for m in sorted(ours if "vllm_plugins" in f.parts else
                                                                  ours - set(graph.modules))]
            continue
        if module not in graph.modules:
            missed.append(f"{module}: not in the graph")
            continue
        seen = graph.find_modules_directly_imported_by(module)
        missed += [f"{module} imports {m}" for m in sorted(_our_imports(f, module) - seen)]
    assert len(graph.modules) > 90 and missed == [], missed


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


def test_no_two_test_modules_share_a_file_name():
    """The test folders are not packages, so pytest imports each module by its file name: two of one name (a
    tests/configs/test_reference.py beside tests/kernels/test_reference.py) stop the whole run at collection."""
    from collections import Counter
    names = Counter(f.name for f in (PACKAGE.parents[1] / "tests").rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
