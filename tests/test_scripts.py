"""scripts/test.sh's exit status is pytest's (5, no tests collected, fails), whether or not the background llama.cpp
build is still running when it exits. Its collaborators (setup, env, the build, python) are stubs here; the script
is the real one."""
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("build_seconds", [0, 30], ids=["build-finished", "build-running"])
@pytest.mark.parametrize("pytest_rc,want", [(0, 0), (1, 1), (5, 1)])
def test_exit_status_is_pytests(tmp_path, pytest_rc, want, build_seconds):
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts/test.sh", tmp_path / "scripts/test.sh")
    _stub(tmp_path / "scripts/setup.sh", "exit 0")
    _stub(tmp_path / "scripts/llama_cpp.sh", f"sleep {build_seconds}")
    (tmp_path / "scripts/env.sh").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir / "python", f'echo "python $*" > "{tmp_path}/argv"; exit {pytest_rc}')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    if build_seconds == 0:   # let the stub build end first: the EXIT trap's kill then finds nothing
        _stub(tmp_path / "scripts/setup.sh", "sleep 0.5")
    proc = subprocess.run(["bash", str(tmp_path / "scripts/test.sh"), "-k", "x"], env=env, capture_output=True,
                          text=True, timeout=20)
    assert proc.returncode == want, proc.stderr
    assert (tmp_path / "argv").read_text().split()[-2:] == ["-k", "x"]
    assert ("collected no tests" in proc.stderr) == (pytest_rc == 5)


def test_virtualenvs_skip_the_byte_compile_and_env_lets_python_keep_what_it_compiles(tmp_path):
    """setup.sh installs with pip's --no-compile (most of the install time went to byte-compiling modules never
    imported); that is only cheaper if a module compiled at its first import keeps its .pyc, so env.sh, which every
    script sources before Python runs, must undo a PYTHONDONTWRITEBYTECODE from the caller's environment."""
    setup = (REPO / "scripts/setup.sh").read_text()
    installs = [line for line in setup.splitlines() if "/bin/pip install" in line and "--upgrade pip" not in line]
    assert installs and all("$NO_COMPILE" in line for line in installs), installs
    assert "NO_COMPILE=--no-compile" in setup
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PREFECT_HOME": str(tmp_path / "home")}
    out = subprocess.run(["bash", "-c", f'source "{REPO}/scripts/env.sh" && echo "[${{PYTHONDONTWRITEBYTECODE-unset}}]"'],
                         env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[unset]"), out.stdout


def test_the_cpu_log_records_each_tests_cpu_and_wall_seconds(tmp_path):
    """GLM_LORA_TEST_CPU_LOG (tests/conftest.py) and its summary, bench/ci_cpu.py: a test that computes is charged
    its CPU seconds, one that waits its wall seconds only, one whose child process computes the child's."""
    import json
    import sys
    from bench.ci_cpu import per_module
    (tmp_path / "test_x.py").write_text(
        "import subprocess, sys, time\n"
        "def test_computes(): sum(i * i for i in range(3_000_000))\n"
        "def test_waits(): time.sleep(0.5)\n"
        "def test_child_computes(): subprocess.run([sys.executable, '-c', 'sum(i * i for i in range(3_000_000))'])\n")
    log = tmp_path / "cpu.jsonl"
    env = {**os.environ, "GLM_LORA_TEST_CPU_LOG": str(log), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "tests.conftest", "-p",
                           "no:cacheprovider", str(tmp_path / "test_x.py")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["test"].rsplit("::", 1)[1]: r for r in map(json.loads, log.read_text().splitlines())}
    assert rows["test_computes"]["cpu_s"] > 0.1 and rows["test_child_computes"]["cpu_s"] > 0.1, rows
    assert rows["test_waits"]["wall_s"] >= 0.5 > 0.1 > rows["test_waits"]["cpu_s"], rows
    ((module, cpu, wall, n),) = per_module(list(rows.values()))
    assert module.endswith("test_x.py") and n == 3 and cpu == sum(r["cpu_s"] for r in rows.values())


def _venv_cache(repo: Path, cache: Path, script: str) -> subprocess.CompletedProcess:
    import sys
    env = {**os.environ, "GLM_LORA_VENV_CACHE": str(cache), "REPO": str(repo), "PY": sys.executable}
    return subprocess.run(["bash", "-c", f'source "{REPO}/scripts/venv_cache.sh" && {script}'], env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_cached_virtualenv_is_restored_into_another_checkout_by_hard_links_without_changing_the_entry(tmp_path):
    """scripts/venv_cache.sh: a virtualenv saved from checkout a and restored into checkout b is b's own — its Python
    runs from b, its .pth and console scripts name b — while the big files are the entry's (hard links, no copy) and
    neither the entry nor a's virtualenv changed. A second save of the same entry keeps the first; "off" disables."""
    import sys
    a, b, cache = tmp_path / "a", tmp_path / "b", tmp_path / "cache"
    (a / "src").mkdir(parents=True), (b / "src").mkdir(parents=True)     # a .pth names a folder only if it exists
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(a / ".venv")], check=True, timeout=60)
    site = next((a / ".venv/lib").glob("python*/site-packages"))
    (site / "checkout.pth").write_text(f"{a}/src\n")
    (a / ".venv/bin/tool").write_text(f"#!{a}/.venv/bin/python\nprint('tool')\n")
    (site / "weights.bin").write_bytes(os.urandom(1 << 16))
    entry = _venv_cache(a, cache, 'k=$(venv_key main "stamp 1") && venv_save "$k" .venv && echo "$k"')
    assert entry.returncode == 0, entry.stderr
    entry = entry.stdout.strip()
    assert entry.startswith("main-") and (cache / entry / ".glm-lora-origin").read_text().strip() == str(a)
    other = _venv_cache(a, cache, 'venv_key main "stamp 2"').stdout.strip()
    assert other != entry                                    # the stamp is part of the name

    out = _venv_cache(b, cache, f"venv_restore {entry} .venv")
    assert out.returncode == 0, out.stderr
    ran = subprocess.run([str(b / ".venv/bin/python"), "-c", "import sys; print(sys.prefix); print(sys.path)"],
                         capture_output=True, text=True, timeout=30)
    prefix, path = ran.stdout.splitlines()
    assert prefix == str(b / ".venv") and f"{b}/src" in path and f"{a}/src" not in path, ran.stdout
    b_site = next((b / ".venv/lib").glob("python*/site-packages"))
    assert (b / ".venv/bin/tool").read_text().startswith(f"#!{b}/.venv/bin/python\n")
    assert os.access(b / ".venv/bin/tool", os.X_OK) == os.access(a / ".venv/bin/tool", os.X_OK)
    assert (b_site / "weights.bin").stat().st_ino == (site / "weights.bin").stat().st_ino   # linked, not copied
    assert not (b / ".venv/.glm-lora-origin").exists() and not list(b.glob(".venv.restoring*"))
    for venv in (a / ".venv", cache / entry):                # the entry and the checkout that made it are unchanged
        assert (venv / "bin/tool").read_text().startswith(f"#!{a}/.venv/bin/python\n")
        assert next((venv / "lib").glob("python*/site-packages/checkout.pth")).read_text() == f"{a}/src\n"

    assert _venv_cache(b, cache, f"venv_save {entry} .venv").returncode == 0
    assert (cache / entry / ".glm-lora-origin").read_text().strip() == str(a)   # the first save stays
    assert _venv_cache(b, tmp_path / "none", f"venv_restore {entry} .venv").returncode == 1
    assert _venv_cache(b, Path("off"), f"venv_restore {entry} .venv").returncode == 1
    no_home = {k: v for k, v in os.environ.items() if k not in ("HOME", "XDG_CACHE_HOME", "GLM_LORA_VENV_CACHE")}
    out = subprocess.run(["bash", "-c", f'set -eu; source "{REPO}/scripts/venv_cache.sh"; echo "[$VENV_CACHE]"'],
                         env=no_home, capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout) == (0, "[]\n"), out.stderr     # no home directory: no cache, no error


