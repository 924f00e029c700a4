"""LoRA on the decoder's linear layers: inject, disable (for DPO's reference), merge, save.

Parameter names mirror PEFT (`<path>.lora_A.weight`, `<path>.lora_B.weight`) so the export to a
PEFT adapter is a prefix change only. Targets are the last name parts of the model's linear layers
(`q_proj`, …, `gate_up_proj` in GLM layouts), or "all-linear" (PEFT's term): every linear projection
of the layout, the output head excepted. `modules_to_save` (PEFT's name) are trained in full beside
the adapter and saved with it as `<path>.weight` (e.g. embed_tokens, lm_head).

QLoRA (`quantization="nf4"`): each wrapped layer keeps its frozen base weight in 4 bits (model/quant.py)
instead of as a parameter; it is rebuilt for each use (forward, backward, the adapter switched off, merge).
It is neither a parameter nor a buffer, so it is in no state dict, checkpoint or DDP broadcast: the
adapter is all that is saved, and the 4-bit base is made again from the base weights wherever it is needed.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import torch
import torch.nn as nn

import kernels
from configs.errors import UserError
from configs.schema import ALL_LINEAR, LoRAConfig     # "all-linear": PEFT's term for every linear projection
from kernels.reference import NF4_BLOCK
from model.quant import NF4Weight, quantize_nf4


class LoRAConfigError(UserError, ValueError):
    """LoRA settings that don't fit the model (e.g. target modules a base model doesn't have)."""


class LoRALinear(nn.Module):
    """A frozen base linear plus a trainable low-rank update: y = x Wᵀ + b + (α/r)·x Aᵀ Bᵀ (b, if any: frozen).

    With quantization "nf4" W is held as `self.nf4` (4 bits a weight) and `self.weight` is None."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, quantization: str = "none"):
        super().__init__()
        device, dtype = base.weight.device, base.weight.dtype
        self.nf4: NF4Weight | None = quantize_nf4(base.weight) if quantization == "nf4" else None
        self.weight = None if self.nf4 is not None else base.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.alpha, self.dropout = r, alpha, dropout
        self.scale = alpha / r
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))   # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)                             # starts as the identity update
        self.enabled = True

    def _apply(self, fn, recurse=True):
        """.to()/.cuda()/.half()… reach the 4-bit base too (it is no parameter or buffer): it moves to the device
        and takes the dtype `fn` would give the weight it was made from; its own tensors keep their dtypes."""
        super()._apply(fn, recurse)
        if self.nf4 is not None:
            probe = fn(torch.empty(0, dtype=self.nf4.dtype, device=self.nf4.device))
            self.nf4 = replace(self.nf4.to(probe.device), dtype=probe.dtype)
        return self

    def base_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W (out, in): the parameter, or the 4-bit base dequantised (into `dtype`, default its own)."""
        return self.weight if self.nf4 is None else self.nf4.dequantize(dtype)

    def forward(self, x):
        if not self.enabled:
            dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
            return nn.functional.linear(x, self.base_weight(dtype), self.bias)
        if self.nf4 is None:
            y = kernels.lora_linear(x, self.weight, self.lora_A.weight, self.lora_B.weight,
                                    self.scale, self.dropout, self.training)
        else:
            y = kernels.nf4_lora_linear(x, self.nf4, self.lora_A.weight, self.lora_B.weight,
                                        self.scale, self.dropout, self.training)
        return y if self.bias is None else y + self.bias

    def merged_weight(self) -> torch.Tensor:
        """W + (α/r)·B A in W's dtype; with nf4, W is the dequantised base (what the adapter was trained on)."""
        delta = self.lora_B.weight.float() @ self.lora_A.weight.float()
        dtype = self.weight.dtype if self.nf4 is None else self.nf4.dtype
        return (self.base_weight(torch.float32).float() + self.scale * delta).to(dtype)


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.endswith("lm_head")
            and not n.endswith((".lora_A", ".lora_B"))]


def saved_modules(model: nn.Module, modules_to_save) -> dict[str, nn.Module]:
    """path → module for every module whose last name part is in `modules_to_save`."""
    found = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in modules_to_save}
    missing = set(modules_to_save) - {n.rsplit(".", 1)[-1] for n in found}
    if missing:
        raise LoRAConfigError(f"lora.modules_to_save {sorted(missing)} not found in the model")
    return found


def resolve_targets(model: nn.Module, target_modules: list[str] | str) -> list[str]:
    """The projection names `target_modules` means for this model ("all-linear": all of them); names the
    model's layout lacks (e.g. gate_proj in GLM, whose MLP has one gate_up_proj) are refused."""
    available = sorted({n.rsplit(".", 1)[-1] for n in linear_names(model)})
    if target_modules == ALL_LINEAR:
        return available
    unknown = [t for t in target_modules if t not in available]
    if unknown:
        arch = getattr(getattr(model, "config", None), "arch", None)
        layout = f" ({arch} layout)" if isinstance(arch, str) else ""
        raise LoRAConfigError(f"lora.target_modules {unknown} not found in the model{layout}; "
                              f"supported: {available} or {ALL_LINEAR!r}")
    return list(target_modules)


