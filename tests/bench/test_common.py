"""bench/common.py: each run writes a new results file named by date and commit, never over another."""
import json
import re

from bench import common


def test_runs_never_overwrite_each_other(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setenv("GLM_LORA_COMMIT", "abc1234")
    first = common.write_result("kernels_swiglu", {"rows": [1]})
    second = common.write_result("kernels_swiglu", {"rows": [2]})      # e.g. a rerun of some providers
    assert re.fullmatch(r"kernels_swiglu_\d{4}-\d{2}-\d{2}_abc1234\.json", first.name)
    assert second.name == first.name.replace(".json", "_2.json")
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    assert (a["rows"], b["rows"]) == ([1], [2]) and a["commit"] == "abc1234"
    assert {"command", "date", "machine"} <= set(a)


def test_commit_without_git(monkeypatch):
    monkeypatch.delenv("GLM_LORA_COMMIT", raising=False)
    monkeypatch.setattr(common, "_git", lambda *args: "")
    assert common.commit() == "nogit"
