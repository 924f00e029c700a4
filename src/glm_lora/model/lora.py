"""LoRA on the decoder's linear layers: inject, disable (for DPO's reference), merge, save.

Parameter names mirror PEFT (`<path>.lora_A.weight`, `<path>.lora_B.weight`) so the export to a
PEFT adapter is a prefix change only. A target names the end of a projection's path, as PEFT matches
target_modules: `q_proj`, …, `gate_up_proj` in GLM layouts, or a longer end such as
`shared_experts.gate_proj`; "all-linear" (PEFT's term) is every projection of the layout, the output head
excepted. `modules_to_save` (PEFT's name) are trained in full beside the adapter and saved with it as
`<path>.weight` (e.g. embed_tokens, lm_head, or GLM-4.5's router `gate`).

Mixture of experts (glm4_moe): the routed experts' projections are `<layer>.mlp.experts.gate_proj` / `up_proj`
/ `down_proj` (one per expert in PEFT's and vLLM's view, stacked here), so `gate_proj` reaches the dense
MLPs, the shared expert and every routed expert, `shared_experts.gate_proj` the shared expert only and
`experts.gate_proj` the routed ones only. LoRAExperts holds one LoRA per expert, stacked on the expert dim
(`<layer>.mlp.experts.gate_proj.lora_A.weight` (E, r, in)); the frozen experts move to `.base_layer` (PEFT's
name for a wrapped layer). The router (`mlp.gate`) stays frozen unless `modules_to_save` names `gate`.

QLoRA (`quantization="nf4"`): each wrapped linear layer keeps its frozen base weight in 4 bits (model/quant.py
NF4Params, `<path>.nf4_base`); it is rebuilt for each use (forward, backward, the adapter switched off, merge). Every
routed-experts stack goes to 4 bits too (dequantised for the grouped GEMM: kernels/triton_grouped_mm.py). The
4-bit arrays are frozen integer parameters: FSDP2 shards and gathers them like any frozen weight; checkpoints
(trainable tensors only) hold the adapter alone, and the 4-bit base is made again from the base weights wherever it
is needed.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn

from glm_lora.kernels import ops as kernels
from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import ALL_LINEAR, INDEXER_PROJECTIONS, LoRAConfig   # ALL_LINEAR: PEFT's "all-linear"
from glm_lora.kernels.moe import ExpertLoRA
from glm_lora.kernels.reference import NF4_BLOCK
from glm_lora.model.hf import Placement
from glm_lora.model.model import MLP, Attention, Decoder, DecoderConfig, Experts, Indexer, LatentAttention, shapes_only
from glm_lora.model.quant import NF4Params, NF4Weight


class LoRAConfigError(UserError, ValueError):
    """LoRA settings that don't fit the model (e.g. target modules a base model doesn't have)."""


def adapter_dtype(base: torch.dtype) -> torch.dtype:
    """The adapter's dtype over a base weight of dtype `base`: fp32 over a half-precision one (a LoRA stage may hold
    its frozen base in the compute dtype from the moment it is loaded: `base_placement`), else the base's."""
    return torch.float32 if base in (torch.bfloat16, torch.float16) else base


