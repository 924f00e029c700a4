"""Standard benchmarks with lm-evaluation-harness (the `lm_eval` package, the `harness` extra).

The stage `harness` (after export) scores export/merged in-process with lm_eval's `hf` model, and export/base
(eval.harness.base: the promotion gate's reference while no served model has a score); `glm-lora harness --url`
scores a served endpoint through lm_eval's `local-chat-completions` model.

Tasks are looked up in the shipped folder (harness_tasks/: glm_lora_arithmetic and glm_lora_strings, the synthetic
data's held-out families scored like evaluation/metrics.py, over the run's data/sft_eval.jsonl), then in the user's
eval.harness.include_path folders, and only for a name found in neither, among lm_eval's own ~14,000 task files
(indexing those takes ~15 s on 2 cores). Nothing is downloaded: Hugging Face's offline mode is on (unless the
environment says otherwise), so a built-in task runs only from the local datasets cache; preflight loads every
task, so a missing dataset stops the run before training, as an unknown name does.

Scores per task (and group): each metric lm_eval reports, named `metric` (filter "none") or `metric,filter`, with
its `_stderr`; `n` (samples scored); `metric`, `score`, `stderr` and `higher_is_better`: the task's first metric,
its value, standard error and direction, what serve.gate.harness compares.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Iterator

import torch

from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import Config, HarnessConfig
from glm_lora.data.prepare import split_path

TASKS_DIR = Path(__file__).resolve().with_name("harness_tasks")
SHIPPED = ("glm_lora_arithmetic", "glm_lora_strings")   # over the synthetic held-out rows (metadata glm_lora_data)
TABLE, SAMPLES = "harness.md", "samples.jsonl"
log = logging.getLogger("glm_lora.harness")


def _lm_eval():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")          # datasets follows it (its HF_DATASETS_OFFLINE too)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import lm_eval
    except ImportError:
        raise UserError("eval.harness needs lm-evaluation-harness: pip install 'glm-lora[harness]' "
                        "(lm-eval[api])") from None
    return lm_eval


def _index(include: list[Path], *, defaults: bool = False, metadata: dict | None = None):
    _lm_eval()
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=[str(TASKS_DIR), *map(str, include)], include_defaults=defaults, metadata=metadata)


def task_manager(include: list[Path], names: list[str], metadata: dict | None = None):
    """lm_eval's TaskManager over our folders, with its built-in tasks only if a name is not found there."""
    tm = _index(include, metadata=metadata)
    return tm if set(names) <= set(tm.all_tasks) else _index(include, defaults=True, metadata=metadata)


def _named_in_builtin_files(names: list[str]) -> set[str]:
    """Those of `names` that occur at all in lm_eval's own task files: reading them takes ~2 s, lm_eval's index of
    them ~15 s, so a typo is refused at once and the index is built only for a name that may be there."""
    if not names:
        return set()
    import lm_eval.tasks
    left, found = set(names), set()
    for path in Path(lm_eval.tasks.__file__).parent.rglob("*.yaml"):
        text = path.read_text(encoding="utf-8", errors="ignore")
        found |= {n for n in left if n in text}
        left -= found
        if not left:
            break
    return found


def check(hc: HarnessConfig, *, synthetic: bool) -> None:
    """Before any training: include_path folders exist, every task name is known and its data loads (offline); the
    shipped tasks only where their rows exist (synthetic SFT data). Raises a UserError naming the key."""
    if not hc.tasks:
        return
    for p in hc.include_path:
        if not Path(p).is_dir():
            raise UserError(f"eval.harness.include_path: {p} is not a directory (a folder of lm_eval task YAML files)")
    tm = ours = _index(hc.include_path)
    missing = [t for t in hc.tasks if t not in ours.all_tasks]
    named = _named_in_builtin_files(missing)
    unknown = [t for t in missing if t not in named]
    if missing and not unknown:
        tm = _index(hc.include_path, defaults=True)
        unknown = [t for t in missing if t not in tm.all_tasks]
    if unknown:
        where = ", ".join(str(p) for p in [TASKS_DIR, *hc.include_path])
        raise UserError(f"eval.harness.tasks: unknown lm-evaluation-harness task {', '.join(unknown)}; tasks in "
                        f"{where}: {', '.join(ours.all_tasks)}; or one of lm_eval's built-in tasks "
                        "(`lm-eval ls tasks`)")
    shipped = [t for t in hc.tasks if t in SHIPPED]
    if shipped and not synthetic:
        raise UserError(f"eval.harness.tasks: {', '.join(shipped)} score the synthetic data's held-out task families, "
                        "and data.sft is your own file: name your own tasks (eval.harness.include_path)")
    for name in hc.tasks:
        try:
            tm.load([name])
        except Exception as e:     # noqa: BLE001 - whatever a task's loader raises, the task cannot run here
            raise UserError(f"eval.harness.tasks: task {name} does not load here (nothing is downloaded: its data "
                            f"must be local): {type(e).__name__}: {' '.join(str(e).split())[:300]}") from None


def evaluate(model: str, model_args: dict, hc: HarnessConfig, *, device: str | None = None,
             metadata: dict | None = None) -> dict:
    """lm_eval's simple_evaluate of `model` on hc's tasks with hc's settings; its results dict."""
    return _lm_eval().simple_evaluate(
        model=model, model_args=model_args, tasks=list(hc.tasks),
        task_manager=task_manager(hc.include_path, hc.tasks, metadata),
        limit=hc.limit, num_fewshot=hc.num_fewshot, batch_size=hc.batch_size, device=device,
        apply_chat_template=hc.chat_template, log_samples=True, bootstrap_iters=1000)


