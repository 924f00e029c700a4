"""The whole DAG on a shortened tiny config under Prefect, vLLM serve included.

Asserts on real outputs: transformers loads the merged export with our logits, peft loads both
adapters with our logits, vLLM's greedy answer equals our in-process greedy answer, and a
re-run comes from cache (a changed DPO section re-runs DPO and what follows only). The first run is
tracked in a real MLflow server (tracking.backend: mlflow), read back through MLflow's client.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import socket
import time
from pathlib import Path
from uuid import UUID

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SHORT = {"pretrain.max_steps": 60, "sft.max_steps": 120, "dpo.max_steps": 20,
         "data.synthetic.n_pretrain": 1500, "data.synthetic.n_sft": 1000, "data.synthetic.n_dpo": 200,
         "serve.keep_running": False, "serve.max_tokens": 16}
STAGES = ("data", "tokenizer", "pretrain", "sft", "dpo", "export", "gguf", "harness", "serve")    # the first run's
# The first run only (the later runs reuse `dag["overrides"]` without it): lm-evaluation-harness on a shipped task,
# 8 samples, and the gate reading its score (nothing served yet: against the base model's)
HARNESS = {"eval.harness.tasks": ["glm_lora_arithmetic"], "eval.harness.limit": 8,
           "serve.gate.harness": {"glm_lora_arithmetic": 0.0}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """Started before the Prefect harness, so the two warm up side by side; None without mlflow installed."""
    if importlib.util.find_spec("mlflow") is None:
        yield None
        return
    from tests.mlflow_server import MlflowServer
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness
    with prefect_test_harness(server_startup_timeout=120):
        yield


def _task_states(flow_run_id) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    states: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        for _ in range(60):   # task states reach the API asynchronously
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            states = {r.name.rsplit("-", 1)[0]: r.state.name for r in runs}
            if runs and all(r.state and r.state.is_final() for r in runs):
                return states
            time.sleep(1)
    return states


def _flow_run(overrides: dict):
    """The completed flow run's final state."""
    from glm_lora.flows.glm_lora import glm_lora
    state = glm_lora(config="tiny", overrides=overrides, return_state=True)
    assert state.is_completed(), state
    return state


def _run(overrides: dict):
    state = _flow_run(overrides)
    return state.result(), _task_states(state.state_details.flow_run_id)


@pytest.fixture(scope="module")
def dag(mlflow_server, prefect_server, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    overrides = {**SHORT, "runs_dir": str(runs), "serve.port": _free_port()}
    tracking = {} if mlflow_server is None else {"tracking.backend": "mlflow",
                                                 "tracking.tracking_uri": mlflow_server.wait()}
    state = _flow_run({**overrides, **HARNESS, **tracking})   # only this run is tracked: the others reuse `overrides`
    flow_run_id = state.state_details.flow_run_id
    return {"overrides": overrides, "result": state.result(), "states": _task_states(flow_run_id),
            "run_dir": runs / "tiny", "mlflow": mlflow_server and mlflow_server.url, "flow_run_id": str(flow_run_id)}


def test_every_stage_ran_and_vllm_matches_inprocess_greedy(dag):
    assert dag["states"] == {s: "Completed" for s in STAGES}
    r = dag["result"]
    assert r["answer"].strip(), "vLLM returned an empty answer"
    assert r["answer"].strip() == r["inprocess_answer"].strip()
    assert r["matches_inprocess"] is True
    answer = json.loads((dag["run_dir"] / "serve" / "answer.json").read_text())
    assert answer["answer"] == r["answer"]
    record = json.loads((dag["run_dir"] / "serve" / "server.json").read_text())
    assert record["running"] is False
    with pytest.raises(ProcessLookupError):
        import os
        os.kill(record["pid"], 0)


def test_the_gguf_stage_writes_the_final_model_for_llama_cpp_and_ollama(dag):
    """The default's export.gguf: f16 and q8_0 files of merged/ with the tokenizer and chat template inside (read
    back with gguf's own reader; llama.cpp runs them in tests/test_quality.py and tests/export/test_gguf.py)."""
    from gguf import GGUFReader
    d = dag["run_dir"] / "gguf"
    assert sorted(p.name for p in d.glob("*.gguf")) == ["tiny-f16.gguf", "tiny-q8_0.gguf"]
    reader = GGUFReader(d / "tiny-q8_0.gguf")
    field = lambda k: reader.fields[k].contents()      # noqa: E731
    assert field("general.architecture") == "qwen3"
    assert "<|im_start|>" in field("tokenizer.chat_template")
    config = json.loads((dag["run_dir"] / "export" / "merged" / "config.json").read_text())
    assert len(field("tokenizer.ggml.tokens")) == config["vocab_size"]
    assert {t.name: t.tensor_type.name for t in reader.tensors}["blk.0.attn_q.weight"] == "Q8_0"
    assert "FROM ./tiny-f16.gguf" in (d / "Modelfile").read_text()


def test_the_harness_stage_scores_the_export_as_our_decoder_answers_and_the_gate_reads_it(dag):
    """lm_eval's `hf` model on export/merged answers each sample as our decoder does (greedy, chat template), the
    scores reach the manifest and the UI, and the serve stage's gate checked them (against export/base's)."""
    from glm_lora.evaluation.decode import greedy_answers
    from glm_lora.data.tokenizer import load_tokenizer
    from glm_lora.model.adapters import load_policy
    d = dag["run_dir"]
    m = json.loads((d / "harness" / "manifest.json").read_text())["metrics"]
    score, base = m["harness"]["glm_lora_arithmetic"], m["base"]["glm_lora_arithmetic"]
    assert score["n"] == base["n"] == 8 and score["metric"] == "exact_match" and 0 <= score["score"] <= 1
    samples = [json.loads(line) for line in (d / "harness" / "samples.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (d / "data" / "sft_eval.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["task"].split("_")[0] in ("add", "sub")][:8]
    ours = greedy_answers(load_policy(d / "pretrain", d / "sft", d / "dpo").eval(), load_tokenizer(d / "tokenizer"),
                          [r["conversations"][:-1] for r in rows], max_new_tokens=24)
    assert [s["response"][0].strip() for s in sorted(samples, key=lambda s: s["doc_id"])] == [a.strip() for a in ours]
    assert score["score"] == sum(a.strip() == r["conversations"][-1]["content"] for a, r in zip(ours, rows)) / 8
    gate = dag["result"]["gate"]
    row = f"| harness.glm_lora_arithmetic | {score['score']:.4g} | {base['score']:.4g} (base) | ≥ base | pass |"
    assert row in gate, gate


def test_each_stage_reports_held_out_metrics_and_pretraining_learns(dag):
    """CI's learning floor on the shortened config: pretraining cuts held-out perplexity ≥ 5×."""
    d = dag["run_dir"]
    pre = json.loads((d / "pretrain" / "manifest.json").read_text())["metrics"]["eval"]
    assert pre["init_perplexity"] / pre["perplexity"] >= 5, pre
    assert 0 < pre["bits_per_byte"] < pre["init_bits_per_byte"]
    sft = json.loads((d / "sft" / "manifest.json").read_text())["metrics"]["eval"]
    assert set(sft["per_family"]) == {"add_en", "add_zh", "sub_en", "sub_zh", "copy_en", "copy_zh",
                                      "reverse_en", "reverse_zh", "units_en", "units_zh"}
    dpo = json.loads((d / "dpo" / "manifest.json").read_text())["metrics"]["eval"]
    for key in ("implicit_reward_accuracy", "mean_margin", "exact_match", "rejected_match_rate",
                "sft_rejected_match_rate"):
        assert dpo[key] is not None, key
    exported = json.loads((d / "export" / "manifest.json").read_text())["metrics"]["eval"]
    assert set(exported) == {"pretrain", "sft", "dpo"}
    assert "dpo.exact_match" in dag["result"]["gate"]
    compare = (d / "export" / "compare.md").read_text()
    header = compare.splitlines()[2]
    assert all(name in header for name in ("pretrain", "sft", "dpo")) and "What is 12 + 7?" in compare


def test_each_stage_shows_tables_and_loss_curves_in_the_ui(dag):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    with get_client(sync_client=True) as client:
        found = {a.key: a for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="tiny-")))}
    for stage in ("pretrain", "sft", "dpo"):
        assert {f"tiny-{stage}-metrics", f"tiny-{stage}-eval", f"tiny-{stage}-loss-curve"} <= found.keys(), stage
    assert {"tiny-sft-families", "tiny-sft-samples", "tiny-sft-cleaning", "tiny-compare", "tiny-answer",
            "tiny-harness-benchmarks"} <= found.keys()
    assert found["tiny-sft-metrics"].type == "table" and found["tiny-sft-loss-curve"].type == "markdown"
    assert "data:image/png;base64," in found["tiny-sft-loss-curve"].data
    assert (dag["run_dir"] / "reports" / "sft-loss.png").is_file()
    for stage in ("pretrain", "sft", "dpo"):      # updated every logging window, 100% once the stage is done
        bar = found[f"tiny-{stage}-progress"]
        assert bar.type == "progress" and float(bar.data) == 100.0 and "done" in bar.description, bar