class LoRALinear(nn.Module):
    """A frozen base linear plus a trainable low-rank update: y = x Wᵀ + b + (α/r)·x Aᵀ Bᵀ (b, if any: frozen).

    With quantization "nf4" W is held in 4 bits (`self.nf4_base`, read through `self.nf4`) and `self.weight` is None."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, quantization: str = "none"):
        super().__init__()
        device, dtype = base.weight.device, adapter_dtype(base.weight.dtype)
        self.nf4_base = NF4Params.of(base.weight.detach()) if quantization == "nf4" else None
        self.weight = None if self.nf4_base is not None else base.weight.requires_grad_(False)
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

    @property
    def nf4(self) -> NF4Weight | None:
        """The 4-bit base weight (views of `nf4_base`'s parameters), or None."""
        return None if self.nf4_base is None else self.nf4_base.weight()

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

    @staticmethod
    def groupable(mods) -> bool:
        """Whether siblings over one input can run as one stacked op (project_group): not with another module type,
        a 4-bit base, dropout while training, scales that differ, or some adapters on and some off."""
        first = mods[0]
        if not all(type(m) is LoRALinear and m.nf4 is None and m.enabled == first.enabled for m in mods):
            return False
        return not first.enabled or all(m.scale == first.scale and not (m.training and m.dropout > 0) for m in mods)

    @staticmethod
    def project_group(x: torch.Tensor, mods) -> torch.Tensor:
        """`groupable` siblings over one input as one stacked op, their outputs side by side on the last dim
        (kernels.lora_linear_group; adapters switched off, as in DPO's reference pass: the stacked base alone)."""
        first = mods[0]
        if not first.enabled:
            return kernels.stacked_linear(x, [m.weight for m in mods], [m.bias for m in mods])
        y = kernels.lora_linear_group(x, [m.weight for m in mods], [m.lora_A.weight for m in mods],
                                      [m.lora_B.weight for m in mods], first.scale)
        return y if first.bias is None else y + torch.cat([m.bias for m in mods])

    def effective_weight(self) -> torch.Tensor:
        """W + (α/r)·B A as one differentiable tensor (W alone with the adapter off): for callers that fold the layer
        into another product (latent attention's absorbed sparse path, model.LatentAttention)."""
        w = self.base_weight()
        return w if not self.enabled else w + self.scale * (self.lora_B.weight @ self.lora_A.weight).to(w.dtype)

    def merged_weight(self) -> torch.Tensor:
        """W + (α/r)·B A in W's dtype; with nf4, W is the dequantised base (what the adapter was trained on)."""
        delta = self.lora_B.weight.float() @ self.lora_A.weight.float()
        dtype = self.weight.dtype if self.nf4 is None else self.nf4.dtype
        return (self.base_weight(torch.float32).float() + self.scale * delta).to(dtype)


class _Stacked(nn.Module):
    """One weight per expert, stacked: (E, out, in); a module so its path ends in `.weight` as PEFT's keys do."""

    def __init__(self, experts: int, out_features: int, in_features: int, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features, device=device, dtype=dtype))


class ExpertAdapter(nn.Module):
    """The LoRA factors of one projection of every routed expert: lora_A (E, r, in), lora_B (E, out, r)."""

    def __init__(self, experts: int, in_features: int, out_features: int, r: int, device, dtype):
        super().__init__()
        self.lora_A = _Stacked(experts, r, in_features, device, dtype)
        self.lora_B = _Stacked(experts, out_features, r, device, dtype)
        for a in self.lora_A.weight:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))                  # PEFT's init, expert by expert
        nn.init.zeros_(self.lora_B.weight)


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class LoRAExperts(nn.Module):
    """Frozen routed experts (`base_layer`) plus a LoRA per expert on each targeted projection (gate and up
    together). They share the experts' fused gate_up GEMM: their factors ride in it as one rank-2r LoRA whose B
    is block-diagonal ([B_gate 0; 0 B_up]), which is the two separate LoRAs PEFT and vLLM store."""

    def __init__(self, base: Experts, projections: list[str], r: int, alpha: float):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        gate_up = base.gate_up_proj                              # a parameter, or its 4-bit module (NF4Params)
        E, two_i, C = gate_up.shape
        sizes = {"gate_proj": (C, two_i // 2), "up_proj": (C, two_i // 2), "down_proj": (two_i // 2, C)}
        for p in projections:
            setattr(self, p, ExpertAdapter(E, *sizes[p], r, gate_up.device, adapter_dtype(gate_up.dtype)))
        self.r, self.alpha, self.scale, self.enabled = r, alpha, alpha / r, True

    def projections(self) -> list[str]:
        return [p for p in EXPERT_PROJECTIONS if hasattr(self, p)]

    def gate_up_lora(self) -> ExpertLoRA | None:
        if not hasattr(self, "gate_proj"):        # gate and up are targeted together (check_expert_targets)
            return None
        g, u = self.gate_proj, self.up_proj
        zeros = torch.zeros_like(g.lora_B.weight)                                            # (E, I, r)
        b = torch.cat([torch.cat([g.lora_B.weight, zeros], 2), torch.cat([zeros, u.lora_B.weight], 2)], 1)
        return ExpertLoRA(torch.cat([g.lora_A.weight, u.lora_A.weight], 1), b, self.scale)  # (E, 2r, C), (E, 2I, 2r)

    def down_lora(self) -> ExpertLoRA | None:
        d = getattr(self, "down_proj", None)
        return None if d is None else ExpertLoRA(d.lora_A.weight, d.lora_B.weight, self.scale)

    def forward(self, x, experts, weights):
        base = self.base_layer
        if not self.enabled:
            return base(x, experts, weights)
        return kernels.moe_experts(x, experts, weights, *base.operands(), self.gate_up_lora(), self.down_lora())

    def merged(self) -> Experts:
        """Plain Experts with every expert's W + (α/r)·B A folded in (W's dtype, computed in fp32); a 4-bit W is
        dequantised first (the base the adapter was trained on)."""
        base = dequantized_experts(self.base_layer)
        weights = {"gate_up_proj": base.gate_up_proj.detach().float().clone(),
                   "down_proj": base.down_proj.detach().float().clone()}
        half = weights["gate_up_proj"].shape[1] // 2
        rows = {"gate_proj": ("gate_up_proj", slice(0, half)), "up_proj": ("gate_up_proj", slice(half, None)),
                "down_proj": ("down_proj", slice(None))}
        for p in self.projections():
            adapter, (name, sl) = getattr(self, p), rows[p]
            weights[name][:, sl] += self.scale * (adapter.lora_B.weight.float() @ adapter.lora_A.weight.float())
        for name, w in weights.items():
            setattr(base, name, nn.Parameter(w.to(getattr(base, name).dtype), requires_grad=False))
        return base


def linear_names(model: nn.Module) -> list[str]:
    """Every linear layer LoRA may wrap: not an output head (lm_head, an MTP layer's own shared_head.head), and not a
    DSA indexer's (it only chooses keys, without gradients; frozen under LoRA as every peer trains GLM-5)."""
    indexers = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, Indexer))
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
            and not n.endswith(("lm_head", "shared_head.head"))
            and not n.endswith((".lora_A", ".lora_B")) and not n.startswith(indexers)]



