"""A model card (README.md with the Hugging Face metadata header) for every exported directory.

The header is what the Hub and tools read (base_model, library_name, tags, datasets, metrics);
the body says how to load the directory with transformers, peft and vLLM, and lists the held-out
metrics with the data they came from. Written with huggingface_hub's own ModelCard classes.
"""
from __future__ import annotations

from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

TAGS = ["glm-lora", "text-generation"]


def _metric_rows(metrics: dict) -> str:
    rows = []
    for stage, m in metrics.items():
        data = m.get("data", {})
        source = "; ".join(f"{split}: {d.get('source')} ({d.get('rows')} rows)" for split, d in data.items())
        for key, value in m.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append(f"| {stage} | {key} | {value:.4g} | {source} |")
    return "\n".join(["| stage | metric | value | held-out data |", "|---|---|---|---|", *rows]) if rows else ""


def _metric_names(metrics: dict) -> list[str]:
    names = {k for m in metrics.values() for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return sorted(names)


def write_model_card(out_dir: Path, *, title: str, what: str, base_model: str | None, adapter: bool,
                     architecture: str, run_name: str, metrics: dict, datasets: list[str],
                     served_as: str | None = None) -> None:
    """`base_model`: the path of this directory's base (adapters, merged models), or None.
    `served_as`: how the glm-lora server (serve/deploy.py) serves this directory, if it does."""
    data = ModelCardData(base_model=base_model, library_name="peft" if adapter else "transformers",
                         tags=TAGS + (["lora", "peft"] if adapter else [architecture]),
                         datasets=datasets or None, metrics=_metric_names(metrics) or None,
                         pipeline_tag="text-generation")
    here = Path(out_dir).name
    if adapter:
        load = f"""```python
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer

model = AutoPeftModelForCausalLM.from_pretrained("path/to/{here}")   # its base: base_model_name_or_path
tokenizer = AutoTokenizer.from_pretrained(model.peft_config["default"].base_model_name_or_path)
```

adapter_config.json names the base by absolute path, where glm-lora published this export. A copy of the export
elsewhere: `glm-lora relocate <the copied export directory>` points it at the copy's own base first.

vLLM: `vllm serve <base_dir> --enable-lora --lora-modules {run_name}-{here}=<absolute path of this directory>
--max-lora-rank <r or more>`; for GLM-4-0414 (Glm4ForCausalLM) pass the `-vllm` sibling of an adapter
directory instead (its fused `gate_up_proj` LoRA split into `gate_proj`/`up_proj`, the form vLLM's native
GLM-4 takes). vLLM refuses an adapter that also trains `embed_tokens`/`lm_head` (`modules_to_save`):
serve the merged model then."""
    else:
        load = f"""```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{here}")
tokenizer = AutoTokenizer.from_pretrained("{here}")   # the chat template is in chat_template.jinja
```

vLLM: `vllm serve {here} --served-model-name {run_name}`."""
    if served_as:
        load += f"\n\nServed by glm-lora (`serve.port`, README \"Serving\"): {served_as}."
    body = f"""---
{data.to_yaml()}
---

# {title}

{what} ({architecture}), exported by glm-lora run `{run_name}`.
{f"Base model: `{base_model}` (in this export)." if base_model else ""}

## Load it

{load}

## Held-out metrics

{_metric_rows(metrics) or "No held-out evaluation was run."}
"""
    ModelCard(body).save(Path(out_dir) / "README.md")