def test_saving_beside_two_recent_entries_of_its_kind_succeeds_under_set_e(tmp_path):
    """setup.sh runs with `set -euo pipefail`: a save that finds more than two entries of its kind, all less than a day
    old (a day of changed requirements), keeps them and returns 0 (its pruning loop once failed the whole setup)."""
    import sys
    repo, cache = tmp_path / "repo", tmp_path / "cache"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(repo / ".venv")], check=True, timeout=60)
    out = _venv_cache(repo, cache, "set -euo pipefail; for k in main-a main-b main-c; do venv_save $k .venv; done; "
                                   "echo saved")
    assert (out.returncode, out.stdout) == (0, "saved\n"), out.stderr
    assert sorted(p.name for p in cache.iterdir()) == ["main-a", "main-b", "main-c"]


def test_setup_restores_a_cached_virtualenv_instead_of_installing(tmp_path):
    """scripts/setup.sh with an entry for its stamp in the cache: .venv is restored and stamped, pip never runs
    (PIP_NO_INDEX would make an install fail), and it says so."""
    import sys
    repo, cache = tmp_path / "repo", tmp_path / "cache"
    (repo / "scripts").mkdir(parents=True)
    for f in ("scripts/setup.sh", "scripts/venv_cache.sh", "pyproject.toml"):
        shutil.copy(REPO / f, repo / f)
    src = tmp_path / "built"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(src / ".venv")], check=True, timeout=60)
    stamp = subprocess.run(["bash", "-c", "sha256sum pyproject.toml | cut -c1-16"], cwd=repo, capture_output=True,
                           text=True).stdout.strip()
    seeded = _venv_cache(src, cache, f'k=$(REPO="{repo}" venv_key main "{stamp} torch==2.13.0 ") && venv_save "$k" .venv')
    assert seeded.returncode == 0, seeded.stderr
    env = {**os.environ, "GLM_LORA_VENV_CACHE": str(cache), "GLM_LORA_SKIP_VLLM": "1", "GLM_LORA_DEVICE": "cpu",
           "PIP_NO_INDEX": "1", "PYTHON": sys.executable}
    env.pop("TORCH_VERSION", None), env.pop("TORCH_INDEX_URL", None)
    out = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[setup] .venv restored from the cache" in out.stdout, out.stdout
    assert (repo / ".venv/.glm-lora-stamp").read_text().strip() == stamp
    ran = subprocess.run([str(repo / ".venv/bin/python"), "-c", "import sys; print(sys.prefix)"], capture_output=True,
                         text=True, timeout=30)
    assert ran.stdout.strip() == str(repo / ".venv")