def test_the_prefect_ui_shows_every_stage_and_the_loss_curve_in_a_real_browser(dag, tmp_path):
    """The UI a user opens, in headless Chromium (tests/prefect_ui.py): the harness's server serves no UI, so a second
    `prefect server start` (UI, an auth string, no services) reads its database. Logged in through the login form,
    the flow run's Task Runs tab shows every stage Completed, its Artifacts tab each training stage's metrics table
    and loss curve, and the SFT loss curve's page its PNG. Screenshots under tmp_path
    (scripts/ui_check.py makes the docs' ones)."""
    import prefect.settings
    from tests.prefect_ui import check_flow_run, dag_expected, ui_server
    database = prefect.settings.PREFECT_SERVER_DATABASE_CONNECTION_URL.value()
    with ui_server(tmp_path / "prefect-home", database) as server:
        missing = check_flow_run(server, dag["flow_run_id"], dag_expected("tiny", {s: "Completed" for s in STAGES}),
                                 tmp_path / "screenshots")
    assert missing == [], "not found in the Prefect UI:\n" + "\n".join(missing)


def test_the_run_is_tracked_in_a_real_mlflow_server_and_the_served_export_registered(dag, tmp_path):
    """One MLflow run per flow run, named after the Prefect flow run and tagged with its id: the config as params,
    each stage's logging windows at their steps and its held-out metrics, loss curves and model cards as artifacts,
    and the export the serve stage passed registered with its digest (its weights, downloaded through the server,
    are the export's); not the `serving` alias: this DAG's candidate is tested, not switched to."""
    if dag["mlflow"] is None:
        pytest.skip("mlflow is not installed (pip install -e '.[tracking]')")
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    client, d = MlflowClient(dag["mlflow"]), dag["run_dir"]
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert run.info.status == "FINISHED"
    with get_client(sync_client=True) as prefect:
        flow_run = prefect.read_flow_run(UUID(run.data.tags["prefect.flow_run_id"]))
    assert flow_run.name == run.info.run_name and flow_run.parameters["overrides"]["tracking.backend"] == "mlflow"
    assert run.data.params["sft.max_steps"] == "120"
    assert {k: v for k, v in run.data.tags.items() if k.startswith("stage.") and "digest" not in k} == {
        f"stage.{s}": "built" for s in ("data", "tokenizer", "pretrain", "sft", "dpo", "export", "gguf", "harness",
                                        "serve")}
    windows = [json.loads(line) for line in (d / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "sft/loss")] == [
        (w["step"], w["loss"]) for w in windows]
    sft = json.loads((d / "sft" / "manifest.json").read_text())["metrics"]
    assert run.data.metrics["sft/eval.exact_match"] == sft["eval"]["exact_match"]
    listed = lambda path: {a.path for a in client.list_artifacts(run.info.run_id, path)}  # noqa: E731
    assert {f"reports/{s}-loss.png" for s in ("pretrain", "sft", "dpo")} <= listed("reports")
    assert "stages/export/merged/README.md" in listed("stages/export/merged")
    assert "stages/serve/gate.md" in listed("stages/serve")
    (version,) = client.search_model_versions("name = 'tiny'")
    assert version.run_id == run.info.run_id and version.tags["export_digest"] == dag["result"]["digest"]
    assert client.get_registered_model("tiny").aliases == {}
    weights = client.download_artifacts(run.info.run_id, "model/model.safetensors", str(tmp_path))
    sha = lambda p: hashlib.sha256(Path(p).read_bytes()).hexdigest()  # noqa: E731
    assert sha(weights) == sha(d / "export" / "merged" / "model.safetensors")


