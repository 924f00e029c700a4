"""Bad-input catalogue, data limits: an over-long row stops the data stage with one line naming the
file, the line and the limit (or is counted with on_bad_row: skip), and a bad held-out row is
caught by the data stage, before any training."""
from __future__ import annotations

import json
from pathlib import Path

from tests.reliability.conftest import (
    USER_ERROR_EXIT, changed, error_line, run_cli, snapshot, write_config,
)

GOOD_SFT = {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def _sft_with_long_line(path: Path, mb: int = 9) -> Path:
    """A chat JSONL file whose line 2 is an `mb` MB conversation (written in chunks, never held whole)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(GOOD_SFT) + "\n")
        f.write('{"conversations": [{"role": "user", "content": "')
        for _ in range(mb):
            f.write("x" * 2**20)
        f.write('"}, {"role": "assistant", "content": "a"}]}\n')
        for i in range(3):
            f.write(json.dumps({"conversations": [{"role": "user", "content": f"q{i}"},
                                                  {"role": "assistant", "content": f"a{i}"}]}) + "\n")
    return path


def _outside_the_run(workdir: Path, before: dict, after: dict) -> list[str]:
    """Changed paths outside runs/case/ (the run's lock file is its own bookkeeping)."""
    run = str((workdir / "runs" / "case").resolve())
    return [p for p in changed(before, after)
            if not (p == run or p.startswith(run + "/") or p.endswith("/.lock"))]


def test_a_9_mb_line_stops_the_data_stage_naming_file_line_and_limit(workdir):
    sft = _sft_with_long_line(workdir / "chat.jsonl")
    cfg = write_config(workdir, {"data": {"sft": str(sft)}})
    before = snapshot(workdir)
    proc = run_cli("stage", "data", "--config", str(cfg), cwd=workdir)
    after = snapshot(workdir)
    assert proc.returncode == USER_ERROR_EXIT, proc.stderr[-3000:]
    line = error_line(proc)
    assert line == f"error: {sft.resolve()}:2: line longer than data.max_line_bytes (8 MiB)", line
    assert len(proc.stderr) < 20_000          # the 9 MB row is not echoed anywhere
    assert _outside_the_run(workdir, before, after) == []
    assert not (workdir / "runs" / "case" / "data" / "manifest.json").exists()


def test_with_skip_the_long_line_is_counted_and_a_bad_eval_row_too(workdir):
    """on_bad_row: skip: the over-long line and a bad held-out row are counted, the stage succeeds."""
    sft = _sft_with_long_line(workdir / "chat.jsonl")
    sft_eval = workdir / "chat_eval.jsonl"
    sft_eval.write_text("\n".join([json.dumps(GOOD_SFT), '{"conversations": [', json.dumps(GOOD_SFT)]) + "\n")
    cfg = write_config(workdir, {"data": {"sft": str(sft), "sft_eval": str(sft_eval), "on_bad_row": "skip",
                                          "max_drop_fraction": 0.5}})
    before = snapshot(workdir)
    proc = run_cli("stage", "data", "--config", str(cfg), cwd=workdir)
    after = snapshot(workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((workdir / "runs" / "case" / "data" / "manifest.json").read_text())["metrics"]
    assert (metrics["rows_sft"], metrics["bad_rows_sft"]) == (5, 1)
    assert (metrics["rows_sft_eval"], metrics["bad_rows_sft_eval"]) == (3, 1)
    assert _outside_the_run(workdir, before, after) == []

    # the same held-out file with on_bad_row: error stops the data stage (before any training)
    cfg = write_config(workdir, {"data": {"sft_eval": str(sft_eval)}, "run_name": "case"}, name="strict.yaml")
    proc = run_cli("stage", "data", "--config", str(cfg), cwd=workdir)
    assert proc.returncode == USER_ERROR_EXIT, proc.stderr[-3000:]
    assert error_line(proc).startswith(f"error: {sft_eval.resolve()}:2: invalid JSON")
