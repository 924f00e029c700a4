"""GLM's multi-token prediction (MTP) layer beside our decoder: built from the checkpoint's tensors when a stage
needs to run it, trained or measured teacher-forced, and written back.

`Decoder.carried` holds the layer as the checkpoint does (`model.layers.{L}.*`, L = num_layers, HF names and dtypes)
and stays the truth on disk: a stage that only carries the layer never touches those tensors, so they reach every
export byte for byte. `attach` builds the first MTP layer (GLM checkpoints have one) as an MTPLayer
(model/model.py) at `model.mtp[str(L)]`, where LoRA reaches it like any other module (adapter keys
`mtp.{L}.<name>.lora_A.weight`); `detach` writes its weights (merged first: model/lora.py `merge_lora`) back into
`carried` in the dtypes they came in and removes the module. `using_layer` gives the attached layer, or a frozen
one built from `carried` for a measurement.

Teacher forcing (vLLM's speculative decoding, `propose`, made one pass over a row): slot t takes the main model's
final normed hidden state h_t and the embedding of token t+1, at position t (zeroed where that is 0), and the
block attends causally over the slots of its document; slot t's logits predict token t+2. A slot counts where
token t+2 is labelled (the main loss's mask, shifted) and lies in slot t's document.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from glm_lora.configs.errors import UserError
from glm_lora.data.packing import IGNORE
from glm_lora.kernels import ops as kernels
from glm_lora.model.hf import EXPERT_WEIGHTS, split_experts, stack_experts
from glm_lora.model.model import Decoder, MTPLayer, mtp_config, shapes_only

MODULE = "mtp"      # the attached layer's path: model.mtp[str(L)]


class MTPError(UserError, ValueError):
    """An MTP layer asked for where the model has none, or whose tensors don't fit the layout."""


def layer_index(model: Decoder) -> int:
    return model.config.num_layers


def _prefix(model: Decoder) -> str:
    return f"model.layers.{layer_index(model)}."


def attached(model: Decoder) -> MTPLayer | None:
    layers = getattr(model, MODULE, None)
    return None if layers is None else layers[str(layer_index(model))]


def has_mtp(model: Decoder) -> bool:
    """Whether the model has an MTP layer to run: attached, or carried from its checkpoint."""
    return attached(model) is not None or any(k.startswith(_prefix(model)) for k in model.carried)


def require_mtp(model: Decoder, key: str, source: str) -> None:
    """Refuse `<key>: train` on a model without an MTP layer; `source` says where the model's layers come from."""
    if not has_mtp(model):
        raise MTPError(f"{key}: train needs a model with an MTP (multi-token prediction) layer, and {source} gives it "
                       f"none; set {key}: carry")


def materialise(model: Decoder, fresh: bool = False) -> MTPLayer:
    """The model's first MTP layer as an MTPLayer (fp32, on the model's device) from its carried tensors; `fresh`:
    newly initialised as the decoder's own weights are (pretraining from scratch, nothing carried)."""
    cfg, prefix = model.config, _prefix(model)
    if not cfg.num_nextn_predict_layers:
        raise MTPError(f"the model's config declares no MTP layer (num_nextn_predict_layers 0, {cfg.arch})")
    own = {k: v for k, v in model.carried.items() if k.startswith(prefix)}
    kinds = dict(own_embed=f"{prefix}embed_tokens.weight" in own, own_head=f"{prefix}shared_head.head.weight" in own)
    if fresh:
        layer = MTPLayer(mtp_config(cfg), **kinds)
        layer.apply(Decoder._init_weights)
        return layer.to(model.lm_head.weight.device)
    if not own:
        raise MTPError(f"the model has no MTP tensors ({prefix}*) to build its MTP layer from")
    with shapes_only():     # no initialisation (nor random numbers drawn): every tensor comes from the checkpoint
        layer = MTPLayer(mtp_config(cfg), **kinds)
    state = {f"{prefix}{name}": stack_experts(f"{prefix}{name}", own, mtp_config(cfg), "the MTP layer")
             for name in _expert_names(layer)} | own
    state = {k.removeprefix(prefix): v for k, v in state.items()}
    missing, extra = sorted(set(layer.state_dict()) - set(state)), sorted(set(state) - set(layer.state_dict()))
    if missing or extra:
        raise MTPError(f"the MTP layer {prefix}* does not fit the {cfg.arch} layout: missing {missing[:4]}, "
                       f"unexpected {extra[:4]}")
    device = model.lm_head.weight.device
    layer.load_state_dict({k: v.to(device, torch.float32, copy=True) for k, v in state.items()}, assign=True)
    return layer


def _expert_names(layer: MTPLayer) -> list[str]:
    return list(EXPERT_WEIGHTS) if hasattr(layer.mlp, "experts") else []


def attach(model: Decoder, fresh: bool = False, like: MTPLayer | None = None) -> MTPLayer:
    """Put the MTP layer into the model at `model.mtp[str(L)]` (see `materialise`); `like`: an uninitialised layer
    shaped as that one (a sharded model is gathered into it, engine/dist.py)."""
    layer = materialise(model, fresh) if like is None else MTPLayer(
        mtp_config(model.config), hasattr(like, "embed_tokens"), hasattr(like.shared_head, "head"))
    setattr(model, MODULE, nn.ModuleDict({str(layer_index(model)): layer}))
    return layer


