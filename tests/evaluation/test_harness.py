"""evaluation/harness.py without a model: the shipped tasks' rows and scoring, lm_eval's results read into our scores,
and the checks that stop a run before training. The stage itself runs in tests/test_dag.py, the endpoint path in
tests/serve/test_deployment.py."""
from __future__ import annotations

import json

import pytest

from glm_lora.configs.load import load_config
from glm_lora.configs.errors import UserError
from glm_lora.evaluation import harness
from glm_lora.engine.preflight import preflight


def test_the_shipped_rows_are_the_tiny_defaults_held_out_problems(tmp_path):
    """What `glm-lora harness` reads without --data is exactly the default run's data/sft_eval.jsonl (seed 0) rows of
    the shipped tasks' families: problems no training file of the default holds."""
    from glm_lora.configs.schema import COMPARE_PROMPTS
    from glm_lora.data.synthetic import generate
    generate(tmp_path, seed=0, n_pretrain=3, n_sft=1, n_dpo=1, n_eval=200, held_out_prompts=COMPARE_PROMPTS)
    families = ("add", "sub", "copy", "reverse")
    expected = [line for line in (tmp_path / "sft_eval.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
                if json.loads(line)["task"].split("_")[0] in families]
    assert (harness.TASKS_DIR / "glm_lora_heldout.jsonl").read_text(encoding="utf-8") == "".join(expected)


def test_the_shipped_tasks_load_their_families_and_score_like_our_eval(tmp_path):
    rows = [{"conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": a}], "task": fam}
            for q, a, fam in (("1+1?", "2", "add_en"), ("copy ab", "ab", "copy_en"), ("3-1?", "2", "sub_zh"),
                              ("3 km = ? m", "3000", "units_en"))]
    data = tmp_path / "sft_eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tm = harness.task_manager([], list(harness.SHIPPED), metadata={"glm_lora_data": str(data)})
    tasks = tm.load(list(harness.SHIPPED))["tasks"]
    arith = tasks["glm_lora_arithmetic"]
    assert [d["prompt"] for d in arith.test_docs()] == ["1+1?", "3-1?"]
    assert [d["family"] for d in tasks["glm_lora_strings"].test_docs()] == ["copy_en"]
    doc = next(iter(arith.test_docs()))
    assert arith.doc_to_target(doc) == "2"
    assert arith.process_results(doc, [" 2\n"]) == {"exact_match": 1.0}        # check_answer: strip, then equal
    assert arith.process_results(doc, ["2 apples"]) == {"exact_match": 0.0}


def test_lm_evals_results_become_our_scores():
    results = {"results": {"t": {"alias": "t", "sample_len": 4, "exact_match,none": 0.5,
                                 "exact_match_stderr,none": 0.25},
                           "g": {"alias": "g", "acc,none": 0.75, "acc_stderr,none": "N/A"},
                           "ppl": {"word_perplexity,none": 12.5, "word_perplexity_stderr,none": "N/A"},
                           "f": {"exact_match,strict-match": 0.1, "exact_match_stderr,strict-match": 0.01,
                                 "exact_match,flexible-extract": 0.3}},
               "n-samples": {"t": {"original": 80, "effective": 4}},
               "higher_is_better": {"t": {"exact_match": True}, "ppl": {"word_perplexity": False}}}
    s = harness.scores(results)
    assert s["t"] == {"exact_match": 0.5, "exact_match_stderr": 0.25, "n": 4, "metric": "exact_match", "score": 0.5,
                      "stderr": 0.25, "higher_is_better": True}
    assert s["g"]["score"] == 0.75 and "acc_stderr" not in s["g"] and s["g"]["n"] is None
    assert s["ppl"]["higher_is_better"] is False
    assert s["f"]["metric"] == "exact_match,strict-match" and s["f"]["exact_match,flexible-extract"] == 0.3
    assert s["f"]["score"] == 0.1 and s["f"]["stderr"] == 0.01
    assert "| t | exact_match | 0.5 ± 0.25 | 0.1 | 4 |" in harness.table(s, {"t": {"score": 0.1}})


def test_an_unknown_task_stops_the_run_in_preflight_naming_it_and_what_exists():
    cfg = load_config("tiny", {"eval.harness.tasks": ["glm_lora_arithmetic", "glm_lora_arithmatic"]})
    with pytest.raises(UserError) as e:
        preflight(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("eval.harness.tasks: unknown lm-evaluation-harness task "
                                              "glm_lora_arithmatic;")
    assert "glm_lora_arithmetic, glm_lora_strings" in msg and "lm-eval ls tasks" in msg


def test_task_folders_and_data_are_checked_before_training(tmp_path):
    with pytest.raises(UserError, match=r"eval.harness.include_path: .*nowhere is not a directory"):
        preflight(load_config("tiny", {"eval.harness.tasks": ["mine"],
                                       "eval.harness.include_path": [str(tmp_path / "nowhere")]}))
    # a task of the user's whose data file is gone: refused before training, not after it
    (tmp_path / "mine.yaml").write_text(
        "task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + str(tmp_path / "gone.jsonl") +
        "\ntest_split: test\noutput_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "metric_list:\n  - metric: exact_match\n")
    cfg = load_config("tiny", {"eval.harness.tasks": ["mine"], "eval.harness.include_path": [str(tmp_path)]})
    with pytest.raises(UserError, match=r"eval.harness.tasks: task mine does not load here .*gone.jsonl"):
        preflight(cfg)
    # the shipped tasks score the synthetic families: on the user's own SFT data they have no rows
    sft = tmp_path / "chat.jsonl"
    sft.write_text(json.dumps({"conversations": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "hello"}]}) + "\n")
    with pytest.raises(UserError, match=r"glm_lora_strings score the synthetic data's held-out task families"):
        preflight(load_config("tiny", {"eval.harness.tasks": ["glm_lora_strings"], "data.sft": str(sft)}))


def test_the_gate_names_only_tasks_the_harness_stage_runs():
    from glm_lora.configs.load import ConfigError
    with pytest.raises(ConfigError, match=r"serve.gate.harness names \['glm_lora_strings'\], which eval.harness.tasks"):
        load_config("tiny", {"eval.harness.tasks": ["glm_lora_arithmetic"],
                             "serve.gate.harness": {"glm_lora_strings": 0.0}})


def test_the_cli_refuses_an_unknown_task_in_one_line(capsys):
    from glm_lora.flows.cli import main
    assert main(["harness", "--url", "http://127.0.0.1:9", "--model", "tiny", "--tasks", "nope_nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: eval.harness.tasks: unknown lm-evaluation-harness task "
                                                   "nope_nope;")
