"""The installed package behaves like the libraries users know: its import names shadow nothing (ours are
glm_lora.<folder>, from src/), and `pip install .` into a fresh virtualenv gives a `glm-lora` command that runs the DAG from
an unrelated directory (configs, bundled data and runs_dir resolved without the repository as working directory).
Every check runs in a subprocess."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _clean_env() -> dict:
    """No variable that would hide the checkout from sys.path (PYTHONSAFEPATH) or add to it: a user's plain shell."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}


@pytest.mark.parametrize("pythonpath", [None, "checkout"])
def test_our_packages_shadow_no_other_distribution(pythonpath):
    """Run from the repository root, as a user or a Prefect worker (which puts its working directory on PYTHONPATH)
    would, with no special environment: transformers' hub-kernels integration and bitsandbytes look for a top-level
    `kernels` package (the hub's) and must not find ours; ours are reachable only as glm_lora.<folder> (src/)."""
    code = ("import importlib.util, json, sys\n"
            "import transformers.integrations.hub_kernels, bitsandbytes\n"
            "import glm_lora.kernels, glm_lora.model, glm_lora.data\n"
            "names = ['kernels', 'data', 'model', 'configs', 'tasks', 'export', 'serve', 'engine', 'artifacts', 'flows']\n"
            "found = {n: getattr(importlib.util.find_spec(n), 'origin', None) for n in names}\n"
            "print(json.dumps({'found': found, 'ours': glm_lora.kernels.__file__}))\n")
    env = _clean_env() | ({"PYTHONPATH": str(REPO)} if pythonpath else {})
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    import json
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ours"].startswith(str(REPO / "src" / "glm_lora"))
    shadowing = {n: o for n, o in out["found"].items() if o and str(REPO) in o}
    assert shadowing == {}, shadowing
    assert "cannot import name 'get_kernel'" not in p.stderr


def test_the_cli_runs_from_the_repository_root():
    p = subprocess.run([sys.executable, "-m", "glm_lora.flows.cli", "--help"], cwd=REPO, capture_output=True, text=True,
                       env=_clean_env(), timeout=300)
    assert p.returncode == 0 and "usage" in p.stdout.lower(), p.stderr[-3000:]


@pytest.mark.slow
def test_pip_install_then_glm_lora_run_from_an_unrelated_directory(tmp_path):
    """A fresh virtualenv, `pip install --no-deps .` (a wheel built from the checkout: no editable path into it; the
    dependencies come from this environment through a .pth file, to spare CI a second torch), then `glm-lora run`
    with a shortened tiny config from an empty directory: the whole DAG but serving, outputs under ./runs there."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # built from a copy: setuptools writes build/ and *.egg-info into the source tree, which must stay the checkout's
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv*", ".whl", "runs", "build", "*.egg-info",
                                                              "__pycache__", ".prefect-home", ".build", "mlruns", "mlartifacts",
                                                              "mlflow.db"))
    build = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            str(src)], capture_output=True, text=True, env=_clean_env(), cwd=tmp_path, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    assert not list(site.glob("__editable__*")) and (site / "glm_lora" / "kernels" / "__init__.py").is_file()
    work = tmp_path / "elsewhere"
    work.mkdir()
    overrides = ["pretrain.max_steps=5", "sft.max_steps=4", "dpo.max_steps=2", "data.synthetic.n_pretrain=200",
                 "data.synthetic.n_sft=100", "data.synthetic.n_dpo=40", "serve.enabled=false", "eval.max_rows=8",
                 "sft.compile=false", "sft.eval_every=0", "dpo.eval_every=0", "pretrain.eval_every=0"]
    env = {**_clean_env(), "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "DO_NOT_TRACK": "1"}
    run = subprocess.run([str(venv / "bin" / "glm-lora"), "run", "--config", "tiny", *[a for o in overrides for a in ("--set", o)]],
                         capture_output=True, text=True, env=env, cwd=work, timeout=1200)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert (work / "runs" / "tiny" / "export" / "merged" / "model.safetensors").is_file()
    assert "cannot import name 'get_kernel'" not in run.stderr