def scores(results: dict) -> dict[str, dict]:
    """lm_eval's results → {task: {metric: value, metric_stderr: value, "n": samples, "metric": the first metric,
    "score": its value, "stderr": its standard error, "higher_is_better": its direction}} (module docstring)."""
    out = {}
    for task, row in results["results"].items():
        metrics = {}
        for key, value in row.items():
            if "," in key and isinstance(value, (int, float)) and not isinstance(value, bool):
                metric, filt = key.split(",", 1)
                metrics[metric if filt == "none" else key] = float(value)
        first = next((k for k in metrics if "_stderr" not in k), None)
        name, _, filt = (first or "").partition(",")
        n = results.get("n-samples", {}).get(task, {}).get("effective")
        better = results.get("higher_is_better", {}).get(task, {}).get(name, True)
        out[task] = {**metrics, "n": n, "metric": first, "score": metrics.get(first), "higher_is_better": better,
                     "stderr": metrics.get(f"{name}_stderr" + (f",{filt}" if filt else ""))}
    return out


def table(model: dict[str, dict], base: dict[str, dict] | None = None) -> str:
    """Markdown: task, metric, the model's score ± stderr, the base model's (when given), samples."""
    rows = ["| task | metric | score |" + (" base |" if base else "") + " n |",
            "|---|---|---|" + ("---|" if base else "") + "---|"]
    for task, s in model.items():
        err = s.get("stderr")
        cells = [task, s["metric"], _num(s["score"]) + (f" ± {err:.3g}" if err else ""),
                 *([_num(base.get(task, {}).get("score"))] if base else []), "—" if s["n"] is None else str(s["n"])]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else "missing"


def _samples(results: dict) -> Iterator[dict]:
    for task, rows in results.get("samples", {}).items():
        for r in rows:
            yield {"task": task, "doc_id": r.get("doc_id"), "target": r.get("target"),
                   "response": r.get("filtered_resps"), **{m: r.get(m) for m in r.get("metrics", ())}}


def dump(obj, indent: int | None = 2) -> str:
    """JSON of lm_eval's output (numpy numbers and sets in it become plain JSON)."""
    from lm_eval.utils import handle_non_serializable
    return json.dumps(obj, indent=indent, ensure_ascii=False, default=handle_non_serializable)


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    """The harness stage (tasks/table.py): every eval.harness task on export/merged, and on export/base when
    eval.harness.base; lm_eval's results (results-<model>.json), each sample of merged/ (samples.jsonl), harness.md."""
    hc, out_dir = cfg.eval.harness, Path(out_dir)
    device = "cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu"
    metadata = {"glm_lora_data": str(split_path(inputs["data"], "sft_eval"))}    # the shipped tasks' rows
    metrics: dict = {"tasks": hc.tasks, "limit": hc.limit}
    t0 = time.perf_counter()
    for key, sub in {"harness": "merged", **({"base": "base"} if hc.base else {})}.items():
        model_dir = Path(inputs["export"]) / sub
        results = evaluate("hf", {"pretrained": str(model_dir), "dtype": "auto"}, hc, device=device, metadata=metadata)
        metrics[key] = scores(results)
        (out_dir / f"results-{sub}.json").write_text(dump({k: v for k, v in results.items() if k != "samples"}))
        if key == "harness":
            (out_dir / SAMPLES).write_text("".join(dump(s, indent=None) + "\n" for s in _samples(results)))
        log.info("lm-evaluation-harness on %s:\n%s", model_dir, table(metrics[key]))
    metrics["seconds"] = round(time.perf_counter() - t0, 1)
    (out_dir / TABLE).write_text(table(metrics["harness"], metrics.get("base")))
    return metrics


@contextlib.contextmanager
def _api_key(key: str | None):
    """lm_eval's OpenAI-style models read the key from OPENAI_API_KEY (never from their arguments, which it writes
    into its results): set only for the call."""
    if not key:
        yield
        return
    before = os.environ.get("OPENAI_API_KEY")
    os.environ["OPENAI_API_KEY"] = key
    try:
        yield
    finally:
        if before is None:
            del os.environ["OPENAI_API_KEY"]
        else:
            os.environ["OPENAI_API_KEY"] = before


def endpoint(url: str, model: str, hc: HarnessConfig, *, key: str | None = None, data: Path | None = None,
             concurrency: int = 4) -> dict:
    """lm_eval through a served OpenAI-compatible endpoint (`url`: http://host:port or …/v1), chat completions;
    its results dict. `data`: the rows the shipped tasks read (default: the copy shipped beside them)."""
    check(hc, synthetic=True)
    base = url.rstrip("/").removesuffix("/chat/completions")
    args = {"model": model, "base_url": (base if base.endswith("/v1") else base + "/v1") + "/chat/completions",
            "num_concurrent": concurrency, "max_retries": 1, "tokenizer_backend": None, "tokenized_requests": False}
    with _api_key(key):
        return evaluate("local-chat-completions", args, hc, metadata={"glm_lora_data": str(data)} if data else None)