def projection_paths(model: nn.Module) -> list[str]:
    """Every projection LoRA can wrap: the linear layers (not the output head) and each routed-experts
    module's gate_proj / up_proj / down_proj (`<layer>.mlp.experts.gate_proj`, …)."""
    experts = [f"{n}.{p}" for n, m in model.named_modules()
               if type(m) is Experts and not n.endswith(".base_layer") for p in EXPERT_PROJECTIONS]
    return linear_names(model) + experts


def _matches(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)     # PEFT's rule for target_modules


def _target_vocabulary(paths: list[str]) -> list[str]:
    """The target names a model answers to: each projection's last name, and for experts the qualified ones."""
    names = {p.rsplit(".", 1)[-1] for p in paths}
    names |= {".".join(p.rsplit(".", 2)[-2:]) for p in paths
              if p.rsplit(".", 2)[-2] in ("experts", "shared_experts", "shared_expert")}
    return sorted(names)


def saved_modules(model: nn.Module, modules_to_save) -> dict[str, nn.Module]:
    """path → module for every module whose last name part is in `modules_to_save`."""
    found = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in modules_to_save}
    missing = set(modules_to_save) - {n.rsplit(".", 1)[-1] for n in found}
    if missing:
        raise LoRAConfigError(f"lora.modules_to_save {sorted(missing)} not found in the model")
    return found


def target_names(model: nn.Module, target_modules: list[str] | str, key: str = "lora.target_modules") -> list[str]:
    """The paths of the projections `target_modules` wraps in `model` ("all-linear": all of them). A name that
    matches nothing (e.g. gate_proj in GLM, whose MLP has one gate_up_proj) is refused naming what exists."""
    paths = projection_paths(model)
    if target_modules == ALL_LINEAR:
        return paths
    unknown = [t for t in target_modules if not any(_matches(p, t) for p in paths)]
    indexer = [t for t in unknown if t.rsplit(".", 1)[-1] in INDEXER_PROJECTIONS]
    if indexer and any(isinstance(m, Indexer) for m in model.modules()):
        raise LoRAConfigError(f"{key} {indexer} names the DSA indexer, which stays frozen (it only chooses each query's "
                              f"keys, without gradients, as every GLM-5 trainer keeps it); supported: "
                              f"{_target_vocabulary(paths)} or {ALL_LINEAR!r}")
    if unknown:
        arch = getattr(getattr(model, "config", None), "arch", None)
        layout = f" ({arch} layout)" if isinstance(arch, str) else ""
        raise LoRAConfigError(f"{key} {unknown} not found in the model{layout}; "
                              f"supported: {_target_vocabulary(paths)} or {ALL_LINEAR!r}")
    return [p for p in paths if any(_matches(p, t) for t in target_modules)]


