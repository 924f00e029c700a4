"""The bad-input catalogue's tools: run the real CLI, snapshot the tree, check the one-line error.

Every case asserts three things: the exit status, one clear message naming the place (file / row /
key), and that no file outside the stage's own output changed (a before/after snapshot).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
USER_ERROR_EXIT = 2

# A tiny, fast configuration: a few steps of every stage, no serving.
FAST = {
    "run_name": "case", "device": "cpu", "precision": "fp32",
    "model": {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128,
              "max_seq_len": 128},
    "tokenizer": {"vocab_size": 700},
    "data": {"synthetic": {"n_pretrain": 200, "n_sft": 100, "n_dpo": 40, "n_eval": 10}},
    "pretrain": {"max_steps": 4, "batch_size": 2, "seq_len": 64},
    "sft": {"max_steps": 4, "batch_size": 2, "seq_len": 64, "lora": {"r": 4}},
    "dpo": {"max_steps": 2, "batch_size": 2, "seq_len": 128, "lora": {"r": 4}},
    "checkpoint": {"save_every": 2, "async_save": False},
    "eval": {"max_rows": 4, "max_new_tokens": 4},
    "serve": {"enabled": False},
}


def deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory holding the case's config, user files and runs/ (the CLI runs with it as cwd)."""
    (tmp_path / "runs").mkdir()
    return tmp_path


def write_config(workdir: Path, extra: dict | None = None, name: str = "case.yaml") -> Path:
    cfg = deep_merge(FAST, {"runs_dir": str(workdir / "runs"), **(extra or {})})
    path = workdir / name
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    return path


def run_cli(*argv: str, cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m glm_lora.flows.cli ...` in a subprocess: the real exit status and the real stderr."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "glm_lora.flows.cli", *argv], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The CLI's one-line error; fails the test if there is a traceback or not exactly one."""
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, f"a user error must not print a traceback:\n{out[-4000:]}"
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, f"expected one 'error: ' line on stderr, got {lines}:\n{out[-4000:]}"
    assert len(lines[0]) < 2000, f"error line is {len(lines[0])} characters long"
    return lines[0]


def snapshot(*roots: Path, exclude: tuple[Path, ...] = ()) -> dict[str, str]:
    """sha256 of every file under the roots (and the set of directories), for before/after checks."""
    out: dict[str, str] = {}
    excluded = [Path(e).resolve() for e in exclude]
    for root in roots:
        root = Path(root).resolve()
        if not root.exists():
            continue
        for p in sorted(root.rglob("*")):
            rp = p.resolve() if not p.is_symlink() else p
            if any(rp == e or e in rp.parents for e in excluded) or "__pycache__" in p.parts:
                continue
            if p.is_dir():
                out[str(p)] = "dir"
            elif p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def tiny_hf_base(root: Path, arch: str = "LlamaForCausalLM", **config) -> Path:
    """A tiny HF model of class `arch` at random init with our tokenizer, in root/model (nothing from a hub)."""
    import torch
    import transformers
    from glm_lora.data.tokenizer import load_tokenizer, train_tokenizer

    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of a small corpus with words and numbers {i * 7}" for i in range(300)))
    train_tokenizer([corpus], root / "model", vocab_size=600)
    tok = load_tokenizer(root / "model")
    torch.manual_seed(0)
    config_class = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    shape = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=96,
                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    getattr(transformers, arch)(config_class(**{**shape, **config})).save_pretrained(root / "model")
    return root / "model"
