"""The validation loss a training stage tracks every `eval_every` steps (early stopping), over its held-out split
in the data artifact; the metrics a stage reports at its end are evaluation.heldout's.
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch

from glm_lora.configs.schema import TrainConfig
from glm_lora.data.packing import PackedBatches, to_device
from glm_lora.data.pipeline import StageData, shares_prompt
from glm_lora.engine.trainer import Runtime


def validation_loss(data: StageData, kind: str, tc: TrainConfig, loss_fn, model, rt: Runtime,
                    max_rows: int) -> Callable[[], float]:
    """`validate()`: the stage's own loss over its held-out split (one packed pass), weighted by
    target tokens (LM losses) or by pairs (DPO).

    Several processes: every rank calls it (a sharded model's forward is collective). Rank r packs rows
    r, r + world_size, ...; ranks with fewer batches run their last one again at weight 0 (as many forwards
    everywhere), and the weighted sums are added up over ranks: the same value on every rank, the same
    weighted mean as one process computes (up to float rounding).
    """
    store = data.store(kind, tc, split=f"{kind}_eval")
    group = store.meta["group_size"]
    groups = min(len(store) // group, max_rows)
    d = rt.dist

    def packed(rows) -> PackedBatches:
        return PackedBatches(store, iter(rows), rows=tc.batch_size, seq_len=tc.seq_len, group_size=group,
                             share_prefix=shares_prompt(tc, group))

    @torch.no_grad()
    def validate() -> float:
        model.eval()
        total, weight = torch.zeros((), device=rt.device), torch.zeros((), device=rt.device)
        if d is None:
            batches = ((batch, 1) for batch in packed(range(groups)))
        else:
            mine = list(packed(range(d.rank, groups, d.world_size)))
            spare = mine[-1:] or list(itertools.islice(packed(range(groups)), 1))    # fewer rows than ranks
            batches = [(b, 1) for b in mine] + [(spare[0], 0)] * (d.max(len(mine)) - len(mine))
        for batch, counted in batches:
            batch = to_device(batch, rt.device)
            with rt.autocast():
                loss, m = loss_fn(model, batch)
            w = m["target_tokens"] if "target_tokens" in m else batch["group_docs"].shape[0]
            total += loss.float() * w * counted        # (× 1 is exact: one process computes what it always did)
            weight += w * counted
        if d is not None:
            total, weight = (torch.tensor(v, device=rt.device) for v in d.sum([float(total), float(weight)]))
        return float(total / weight.clamp(min=1))
    return validate