def same_architecture(model: Decoder) -> Decoder:
    """A new model of `model`'s architecture, its MTP layer included where one is attached (what a sharded model is
    gathered into: engine/dist.py `consolidated`)."""
    plain = Decoder(model.config)
    layer = attached(model)
    if layer is not None:
        attach(plain, like=layer)
    return plain


def store(model: Decoder) -> None:
    """Write the attached layer's weights into `model.carried` under the checkpoint's names, each in the dtype it
    was carried in (fp32 where it is new); experts per expert unless the checkpoint stacked them. LoRA must be
    merged first."""
    layer, prefix, cfg = attached(model), _prefix(model), mtp_config(model.config)
    if any(hasattr(m, "lora_A") for m in layer.modules()):
        raise ValueError("merge the MTP layer's LoRA (model/lora.py merge_lora) before storing it")
    out = {}
    for name, t in layer.state_dict().items():
        key = prefix + name
        if name in _expert_names(layer) and key not in model.carried:
            out |= split_experts(key, t.detach().cpu(), cfg)
        else:
            out[key] = t.detach().cpu()
    model.carried.update({k: v.to(model.carried[k].dtype if k in model.carried else torch.float32).contiguous()
                          for k, v in out.items()})


def detach(model: Decoder) -> None:
    """`store`, then remove the module (nothing happens without one)."""
    if attached(model) is not None:
        store(model)
        delattr(model, MODULE)


@contextlib.contextmanager
def using_layer(model: Decoder) -> Iterator[MTPLayer]:
    """The attached MTP layer, or one built from the carried tensors for the block's duration (frozen, eval mode)."""
    layer = attached(model)
    if layer is not None:
        yield layer
        return
    yield materialise(model).requires_grad_(False).eval()


def head_weight(model: Decoder, layer: MTPLayer) -> torch.Tensor:
    """The MTP logits' weight: the layer's own shared_head.head, else the model's lm_head."""
    return layer.shared_head.head.weight if hasattr(layer.shared_head, "head") else model.lm_head.weight


def states(model: Decoder, layer: MTPLayer, hidden: torch.Tensor, batch: dict) -> torch.Tensor:
    """The MTP layer's head input at slots 0..T-2 (B, T-1, C), teacher-forced: slot t from the final normed hidden
    state hidden[:, t] and token t+1, at position t, attending within its document (packed rows) as the main
    model does."""
    ids = batch["input_ids"]
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    positions = positions[:, :-1]
    docs = batch["doc_ids"][:, :-1] if batch.get("packed") else None
    prefix_docs = batch["prefix_docs"][:, :-1] if batch.get("prefix_docs") is not None else None
    cos, sin, mask = model.attention_inputs(positions, docs, prefix_docs)
    embed = layer.embed_tokens if hasattr(layer, "embed_tokens") else model.model.embed_tokens
    return layer(embed(ids[:, 1:]), hidden[:, :-1], positions, cos, sin, mask)


def target_mask(batch: dict, docs: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T-2): whether slot t has a target, token t+2 — labelled, in slot t's document, and (`docs`) in one of
    those documents (DPO: the chosen answers)."""
    keep = batch["labels"][:, 2:] != IGNORE
    doc_ids = batch.get("doc_ids")
    if doc_ids is not None:
        keep &= doc_ids[:, :-2] == doc_ids[:, 2:]
        if docs is not None:
            keep &= torch.isin(doc_ids[:, 2:], docs)
    return keep


def mtp_loss(model: Decoder, hidden: torch.Tensor, batch: dict, docs: torch.Tensor | None = None):
    """Mean cross-entropy of the attached MTP layer's slot t against token t+2 over `target_mask`, and the count.
    `hidden`: the main model's final hidden states of this batch (B, T, C), with their graph (the MTP loss's
    gradient reaches the main model through them)."""
    layer = attached(model)
    keep = target_mask(batch, docs).flatten().nonzero().squeeze(1)
    inputs = states(model, layer, hidden, batch)[:, :-1].flatten(0, 1).index_select(0, keep)
    labels = batch["labels"][:, 2:].flatten().index_select(0, keep)
    loss_sum, count = kernels.linear_cross_entropy(inputs, head_weight(model, layer), labels)
    return loss_sum / count.clamp(min=1), count


@contextlib.contextmanager
def captured_hidden(model: Decoder) -> Iterator[list[torch.Tensor]]:
    """Every `model.hidden_states` result inside the block, in order (a loss computes its own; the MTP loss reuses
    the first, the policy's forward). Wraps whatever the instance runs now (the method, or engine/compile.py's
    or FSDP2's replacement) and puts it back."""
    seen: list[torch.Tensor] = []
    inner, own = model.hidden_states, "hidden_states" in vars(model)

    def capture(*args, **kwargs):
        out = inner(*args, **kwargs)
        seen.append(out)
        return out

    model.hidden_states = capture
    try:
        yield seen
    finally:
        if own:
            model.hidden_states = inner
        else:
            del model.hidden_states
