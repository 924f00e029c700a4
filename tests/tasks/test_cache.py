"""tasks/cache.py: what invalidates a stage's cache key, and when a published artifact is reused."""
import os
from pathlib import Path

import pytest

from glm_lora.artifacts import manifest as artifacts
from glm_lora.artifacts.manifest import build
from glm_lora.configs.load import load_config
from glm_lora.tasks.cache import reusable, stage_key
from glm_lora.tasks.table import STAGES

STAGE_INPUTS = [s for s in STAGES if STAGES[s].cached]

UP = [{"stage": "data", "path": "/x/data", "digest": "a" * 64}, {"stage": "tok", "path": "/x/tok", "digest": "b" * 64}]


def cfgd(**overrides):
    return load_config("tiny", overrides)


def key(stage, cfg=None, upstream=UP, out=Path("/runs/tiny/x")):
    return stage_key(stage, cfg if cfg is not None else cfgd(), upstream, out)


def test_key_is_deterministic_and_stage_specific():
    assert key("sft") == key("sft")
    assert len({key(s) for s in STAGE_INPUTS}) == len(STAGE_INPUTS)


@pytest.mark.parametrize("stage, override", [
    ("sft", {"sft.lr": 1e-4}),
    ("sft", {"sft.lora.r": 8}),
    ("sft", {"precision": "bf16"}),
    ("dpo", {"dpo.beta": 0.5}),
    ("pretrain", {"model.num_heads": 3, "model.num_kv_heads": 1}),
    ("pretrain", {"pretrain.max_steps": 7}),
    ("tokenizer", {"tokenizer.vocab_size": 500}),
    ("data", {"data.synthetic.seed": 3}),
    ("export", {"serve.dtype": "bfloat16"}),
])
def test_own_section_changes_the_key(stage, override):
    assert key(stage, cfgd(**override)) != key(stage)


@pytest.mark.parametrize("stage, override", [
    ("sft", {"dpo.beta": 0.5}),
    ("sft", {"dpo.lora.r": 4}),
    ("sft", {"model.num_heads": 3, "model.num_kv_heads": 1}),   # reaches sft through the base artifact's digest instead
    ("sft", {"serve.port": 9000}),
    ("dpo", {"sft.lr": 1e-4}),
    ("pretrain", {"sft.max_steps": 3}),
    ("data", {"tokenizer.vocab_size": 500}),
    ("export", {"serve.prompt": "hello"}),
    ("export", {"serve.port": 9000}),
])
def test_unrelated_section_keeps_the_key(stage, override):
    assert key(stage, cfgd(**override)) == key(stage)


def test_upstream_digest_changes_the_key_order_does_not():
    changed = [UP[0], {**UP[1], "digest": "c" * 64}]
    assert key("sft", upstream=changed) != key("sft")
    assert key("sft", upstream=list(reversed(UP))) == key("sft")
    assert key("sft", upstream=UP[:1]) != key("sft")


def test_out_dir_changes_the_key():
    assert key("sft", out=Path("/runs/other/sft")) != key("sft")