def _ids(run_dir: Path) -> torch.Tensor:
    from glm_lora.data.tokenizer import load_tokenizer
    tok = load_tokenizer(run_dir / "tokenizer")
    msgs = [{"role": "user", "content": "What is 12 + 7?"}, {"role": "assistant", "content": "19"}]
    return torch.tensor([tok.apply_chat_template(msgs, tokenize=True, return_dict=False)])


def test_merged_export_loads_in_transformers_with_our_logits(dag):
    from transformers import AutoModelForCausalLM
    from glm_lora.model.adapters import load_policy
    d = dag["run_dir"]
    ours = load_policy(d / "pretrain", d / "sft", d / "dpo").eval()
    hf = AutoModelForCausalLM.from_pretrained(d / "export" / "merged", dtype=torch.float32).eval()
    ids = _ids(d)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-4, rtol=1e-4)


def test_peft_adapters_load_and_match(dag):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from glm_lora.model.adapters import load_policy
    d, exp = dag["run_dir"], dag["run_dir"] / "export"
    ids = _ids(d)
    base = AutoModelForCausalLM.from_pretrained(exp / "base", dtype=torch.float32)
    with_sft = PeftModel.from_pretrained(base, exp / "adapters" / "sft").eval()
    with torch.no_grad():
        torch.testing.assert_close(with_sft(ids).logits, load_policy(d / "pretrain", d / "sft").eval()(ids),
                                   atol=1e-4, rtol=1e-4)
        sft_merged = with_sft.merge_and_unload()
        with_dpo = PeftModel.from_pretrained(sft_merged, exp / "adapters" / "dpo").eval()
        merged = AutoModelForCausalLM.from_pretrained(exp / "merged", dtype=torch.float32).eval()
        torch.testing.assert_close(with_dpo(ids).logits, merged(ids).logits, atol=1e-4, rtol=1e-4)


def test_rerun_is_cached_and_a_dpo_change_reruns_only_downstream(dag, caplog, monkeypatch):
    """The first re-run also names a tracking server nobody runs: one warning line, and the run is the same. In the
    second, only the stage that actually trains (DPO) holds the global `glm-lora-train` concurrency slot: not the
    cached ones, not export."""
    import contextlib
    import glm_lora.tasks.stages as stages
    quiet = {**dag["overrides"], "serve.enabled": False}
    dead = f"http://127.0.0.1:{_free_port()}"
    with caplog.at_level(logging.WARNING, logger="glm_lora.tracking"):
        result, states = _run({**quiet, "tracking.backend": "mlflow", "tracking.tracking_uri": dead})
    assert states == {s: "Cached" for s in ("data", "tokenizer", "pretrain", "sft", "dpo", "export", "gguf")}
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "glm_lora.tracking"]
    assert dead in warning and "untracked" in warning
    first = json.loads((dag["run_dir"] / "export" / "manifest.json").read_text())
    assert result["export"]["digest"] == first["digest"]

    taken = []

    @contextlib.contextmanager
    def slot(name, occupy=1):
        taken.append(name)
        yield
    monkeypatch.setattr(stages, "concurrency", slot)
    monkeypatch.setattr(stages, "_limit_exists", lambda name: True)    # as under scripts/run.sh, which creates it
    result, states = _run({**quiet, "dpo.beta": 0.2})
    assert states == {"data": "Cached", "tokenizer": "Cached", "pretrain": "Cached", "sft": "Cached",
                      "dpo": "Completed", "export": "Completed", "gguf": "Completed"}
    assert taken == ["glm-lora-train"]
    assert result["export"]["digest"] != first["digest"]


def test_base_model_path_starts_at_sft(dag, tmp_path):
    """A local HF Llama directory replaces tokenizer training + pretraining."""
    import shutil
    from transformers import LlamaConfig, LlamaForCausalLM
    from glm_lora.data.prepare import TOKENIZER_FILES
    from glm_lora.data.tokenizer import load_tokenizer
    from glm_lora.model.hf import load_native

    base_dir = tmp_path / "my-base"
    base_dir.mkdir()
    for f in TOKENIZER_FILES:
        if (dag["run_dir"] / "tokenizer" / f).is_file():
            shutil.copy2(dag["run_dir"] / "tokenizer" / f, base_dir / f)
    tok = load_tokenizer(base_dir)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                      tie_word_embeddings=False)).eval()
    hf.save_pretrained(base_dir)

    overrides = {**dag["overrides"], "run_name": "from-base", "base_model": str(base_dir), "serve.enabled": False,
                 "sft.max_steps": 10, "dpo.max_steps": 4}
    result, states = _run(overrides)
    assert states == {s: "Completed" for s in ("data", "tokenizer", "import_base", "sft", "dpo", "export", "gguf")}
    run_dir = Path(overrides["runs_dir"]) / "from-base"
    ids = _ids(run_dir)
    with torch.no_grad():
        torch.testing.assert_close(load_native(run_dir / "import_base").eval()(ids), hf(ids).logits,
                                   atol=1e-5, rtol=1e-5)
    assert (run_dir / "export" / "merged" / "model.safetensors").is_file()
    assert result["export"]["digest"] == json.loads((run_dir / "export" / "manifest.json").read_text())["digest"]