def _plan(model: nn.Module, lora: LoRAConfig, section: str = "lora") -> tuple[list[str], dict[str, list[str]]]:
    """What inject_lora wraps, checked: (linear layer paths, routed-experts path → its targeted projections)."""
    names = target_names(model, lora.target_modules, f"{section}.target_modules")
    linears = set(linear_names(model))
    linear = [n for n in names if n in linears]
    experts: dict[str, list[str]] = {}
    for n in names:
        if n not in linear:
            experts.setdefault(n.rsplit(".", 1)[0], []).append(n.rsplit(".", 1)[1])
    for path, projections in experts.items():
        if ("gate_proj" in projections) != ("up_proj" in projections):
            raise LoRAConfigError(f"{section}.target_modules reaches the routed experts' "
                                  f"{' and '.join(projections)} in {path}: name gate_proj and up_proj together (PEFT and "
                                  "vLLM store the experts' gate/up pair as one fused projection)")
    if experts and lora.dropout:
        raise LoRAConfigError(f"{section}.dropout {lora.dropout} on the routed experts is not supported (their LoRA runs "
                              f"inside the grouped expert GEMM); set {section}.dropout: 0 or leave the experts out")
    if lora.quantization == "nf4":
        check_nf4_blocks(model, linear, f"{section}.quantization")
        check_nf4_experts(model, f"{section}.quantization")
    return linear, experts


def check_lora(cfg, lora: LoRAConfig, section: str) -> None:
    """Before any training (engine/preflight.py): what inject_lora would refuse for a model of DecoderConfig
    `cfg`, refused now, naming `<section>.<key>` — built on the meta device (shapes only, no memory)."""
    with shapes_only():
        _plan(Decoder(cfg), lora, section)


def inject_lora(model: nn.Module, lora: LoRAConfig) -> list[str]:
    """Freeze `model`, wrap every projection `lora.target_modules` names (or every one: "all-linear"), and
    make the weights of `lora.modules_to_save` trainable. quantization "nf4": the wrapped linear layers' base
    weights and every routed expert (targeted or not: they are most of a mixture of experts' weights) are replaced
    by their 4-bit form (QLoRA; the full-precision ones are freed). Returns the wrapped projections' paths."""
    linear, experts = _plan(model, lora)
    for p in model.parameters():
        p.requires_grad_(False)
    if lora.quantization == "nf4":
        for m in model.modules():
            if type(m) is Experts:
                quantize_experts(m)
    for name in linear:
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, LoRALinear(getattr(parent, attr), lora.r, lora.alpha, lora.dropout, lora.quantization))
    for path, projections in experts.items():
        parent_name, attr = path.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, LoRAExperts(getattr(parent, attr), projections, lora.r, lora.alpha))
    for m in saved_modules(model, lora.modules_to_save).values():
        m.weight.requires_grad_(True)
    return linear + [f"{path}.{p}" for path, projections in experts.items() for p in projections]


def quantize_experts(experts: Experts) -> None:
    """Each stacked expert weight of `experts` replaced by its 4-bit form, expert by expert (model/quant.py)."""
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(experts, name)
        if isinstance(w, nn.Parameter):
            delattr(experts, name)
            setattr(experts, name, NF4Params.stacked(w.detach().unbind(0), w.shape[0]))


def dequantized_experts(experts: Experts) -> Experts:
    """`experts` with any 4-bit stack put back as a frozen parameter of the dtype it was made from (its own
    dequantised values: what a 4-bit base's adapter is merged into)."""
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(experts, name)
        if isinstance(w, NF4Params):
            delattr(experts, name)
            setattr(experts, name, nn.Parameter(w.dequantize(), requires_grad=False))
    return experts


def check_nf4_experts(model: nn.Module, key: str = "lora.quantization") -> None:
    """Each routed expert's weights in whole NF4 blocks (see check_nf4_blocks); `model` may live on the meta device."""
    bad = sorted({f"{tuple(w.shape[1:])}" for m in model.modules() if type(m) is Experts
                  for w in (m.gate_up_proj, m.down_proj) if math.prod(w.shape[1:]) % NF4_BLOCK})
    if bad:
        raise LoRAConfigError(f"{key} nf4 needs each routed expert's weight to hold a multiple of {NF4_BLOCK} "
                              f"weights; not {', '.join(bad)} (hidden_size × moe_intermediate_size). Set {key}: none")


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