@pytest.fixture
def fake_repo(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    for pkg in {p for stage in STAGES.values() for p in stage.code}:
        (repo / pkg).mkdir(parents=True)
        (repo / pkg / "__init__.py").write_text(f"# {pkg}\n")
    monkeypatch.setattr(artifacts, "PACKAGE_ROOT", repo)
    artifacts.code_version.cache_clear()
    yield repo
    artifacts.code_version.cache_clear()


def _edit(repo: Path, rel: str, text: str) -> None:
    (repo / rel).write_text(text)
    artifacts.code_version.cache_clear()


def test_code_version_changes_the_key_of_stages_using_that_code(fake_repo):
    before = {s: key(s) for s in STAGE_INPUTS}
    _edit(fake_repo, "engine/trainer.py", "x = 1\n")
    after = {s: key(s) for s in STAGE_INPUTS}
    changed = {s for s in STAGE_INPUTS if before[s] != after[s]}
    assert {"sft", "dpo", "pretrain"} <= changed
    assert "data" not in changed and "tokenizer" not in changed

    _edit(fake_repo, "data/formats.py", "y = 1\n")
    again = {s: key(s) for s in STAGE_INPUTS}
    assert again["data"] != after["data"] and again["sft"] != after["sft"]

    _edit(fake_repo, "engine/trainer.py", "x = 2\n")        # any content edit, not just new files
    assert key("sft") != again["sft"]


def test_code_version_ignores_non_python_and_other_folders(fake_repo):
    k0 = key("sft")
    _edit(fake_repo, "engine/README.md", "notes")
    (fake_repo / "tests").mkdir()
    _edit(fake_repo, "tests/test_x.py", "y = 1\n")
    assert key("sft") == k0


def test_stage_code_covers_the_real_packages():
    for stage in STAGES.values():
        for pkg in stage.code:
            assert (artifacts.PACKAGE_ROOT / pkg / "__init__.py").is_file(), pkg


def test_user_data_file_content_not_mtime_changes_the_key(tmp_path):
    f = tmp_path / "sft.jsonl"
    f.write_text('{"conversations": []}\n')
    cfg = cfgd(**{"data.sft": str(f)})
    k0 = key("data", cfg)
    assert k0 != key("data")              # naming a user file at all changes it
    assert key("data", cfg) == k0         # untouched file: same key
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert key("data", cfg) == k0         # touched, same content: same key (a nightly re-runs nothing)
    f.write_text('{"conversations": []}\n\n')
    assert key("data", cfg) != k0
    f.write_text('{"conversations": [1]}\n')   # same size, other content
    assert key("data", cfg) != k0


def test_base_model_dir_contents_change_the_tokenizer_key(tmp_path):
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text("{}")
    cfg = cfgd(base_model=str(d))
    k0 = key("tokenizer", cfg)
    (d / "tokenizer.json").write_text("{}")
    assert key("tokenizer", cfg) != k0
    assert key("import_base", cfg) == key("import_base", cfg)


@pytest.fixture
def published(tmp_path):
    out = tmp_path / "runs" / "tiny" / "sft"
    k = key("sft", out=out)

    def work(tmp: Path):
        (tmp / "adapter.safetensors").write_bytes(b"\x01" * 32)
        return {"loss": 1.0}
    build(out, "sft", work, config={"cache_key": k, "run": cfgd()})
    return out, k


def test_reusable_when_key_matches(published):
    out, k = published
    assert reusable(out, k)


def test_not_reusable_when_key_differs(published):
    out, k = published
    assert not reusable(out, key("sft", cfgd(**{"sft.lr": 1e-4}), out=out))


def test_not_reusable_when_corrupt_or_missing(published, tmp_path):
    out, k = published
    (out / "adapter.safetensors").write_bytes(b"\x02" * 32)
    assert not reusable(out, k)
    (out / "adapter.safetensors").unlink()
    assert not reusable(out, k)
    assert not reusable(tmp_path / "nothing", k)


def test_not_reusable_without_cache_key(tmp_path):
    out = tmp_path / "a"
    build(out, "sft", lambda tmp: (tmp / "f").write_text("x") and None)
    assert not reusable(out, key("sft", out=out))


# ---------------------------------------------------------------- code each stage runs

OUR_PACKAGES = ("artifacts", "configs", "data", "engine", "evaluation", "export", "kernels", "model", "serve", "tasks")
STAGE_ENTRY = {name: stage.run.__module__ for name, stage in STAGES.items() if stage.cached}


def _module_file(name: str) -> Path | None:
    base = artifacts.PACKAGE_ROOT.joinpath(*name.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def _imported_packages(entry: str) -> set[str]:
    """Our top-level packages reachable from `entry` through import statements (transitively); module names
    without the installed namespace (glm_lora.engine.sft → engine.sft)."""
    import ast
    seen, todo, pkgs = set(), [entry.removeprefix("glm_lora.")], set()
    while todo:
        name = todo.pop()
        f = _module_file(name)
        if name in seen or f is None:
            continue
        seen.add(name)
        pkgs.add(name.split(".")[0])
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            targets = [t.removeprefix("glm_lora.") for t in targets]
            todo += [t for t in targets if t.split(".")[0] in OUR_PACKAGES]
    return pkgs


@pytest.mark.parametrize("stage", sorted(STAGE_ENTRY))
def test_stage_code_includes_every_package_the_stage_imports(stage):
    """Editing code a stage runs must change its key, else a stale artifact is reused."""
    # artifacts only publishes (content-neutral); configs' values enter the key as config sections.
    missing = _imported_packages(STAGE_ENTRY[stage]) - set(STAGES[stage].code) - {"artifacts", "configs"}
    assert not missing, f"{stage} runs code from {sorted(missing)} that is not in STAGES[{stage!r}].code"


def test_editing_adapter_merge_code_invalidates_export(fake_repo):
    (fake_repo / "model" / "adapters.py").write_text("def load_policy(): ...\n")
    artifacts.code_version.cache_clear()
    k0 = key("export")
    _edit(fake_repo, "model/adapters.py", "def load_policy(): return 'merged differently'\n")
    assert key("export") != k0