def test_a_stage_that_fails_mid_training_is_retried_by_prefect_and_resumes(dag, monkeypatch):
    """SFT raises once at step 7; Prefect retries the task; training resumes from the step-6 checkpoint."""
    import glm_lora.engine.trainer as trainer

    real_step, calls = trainer.train_step, {"n": 0, "failed": False}

    def flaky(model, loss_fn, batches, opt, scaler, trainable, cfg, rt, step):
        calls["n"] += 1
        if step == 7 and not calls["failed"] and cfg.max_steps == 12:
            calls["failed"] = True
            raise RuntimeError("injected failure at step 7")
        return real_step(model, loss_fn, batches, opt, scaler, trainable, cfg, rt, step)
    monkeypatch.setattr(trainer, "train_step", flaky)

    overrides = {**dag["overrides"], "run_name": "retry", "serve.enabled": False, "pretrain.max_steps": 10,
                 "sft.max_steps": 12, "dpo.max_steps": 2, "checkpoint.save_every": 2,
                 "checkpoint.save_optimizer_every": 2, "checkpoint.async_save": False}
    result, states = _run(overrides)
    assert calls["failed"]
    assert states["sft"] == "Completed"
    # pretrain 10 + sft: steps 0..6 and the failing call, then 6..11 (resumed at 6, not 0) + dpo 2
    assert calls["n"] == 10 + 8 + 6 + 2
    losses = json.loads((Path(overrides["runs_dir"]) / "retry" / "sft" / "losses.json").read_text())
    assert len(losses) == 12


LOAD_DPO_ADAPTER = """
import sys
from pathlib import Path
import torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM
export = Path(sys.argv[1])
model = AutoPeftModelForCausalLM.from_pretrained(str(export / "adapters" / sys.argv[2]), dtype=torch.float32).eval()
merged = AutoModelForCausalLM.from_pretrained(export / "merged", dtype=torch.float32).eval()
ids = torch.tensor([[5, 17, 42, 9, 3, 77, 11]])
with torch.no_grad():
    print("MAXDIFF", float((model(ids).logits - merged(ids).logits).abs().max()),
          model.peft_config["default"].base_model_name_or_path)
"""