def frozen_gemm_weights(model: nn.Module) -> list[nn.Parameter]:
    """The frozen weights of every linear layer and routed-experts stack (the GEMM operands); not the adapter,
    modules_to_save, norms or embeddings."""
    return [p for m in model.modules() if isinstance(m, (nn.Linear, LoRALinear, Experts))
            for p in (getattr(m, name, None) for name in ("weight", "gate_up_proj", "down_proj"))
            if isinstance(p, nn.Parameter) and not p.requires_grad]


def base_placement(cfg: DecoderConfig, lora: LoRAConfig, device: torch.device,
                   compute_dtype: torch.dtype | None) -> Placement:
    """How a LoRA stage holds each base weight from the moment model/hf.py `load_native` reads it, as `inject_lora` and
    `frozen_gemm_weights` decide on a shapes-only model of `cfg`: the frozen GEMM weights in `compute_dtype` (None:
    fp32, see engine/adapter_stage.py), the weights inject_lora replaces by their 4-bit form as stored (quantising them
    gives the bytes an fp32 copy would) — the routed-experts stacks among them quantised by the loader itself, expert by
    expert — and the rest (norms, embeddings, what trains) fp32."""
    with shapes_only():
        model = Decoder(cfg)
        before = dict(model.named_parameters(remove_duplicate=False))     # held: no id below is reused
        stacks = {id(m.gate_up_proj) for m in model.modules() if type(m) is Experts} | {
            id(m.down_proj) for m in model.modules() if type(m) is Experts}
        inject_lora(model, lora)
    kept = {id(p) for p in model.parameters()}
    frozen = {id(p) for p in frozen_gemm_weights(model)} if compute_dtype is not None else set()
    dtypes = {n: None if id(p) not in kept else compute_dtype if id(p) in frozen else torch.float32
              for n, p in before.items()}
    nf4 = frozenset(n for n, p in before.items() if id(p) in stacks and id(p) not in kept)
    return Placement(torch.device(device), dtypes, nf4)


def cast_frozen_gemm_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """`frozen_gemm_weights` in `dtype`; the other parameters keep theirs. Sibling LoRA linears of one input (a
    module's `siblings()`: q/k/v, gate/up) then hold their weights as row blocks of one tensor."""
    for p in frozen_gemm_weights(model):
        p.data = p.data.to(dtype)
    for m in list(model.modules()):
        if isinstance(m, (Attention, LatentAttention, MLP)) and (siblings := m.siblings()):
            share_frozen_storage(list(siblings))


def share_frozen_storage(siblings: list) -> None:
    """The siblings' frozen weights as consecutive row blocks of one tensor (values unchanged), so the stacked op
    over them (kernels.lora_linear_group, stacked_linear) takes a view instead of concatenating them at every
    call (kernels.lora_group.stack_rows). LoRALinear siblings with dense weights of one dtype only: merge_lora
    replaces every one of those weights, so no saved model holds two views of one storage (safetensors refuses
    that)."""
    if not all(type(s) is LoRALinear and s.nf4 is None for s in siblings):
        return
    weights = [s.weight for s in siblings]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return
    stacked = torch.cat([w.detach() for w in weights])
    for s, rows in zip(siblings, stacked.split([w.shape[0] for w in weights])):
        s.weight = nn.Parameter(rows, requires_grad=False)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear | LoRAExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAExperts))}


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
        for prefix, factors in ([(name, m)] if isinstance(m, LoRALinear) else
                                [(f"{name}.{p}", getattr(m, p)) for p in m.projections()]):
            out[f"{prefix}.lora_A.weight"] = factors.lora_A.weight
            out[f"{prefix}.lora_B.weight"] = factors.lora_B.weight
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
    """Fold every adapter into its base weight and put plain nn.Linear (and Experts) layers back; routed experts
    left 4-bit by QLoRA without an adapter are dequantised too."""
    for m in model.modules():
        if type(m) is Experts:
            dequantized_experts(m)
    for name, m in lora_modules(model).items():
        parent_name, attr = name.rsplit(".", 1)
        if isinstance(m, LoRAExperts):
            setattr(model.get_submodule(parent_name), attr, m.merged())
            continue
        weight = m.merged_weight()
        merged = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=weight.device,
                           dtype=weight.dtype)
        merged.weight = nn.Parameter(weight, requires_grad=False)
        if m.bias is not None:
            merged.bias = m.bias                            # LoRA leaves the bias as it was
        setattr(model.get_submodule(parent_name), attr, merged)
    return model