def layout_projections(cfg) -> list[str]:
    """The linear projections (LoRA targets) a DecoderConfig's layout has, without building the model."""
    mlp = ["gate_up_proj"] if cfg.layout.fused_gate_up else ["gate_proj", "up_proj"]
    return sorted(["q_proj", "k_proj", "v_proj", "o_proj", "down_proj", *mlp])


def check_targets(cfg, target_modules: list[str] | str, key: str = "lora.target_modules") -> None:
    """Before any training (engine/preflight.py): refuse target names the layout of `cfg` (a DecoderConfig,
    e.g. model.hf.read_hf_config(base_model)) lacks, naming `key` and the supported set."""
    if target_modules == ALL_LINEAR:
        return
    supported = layout_projections(cfg)
    unknown = [t for t in target_modules if t not in supported]
    if unknown:
        raise LoRAConfigError(f"{key} {unknown} not found in the model ({cfg.arch} layout); "
                              f"supported: {supported} or {ALL_LINEAR!r}")


def target_names(model: nn.Module, target_modules: list[str] | str) -> list[str]:
    """The paths of the linear layers `target_modules` wraps in `model`."""
    targets = resolve_targets(model, target_modules)
    return [n for n in linear_names(model) if n.rsplit(".", 1)[-1] in targets]


def inject_lora(model: nn.Module, lora: LoRAConfig) -> list[str]:
    """Freeze `model`, wrap every linear whose last name part is in `lora.target_modules` (or every one:
    "all-linear"), and make the weights of `lora.modules_to_save` trainable. quantization "nf4": the wrapped
    layers' base weights are replaced by their 4-bit form (QLoRA; the full-precision ones are freed).
    Returns the wrapped layers' paths."""
    names = target_names(model, lora.target_modules)
    if lora.quantization == "nf4":
        check_nf4_blocks(model, names)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, LoRALinear(getattr(parent, attr), lora.r, lora.alpha, lora.dropout, lora.quantization))
    for m in saved_modules(model, lora.modules_to_save).values():
        m.weight.requires_grad_(True)
    return names


def check_nf4_blocks(model: nn.Module, names: list[str], key: str = "lora.quantization") -> None:
    """NF4 scales whole blocks of 64 weights. bitsandbytes gives a partial last block a scale of its own; we
    refuse it rather than carry that case through the kernels (no supported layout has one). `model` may
    live on the meta device (engine/preflight.py checks before any training)."""
    bad = [f"{n} ({m.out_features}×{m.in_features})" for n in names
           if (m := model.get_submodule(n)).weight.numel() % NF4_BLOCK]
    if bad:
        raise LoRAConfigError(f"{key} nf4 needs in_features × out_features to be a multiple of {NF4_BLOCK} "
                              f"in every target layer; not in {', '.join(bad[:4])}. Leave those layers out of "
                              "lora.target_modules or set lora.quantization: none")


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextlib.contextmanager
def lora_disabled(model: nn.Module):
    """Run the frozen base weights only: DPO's reference model without a second copy."""
    mods = list(lora_modules(model).values())
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m in mods:
            m.enabled = True


def _adapter_tensors(model: nn.Module, modules_to_save) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in lora_modules(model).items():
        out[f"{name}.lora_A.weight"] = m.lora_A.weight
        out[f"{name}.lora_B.weight"] = m.lora_B.weight
    for name, m in saved_modules(model, modules_to_save).items():
        out[f"{name}.weight"] = m.weight
    return out


def lora_state_dict(model: nn.Module, modules_to_save=()) -> dict[str, torch.Tensor]:
    """Adapter weights, keyed `<module path>.lora_A.weight` / `.lora_B.weight`, plus
    `<module path>.weight` of each module to save."""
    return {k: v.detach().cpu().contiguous() for k, v in _adapter_tensors(model, modules_to_save).items()}


def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor], modules_to_save=()) -> None:
    params = _adapter_tensors(model, modules_to_save)
    if set(state) != set(params):
        missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise ValueError(f"adapter does not match the model's LoRA layers: missing {missing[:4]}, unexpected {extra[:4]}")
    for key, p in params.items():
        if state[key].shape != p.shape:
            raise ValueError(f"adapter weight {key}: shape {tuple(state[key].shape)} != the model's {tuple(p.shape)}")
        p.data.copy_(state[key])


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put plain nn.Linear layers back."""
    for name, m in lora_modules(model).items():
        parent_name, attr = name.rsplit(".", 1)
        weight = m.merged_weight()
        merged = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=weight.device,
                           dtype=weight.dtype)
        merged.weight = nn.Parameter(weight, requires_grad=False)
        if m.bias is not None:
            merged.bias = m.bias                            # LoRA leaves the bias as it was
        setattr(model.get_submodule(parent_name), attr, merged)
    return model