def _load_dpo_adapter(export: Path, cwd: Path, adapter: str = "dpo"):
    """PEFT's one-liner on the export's last adapter (DPO's, or RL's), in a fresh process whose working directory is
    `cwd`; it prints the largest logit difference to merged/ and the base PEFT used."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", LOAD_DPO_ADAPTER, str(export), adapter], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def _glm4_base(path: Path) -> Path:
    """A tiny random Glm4ForCausalLM (GLM-4-0414 layout) with a GLM-4 chat template: nothing downloaded."""
    from transformers import Glm4Config, Glm4ForCausalLM
    from glm_lora.data.tokenizer import load_tokenizer
    from tests.chat_templates import build_tokenizer
    build_tokenizer(path, "glm4")
    tok = load_tokenizer(path)
    torch.manual_seed(0)
    Glm4ForCausalLM(Glm4Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                               initializer_range=0.1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)).save_pretrained(path)
    return path


def test_glm4_base_on_user_data_is_judged_on_its_own_rows_served_and_exported_loadably(dag, tmp_path):
    """The user's path: a GLM-4 base, Alpaca SFT and prompt/chosen/rejected DPO files with no *_eval paths.
    Every metric must come from rows held out of those files; vLLM serves the result with parity; the DPO
    adapter loads with PEFT's one-liner (AutoPeftModelForCausalLM) in a fresh process from another working directory,
    and from a copied run directory after `glm-lora relocate`."""
    import shutil
    import subprocess
    import sys

    words = ["apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "piano", "lemon", "amber", "grape",
             "delta", "flint", "harbor", "ivory", "jungle", "kettle", "lantern", "meadow", "nickel"]
    sft = tmp_path / "alpaca.json"
    sft.write_text(json.dumps([{"instruction": f"Repeat the word {w} {i}.", "input": "", "output": f"{w} {i}"}
                               for i in range(15) for w in words]))
    dpo = tmp_path / "prefs.jsonl"
    dpo.write_text("".join(json.dumps({"prompt": f"Say {w} {i}.", "chosen": f"{w} {i}", "rejected": f"no {i}"}) + "\n"
                           for i in range(6) for w in words))
    base = _glm4_base(tmp_path / "glm4-base")
    overrides = {**dag["overrides"], "run_name": "glm4-user", "base_model": str(base), "data.sft": str(sft),
                 "data.dpo": str(dpo), "sft.max_steps": 10, "dpo.max_steps": 4, "sft.eval_every": 5,
                 "dpo.eval_every": 2, "serve.port": _free_port()}
    result, states = _run(overrides)
    assert states == {s: "Completed" for s in ("data", "tokenizer", "import_base", "sft", "dpo", "export", "gguf",
                                               "serve")}
    run_dir = Path(overrides["runs_dir"]) / "glm4-user"
    sources = json.loads((run_dir / "data" / "sources.json").read_text())["splits"]
    for split, path in (("sft", sft), ("dpo", dpo)):
        assert sources[split]["held_out"]["rows"] >= 8
        assert sources[f"{split}_eval"]["held_out_from"]["path"] == str(path)
    for stage in ("sft", "dpo"):
        ev = json.loads((run_dir / stage / "manifest.json").read_text())["metrics"]["eval"]
        assert ev["data"] and all(d["user_data"] and d["source"] in (f"held out of {sft}", f"held out of {dpo}")
                                  for d in ev["data"].values()), ev["data"]
        assert {"exact_match", "chrf", "answer_loss"} <= ev.keys()
    assert result["matches_inprocess"] is True and result["token_ids"] and result["inprocess_token_ids"]
    assert json.loads((run_dir / "export" / "merged" / "config.json").read_text())["architectures"] == ["Glm4ForCausalLM"]

    elsewhere = tmp_path / "elsewhere"             # PEFT's one-liner from an unrelated working directory
    elsewhere.mkdir()
    proc = _load_dpo_adapter(run_dir / "export", elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff, base_used = proc.stdout.split("MAXDIFF")[1].split()
    assert float(diff) < 1e-4 and base_used == str((run_dir / "export" / "sft_merged").resolve())

    copy = tmp_path / "copied-run"                # a copy, the original gone: relocate, then the same one-liner
    shutil.copytree(run_dir, copy)
    hidden = run_dir.with_name("glm4-user-moved")
    run_dir.rename(hidden)
    try:
        assert _load_dpo_adapter(copy / "export", elsewhere).returncode != 0     # its base path is the original's
        relocated = subprocess.run([sys.executable, "-m", "glm_lora.flows.cli", "relocate", str(copy / "export")],
                                   capture_output=True, text=True, timeout=120, cwd=elsewhere)
        assert relocated.returncode == 0, relocated.stderr[-2000:]
        proc = _load_dpo_adapter(copy / "export", elsewhere)
    finally:
        hidden.rename(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff, base_used = proc.stdout.split("MAXDIFF")[1].split()
    assert float(diff) < 1e-4 and base_used == str((copy / "export" / "sft_merged").resolve())
    from glm_lora.artifacts.manifest import verify
    verify(copy / "export")                        # the copy's manifest records the relocated files


def _user_files(tmp_path: Path) -> tuple[Path, Path]:
    """The user's own chat and preference files (no *_eval paths), documents longer than a tiny DSA's index_topk."""
    words = ["apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "piano", "lemon", "amber"]
    sft = tmp_path / "chat.jsonl"
    sft.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Repeat {w} {i}, please."},
                                                    {"role": "assistant", "content": f"{w} {i}"}]}) + "\n"
                           for i in range(12) for w in words))
    dpo = tmp_path / "prefs.jsonl"
    dpo.write_text("".join(json.dumps({"prompt": f"Say {w} {i}.", "chosen": f"{w} {i}", "rejected": f"no {i}"}) + "\n"
                           for i in range(5) for w in words))
    return sft, dpo


def _glm45_base(path: Path) -> tuple[Path, dict]:
    """A tiny random GLM-4.5-style Glm4MoeForCausalLM (8 experts top-2 in 2 groups, a shared expert, one dense
    layer, q/k norm, attention bias) with one MTP layer's weights and a GLM-4 chat template: nothing downloaded.
    Returns the directory and the MTP tensors."""
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    from glm_lora.data.tokenizer import load_tokenizer
    from tests.chat_templates import build_tokenizer
    from tests.model.test_moe import mtp_tensors
    build_tokenizer(path, "glm4")
    tok = load_tokenizer(path)
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, use_qk_norm=True, attention_bias=True,
        routed_scaling_factor=2.5, num_nextn_predict_layers=1, max_position_embeddings=512, initializer_range=0.1,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.save_pretrained(path)
    mtp = mtp_tensors(model)
    save_file({**load_file(path / "model.safetensors"), **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    return path, mtp


def test_a_glm45_moe_base_on_user_files_runs_the_dag_serves_merged_with_parity_and_reruns_cached(dag, tmp_path):
    """GLM's current models are mixtures of experts: a GLM-4.5-style base on the user's own files goes through
    tokenizer (the base's) → import → LoRA SFT → DPO (attention, shared and routed experts) → export → serve.
    vLLM's CPU build serves the merged model (its MoE LoRA needs Triton on a GPU) with our greedy tokens;
    the MTP layer's weights leave unchanged; a second run comes from cache."""
    from safetensors.torch import load_file
    sft, dpo = _user_files(tmp_path)
    base, mtp = _glm45_base(tmp_path / "glm45-base")
    overrides = {**dag["overrides"], "run_name": "glm45-user", "base_model": str(base), "data.sft": str(sft),
                 "data.dpo": str(dpo), "sft.max_steps": 8, "dpo.max_steps": 3, "sft.lora.modules_to_save": [],
                 "serve.port": _free_port()}
    result, states = _run(overrides)
    assert states == {s: "Completed" for s in ("data", "tokenizer", "import_base", "sft", "dpo", "export", "gguf",
                                               "serve")}
    run_dir = Path(overrides["runs_dir"]) / "glm45-user"
    assert result["matches_inprocess"] is True and result["token_ids"] == result["inprocess_token_ids"]
    export = run_dir / "export"
    assert json.loads((export / "merged" / "config.json").read_text())["architectures"] == ["Glm4MoeForCausalLM"]
    merged = load_file(export / "merged" / "model.safetensors")
    assert all(torch.equal(merged[k], v) for k, v in mtp.items())                 # MTP: carried unchanged
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in merged
    adapter = load_file(export / "adapters" / "sft" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.1.mlp.experts.7.gate_proj.lora_B.weight" in adapter
    served = json.loads((run_dir / "serve" / "answer.json").read_text())
    assert list(served["models"]) == ["glm45-user"]                                 # merged only, on the CPU build

    again, states = _run(overrides)
    assert {s: states[s] for s in ("data", "tokenizer", "import_base", "sft", "dpo", "export")} == {
        s: "Cached" for s in ("data", "tokenizer", "import_base", "sft", "dpo", "export")}
    assert states["serve"] == "Completed" and again["matches_inprocess"] is True

    # QLoRA on the same base and steps: every routed expert in 4 bits; held-out answer loss within 2 % of the above
    from glm_lora.configs.load import load_config
    from glm_lora.flows.cli import run_one_stage
    read = lambda name: json.loads((run_dir / "sft" / name).read_text())          # noqa: E731
    full, full_losses = read("manifest.json")["metrics"]["eval"], read("losses.json")
    run_one_stage("sft", load_config("tiny", {**overrides, "sft.lora.quantization": "nf4"}))
    nf4, nf4_losses = read("manifest.json")["metrics"]["eval"], read("losses.json")
    assert len(nf4_losses) == len(full_losses) and nf4_losses != full_losses      # the experts really were 4-bit
    assert abs(nf4["answer_loss"] / full["answer_loss"] - 1) <= 0.02, (nf4["answer_loss"], full["answer_loss"])


def _latent_base(path: Path, kind: str) -> tuple[Path, dict]:
    """A tiny random GLM-4.7-Flash-style Glm4MoeLiteForCausalLM (`flash`: latent attention at the one latent width
    vLLM's CPU build runs, 512 + 64) or GLM-5-style GlmMoeDsaForCausalLM (`glm5`: DSA with index_topk 8, below the
    user's documents, a shared indexer layer), each with experts, one MTP layer's weights and a GLM-4 chat template."""
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    from glm_lora.data.tokenizer import load_tokenizer
    from tests.chat_templates import build_tokenizer
    from tests.model.test_moe import mtp_tensors
    build_tokenizer(path, "glm4")
    tok = load_tokenizer(path)
    torch.manual_seed(0)
    shape = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8,
                 num_experts_per_tok=2, q_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=64,
                 num_nextn_predict_layers=1, max_position_embeddings=512, initializer_range=0.1,
                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if kind == "flash":
        model = Glm4MoeLiteForCausalLM(Glm4MoeLiteConfig(**shape, kv_lora_rank=512))
    else:
        model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**shape, kv_lora_rank=32, index_topk=8, index_head_dim=64,
                                                     index_n_heads=4, first_k_dense_replace=1,
                                                     indexer_types=["full", "shared", "full"]))
    model.save_pretrained(path)
    mtp = mtp_tensors(model)
    save_file({**load_file(path / "model.safetensors"), **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    return path, mtp


def test_a_glm47_flash_base_runs_the_dag_serves_merged_with_parity_and_reruns_cached(dag, tmp_path):
    """GLM-4.7-Flash, the GLM users fine-tune on one GPU: latent attention + experts. A tiny random one on user files
    goes through import → LoRA SFT → DPO (every latent projection, kv_b_proj included, and the experts) → export →
    serve: vLLM's CPU build serves the merged model (CPU_MLA, torch's rotary) with our greedy tokens; the MTP layer
    leaves unchanged; the DPO adapter loads with PEFT's one-liner with our logits; a second run comes from cache."""
    from safetensors.torch import load_file
    sft, dpo = _user_files(tmp_path)
    base, mtp = _latent_base(tmp_path / "flash-base", "flash")
    overrides = {**dag["overrides"], "run_name": "flash-user", "base_model": str(base), "data.sft": str(sft),
                 "data.dpo": str(dpo), "sft.max_steps": 8, "dpo.max_steps": 3, "sft.lora.modules_to_save": [],
                 "export.gguf": [], "serve.port": _free_port()}
    result, states = _run(overrides)
    assert states == {s: "Completed" for s in ("data", "tokenizer", "import_base", "sft", "dpo", "export", "serve")}
    run_dir = Path(overrides["runs_dir"]) / "flash-user"
    assert result["matches_inprocess"] is True and result["token_ids"] == result["inprocess_token_ids"]
    export = run_dir / "export"
    assert json.loads((export / "merged" / "config.json").read_text())["architectures"] == ["Glm4MoeLiteForCausalLM"]
    merged = load_file(export / "merged" / "model.safetensors")
    assert all(torch.equal(merged[k], v) for k, v in mtp.items())                 # MTP: carried unchanged
    adapter = load_file(export / "adapters" / "dpo" / "adapter_model.safetensors")
    assert any(".self_attn.kv_b_proj.lora_B" in k for k in adapter) and any(".q_a_proj.lora_A" in k for k in adapter)
    proc = _load_dpo_adapter(export, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.split("MAXDIFF")[1].split()[0]) < 1e-4
    served = json.loads((run_dir / "serve" / "answer.json").read_text())
    assert list(served["models"]) == ["flash-user"]                                 # merged only, on the CPU build

    _, states = _run({**overrides, "serve.enabled": False})
    assert states == {s: "Cached" for s in ("data", "tokenizer", "import_base", "sft", "dpo", "export")}


def test_a_glm5_dsa_base_trains_on_the_sparse_path_exports_and_is_refused_serving_before_training(dag, tmp_path):
    """GLM-5: latent attention whose queries read only the index_topk keys its indexer picks (8 here, below the
    user's documents), a shared indexer layer, experts, an MTP layer. import → SFT → DPO → export on the sparse path
    (the stage metrics say so); the merged export loads in transformers with our logits, MTP layer included; vLLM's
    CPU build has no sparse attention, so serving is refused before anything trains; a second run comes from cache."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from glm_lora.model.adapters import load_policy
    sft, dpo = _user_files(tmp_path)
    base, mtp = _latent_base(tmp_path / "glm5-base", "glm5")
    overrides = {**dag["overrides"], "run_name": "glm5-user", "base_model": str(base), "data.sft": str(sft),
                 "data.dpo": str(dpo), "sft.max_steps": 8, "dpo.max_steps": 3, "sft.lora.modules_to_save": [],
                 "export.gguf": []}
    from glm_lora.flows.glm_lora import glm_lora
    refused = glm_lora(config="tiny", overrides=overrides, return_state=True)
    assert refused.is_failed() and "Sparse Attention is not supported on CPU" in refused.message
    run_dir = Path(overrides["runs_dir"]) / "glm5-user"
    assert not (run_dir / "sft").exists()                                        # refused before anything trained
    overrides["serve.enabled"] = False
    _, states = _run(overrides)
    assert states == {s: "Completed" for s in ("data", "tokenizer", "import_base", "sft", "dpo", "export")}
    for stage in ("sft", "dpo"):
        metrics = json.loads((run_dir / stage / "manifest.json").read_text())["metrics"]
        assert metrics["attention_paths"].get("sparse", 0) > 0, (stage, metrics["attention_paths"])
        assert 0 <= metrics["eval"]["mtp_acceptance"] <= 1                    # the carried MTP layer's draft acceptance
    assert "mtp_acceptance_base" in json.loads((run_dir / "sft" / "manifest.json").read_text())["metrics"]["eval"]
    export = run_dir / "export"
    merged = load_file(export / "merged" / "model.safetensors")
    assert all(torch.equal(merged[k], v) for k, v in mtp.items())
    theirs = AutoModelForCausalLM.from_pretrained(export / "merged", dtype=torch.float32).eval()
    ours = load_policy(run_dir / "import_base", run_dir / "sft", run_dir / "dpo").eval()
    x = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(x).logits - ours(x)).abs().max().item() < 1e-4
    assert ours.attention_paths == {"sparse": 1}
    _, states = _run(overrides)
    assert states == {s: "Cached" for s in ("data", "tokenizer", "import_base", "sft", "dpo", "export")}


def _qwen35_base(path: Path, moe: bool) -> tuple[Path, dict]:
    """A tiny random Qwen3.5 as released: the multimodal wrapper (Qwen3_5ForConditionalGeneration, a one-block
    vision tower, an `mtp.*` tensor beside it) with gated DeltaNet layers around a gated attention layer; `moe`: the
    text-only Qwen3_5MoeForCausalLM (4 experts top-2 plus the gated shared expert). A Qwen3 chat template.
    Returns the directory and the tensors every export must carry unchanged (vision tower, MTP)."""
    import transformers
    from safetensors.torch import load_file, save_file
    from glm_lora.data.tokenizer import load_tokenizer
    from tests.chat_templates import build_tokenizer
    build_tokenizer(path, "qwen3")
    tok = load_tokenizer(path)
    torch.manual_seed(0)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                layer_types=["linear_attention", "full_attention", "linear_attention"], max_position_embeddings=512,
                initializer_range=0.1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    if moe:
        text |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text))
    else:
        model = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(
            text_config=text, vision_config=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2,
                                                 patch_size=4, num_position_embeddings=16, out_hidden_size=64)))
    model.save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    carried = {k: v for k, v in weights.items() if k.startswith("model.visual.")}
    carried["mtp.fc.weight"] = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    save_file({**weights, **carried}, path / "model.safetensors", metadata={"format": "pt"})
    return path, carried


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_a_qwen35_base_on_user_files_runs_the_dag_exports_as_it_came_and_reruns_cached(dag, tmp_path, moe):
    """Qwen3.5 (gated DeltaNet beside gated attention; the MoE variant): a tiny random one on user files goes through
    import → LoRA SFT → DPO (every projection, the linear-attention ones included) → export. The export is the class
    it came as — the multimodal wrapper with its vision tower and MTP tensors unchanged — and loads in transformers
    with our logits; the DPO adapter loads with PEFT on that class with our logits. vLLM's CPU build cannot load
    Qwen3.5, so serving is refused before anything trains; a second run comes from cache; GRPO trains after DPO."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoModelForCausalLM
    from glm_lora.model.adapters import load_policy
    sft, dpo = _user_files(tmp_path)
    base, carried = _qwen35_base(tmp_path / "qwen35-base", moe)
    name = "qwen35moe-user" if moe else "qwen35-user"
    overrides = {**dag["overrides"], "run_name": name, "base_model": str(base), "data.sft": str(sft),
                 "data.dpo": str(dpo), "sft.max_steps": 4 if moe else 8, "dpo.max_steps": 2 if moe else 3,
                 "sft.lora.modules_to_save": [], "export.gguf": []}
    run_dir = Path(overrides["runs_dir"]) / name
    if not moe:
        from glm_lora.flows.glm_lora import glm_lora
        refused = glm_lora(config="tiny", overrides=overrides, return_state=True)
        assert refused.is_failed() and "torchvision" in refused.message
        assert not (run_dir / "sft").exists()                                    # refused before anything trained
    overrides["serve.enabled"] = False
    _, states = _run(overrides)
    assert states == {s: "Completed" for s in ("data", "tokenizer", "import_base", "sft", "dpo", "export")}
    export = run_dir / "export"
    config = json.loads((export / "merged" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForConditionalGeneration"]
    merged = load_file(export / "merged" / "model.safetensors")
    assert all(torch.equal(merged[k], v) for k, v in carried.items())           # vision tower, MTP: carried unchanged
    adapter = load_file(export / "adapters" / "dpo" / "adapter_model.safetensors")
    assert any(".linear_attn.in_proj_qkv.lora_B" in k for k in adapter) and any(".out_proj.lora_A" in k for k in adapter)
    theirs = (AutoModelForCausalLM if moe else AutoModelForImageTextToText).from_pretrained(
        export / "merged", dtype=torch.float32).eval()
    ours = load_policy(run_dir / "import_base", run_dir / "sft", run_dir / "dpo").eval()
    x = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(input_ids=x).logits - ours(x)).abs().max().item() < 1e-4
    if not moe:     # the adapter is keyed for the class the export is (the wrapper): PEFT on that class
        from peft import PeftModel
        peft = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(
            export / "sft_merged", dtype=torch.float32), export / "adapters" / "dpo").eval()
        with torch.no_grad():
            assert (peft(input_ids=x).logits - theirs(input_ids=x).logits).abs().max().item() < 1e-4
    _, states = _run(overrides)
    assert states == {s: "Cached" for s in ("data", "tokenizer", "import_base", "sft", "dpo", "export")}
    if not moe:     # GRPO: rollouts decode through each sequence's convolution window and state
        from glm_lora.configs.load import load_config
        from glm_lora.flows.cli import run_one_stage
        run_one_stage("rl", load_config("tiny", {**overrides, "rl.enabled": True, "rl.max_steps": 3, "rl.batch_size": 4,
                                                 "rl.group_size": 4, "rl.max_new_tokens": 8, "rl.families": ["all"]}))
        metrics = json.loads((run_dir / "rl" / "manifest.json").read_text())["metrics"]
        assert metrics["step"] == 3 and 0 < metrics["completion_length"] <= 8 and metrics["samples"]


def test_the_rl_stage_trains_after_dpo_is_exported_on_dpo_merged_served_and_reruns_cached(dag, tmp_path):
    """rl.enabled (a run of its own, short): GRPO trains its adapter after DPO (rewards and sampled answers in the
    UI), the export's final model holds it (merged/ = dpo_merged/ + the RL adapter, which PEFT's one-liner loads),
    vLLM serves the RL adapter on dpo_merged/ with greedy parity, and a second run comes from cache, rl included."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    overrides = {**dag["overrides"], "run_name": "with-rl", "serve.port": _free_port(), "pretrain.max_steps": 20,
                 "sft.max_steps": 20, "dpo.max_steps": 4, "rl.enabled": True, "rl.max_steps": 6, "rl.batch_size": 4,
                 "rl.group_size": 4, "rl.max_new_tokens": 8, "rl.families": ["add_en", "sub_en"],
                 "rl.rewards": ["exact_match", "format"]}
    result, states = _run(overrides)
    assert states == {s: "Completed" for s in ("data", "tokenizer", "pretrain", "sft", "dpo", "rl", "export", "gguf",
                                               "serve")}
    run_dir = Path(overrides["runs_dir"]) / "with-rl"
    rl = json.loads((run_dir / "rl" / "manifest.json").read_text())["metrics"]
    lines = [json.loads(x) for x in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert {"reward_mean", "reward_std", "kl", "completion_length", "reward_exact_match"} <= lines[-1].keys()
    assert rl["samples"] and set(rl["eval"]["per_family"]) >= {"add_en", "sub_en"}
    exported = json.loads((run_dir / "export" / "manifest.json").read_text())["metrics"]
    assert set(exported["adapters"]) == {"sft", "dpo", "rl"} and set(exported["eval"]) == {"pretrain", "sft", "dpo", "rl"}
    assert (run_dir / "export" / "dpo_merged" / "config.json").is_file()
    proc = _load_dpo_adapter(run_dir / "export", tmp_path, adapter="rl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff, base_used = proc.stdout.split("MAXDIFF")[1].split()
    assert float(diff) < 1e-4 and base_used == str((run_dir / "export" / "dpo_merged").resolve())
    served = json.loads((run_dir / "serve" / "answer.json").read_text())
    assert set(served["models"]) == {"with-rl", "with-rl-rl", "with-rl-dpo"}
    assert result["matches_inprocess"] is True
    with get_client(sync_client=True) as client:
        found = {a.key for a in client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
            like_="with-rl-rl-")))}
    assert {"with-rl-rl-rollouts", "with-rl-rl-rewards", "with-rl-rl-metrics", "with-rl-rl-families"} <= found
    _, states = _run({**overrides, "serve.enabled": False})
    assert states == {s: "Cached" for s in ("data", "tokenizer", "pretrain", "sft", "dpo", "rl", "export", "gguf")}


def test_orpo_raises_its_own_held_out_preference_measure_on_a_model_that_does_not_yet_separate(dag, tmp_path):
    """dpo.loss orpo (λ 0.5, 100 steps) on this DAG's short SFT model, whose likelihoods barely separate chosen from
    rejected (held-out likelihood ranking ≈ 0.6): ORPO's own measure on the 200 held-out pairs, the mean log odds
    ratio of chosen over rejected, rises (measured 0.24 → 0.31), and the likelihood ranking gets no clearly worse.
    (On the default's strong SFT model, ranking 0.99 already, ORPO's odds term is saturated and moves nothing: the
    other losses are checked there, tests/test_quality.py.)"""
    from glm_lora.configs.load import load_config
    from glm_lora.engine import dpo
    from glm_lora.evaluation.metrics import preference_metrics
    from glm_lora.data import formats
    from glm_lora.data.prepare import split_path
    from glm_lora.data.tokenizer import load_tokenizer
    from glm_lora.model.adapters import load_policy

    run_dir = dag["run_dir"]
    cfg = load_config("tiny", {**dag["overrides"], "dpo.loss": "orpo", "dpo.orpo_lambda": 0.5, "dpo.max_steps": 100,
                               "dpo.eval_every": 0, "eval.enabled": False, "runs_dir": str(tmp_path / "runs")})
    base, sft = run_dir / "pretrain", run_dir / "sft"
    dpo.run(cfg, {"base": base, "sft": sft, "tokenizer": run_dir / "tokenizer", "data": run_dir / "data"}, tmp_path)
    tok, pairs = load_tokenizer(run_dir / "tokenizer"), list(formats.read_dpo(split_path(run_dir / "data", "dpo_eval")))
    assert len(pairs) == 200
    before = preference_metrics(load_policy(base, sft).eval(), tok, pairs, seq_len=cfg.dpo.seq_len, beta=cfg.dpo.beta)
    after = preference_metrics(load_policy(base, sft, tmp_path).eval(), tok, pairs, seq_len=cfg.dpo.seq_len,
                               beta=cfg.dpo.beta)
    assert after["log_odds_ratio"] >= before["log_odds_ratio"] + 0.02, (after, before)
    assert after["logprob_accuracy"] >= before["logprob_accuracy"] - 0.05, (after, before)


def test_the_dag_on_two_processes_completes_and_a_failing_rank_fails_its_stage(dag, monkeypatch):
    """dist.nproc_per_node: 2 — every training stage runs under torchrun (gloo on the CPU); the
    artifacts are the single-process ones. A rank that raises fails the stage with its own message:
    a user error is not retried, anything else is (and resumes from the stage's checkpoint)."""
    overrides = {**dag["overrides"], "run_name": "two-ranks", "serve.enabled": False, "dist.nproc_per_node": 2,
                 "pretrain.max_steps": 20, "sft.max_steps": 8, "dpo.max_steps": 4,
                 # rl too, each rank's rollout trained in two parts (DDP: gradients reduced on the last part only)
                 "rl.enabled": True, "rl.max_steps": 2, "rl.batch_size": 2, "rl.group_size": 4,
                 "rl.max_new_tokens": 6, "rl.train_chunks": 2, "rl.log_every": 1}
    result, states = _run(overrides)
    assert states == {s: "Completed" for s in ("data", "tokenizer", "pretrain", "sft", "dpo", "rl", "export", "gguf")}
    run_dir = Path(overrides["runs_dir"]) / "two-ranks"
    for stage in ("pretrain", "sft", "dpo", "rl"):
        metrics = json.loads((run_dir / stage / "manifest.json").read_text())["metrics"]
        assert metrics["world_size"] == 2 and metrics["strategy"] == ("fsdp2" if stage == "pretrain" else "ddp")
    rl = json.loads((run_dir / "rl" / "manifest.json").read_text())["metrics"]
    assert rl["grad_accum"] == 2 and rl["global_batch_size"] == 2 * 2     # micro-batches = parts; prompts × ranks
    assert [json.loads(x)["step"] for x in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    exported = json.loads((run_dir / "export" / "manifest.json").read_text())["metrics"]
    assert set(exported["adapters"]) == {"sft", "dpo", "rl"}
    assert (run_dir / "export" / "merged" / "model.safetensors").is_file()

    from glm_lora.flows.glm_lora import glm_lora
    monkeypatch.setenv("GLM_LORA_TEST_FAIL", "1:2:user")      # rank 1 stops on a user error at step 2
    state = glm_lora(config="tiny", overrides={**overrides, "sft.max_steps": 9}, return_state=True)
    assert state.is_failed() and state.name == "StageFailed"
    assert state.message.startswith("sft: rank 1: injected failure on rank 1 at step 2"), state.message
    assert _task_states(state.state_details.flow_run_id)["sft"] == "RankUserError"
