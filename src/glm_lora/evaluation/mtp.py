"""Draft acceptance of a model's multi-token prediction (MTP) layer on held-out rows, teacher-forced.

`mtp_acceptance`: the share of held-out positions t at which the MTP layer's greedy draft (argmax of its logits at
slot t, from the model's hidden state h_t and token t+1) is the model's own greedy next token there (argmax of its
logits at position t+1): how often vLLM's MTP speculative decoding would keep its first draft token. Positions are
those the stage's loss counts, shifted (model/mtp.py `target_mask`): assistant tokens t+2 on SFT rows, every token
on pretraining text. With the row's own tokens in place of the model's samples, which is what a teacher-forced
measurement can do. The tokens and rows are those of the other held-out metrics (evaluation/metrics.py).
"""
from __future__ import annotations

import torch.nn.functional as F

from glm_lora.data.packing import PackedBatches, to_device
from glm_lora.evaluation.decode import evaluating, model_device
from glm_lora.evaluation.metrics import _Examples
from glm_lora.model import mtp
from glm_lora.model.heads import final_hidden


def acceptance(model, examples: list[tuple[list[int], list[int]]], *, seq_len: int, batch_rows: int = 8) -> dict:
    """{"mtp_acceptance": share of counted positions whose MTP draft equals the model's greedy token,
    "mtp_positions": how many were counted} over (ids, labels) examples packed into rows of seq_len."""
    source, device = _Examples(examples), model_device(model)
    hits, count = 0, 0
    with evaluating(model), mtp.using_layer(model) as layer:
        head = mtp.head_weight(model, layer)
        for batch in PackedBatches(source, iter(range(len(source))), rows=batch_rows, seq_len=seq_len):
            batch = to_device(batch, device)
            hidden = final_hidden(model, batch)                                   # (B, T, C)
            keep = mtp.target_mask(batch)                                          # (B, T-2): slot t → token t+2
            draft = F.linear(mtp.states(model, layer, hidden, batch)[:, :-1][keep], head).argmax(-1)
            greedy = model.lm_head(hidden[:, 1:-1][keep]).argmax(-1)            # the model's own token t+2
            hits += int((draft == greedy).sum())
            count += int(keep.sum())
    return {"mtp_acceptance": hits / max(count, 1), "mtp_positions": count}

