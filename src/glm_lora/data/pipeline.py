"""From a data artifact to what a training stage consumes, behind one object.

`StageData(cfg, tokenizer_dir, data_dir, device)` knows the tokenizer, the prepared splits and the
cleaning settings; `store(kind, tc)` reads → cleans → tokenises one split once (cached, memory-mapped,
keyed by the bytes the data stage hashed), and `batches(kind, tc)` gives the resumable stream
tokens → sample → pack → prefetch that the training loop pulls from.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from glm_lora.artifacts.manifest import sha256_json
from glm_lora.configs.schema import Config, TrainConfig
from glm_lora.data import formats
from glm_lora.data.cleaning import CleanReport, check_drop_fraction, clean_conversations, clean_kto, clean_pairs, clean_texts
from glm_lora.data.formats import DataError
from glm_lora.data.heldout_split import without
from glm_lora.data.packing import PackedBatches, padded_batches
from glm_lora.data.prefetch import Prefetcher
from glm_lora.data.prepare import held_out_ids, split_source, unchanged_rows
from glm_lora.data.sampler import EpochSampler
from glm_lora.data.token_store import TokenStore
from glm_lora.data.encode import dpo_examples, kto_examples, tokenized
from glm_lora.data.parallel_encode import encoded
from glm_lora.data.tokenizer import load_tokenizer

log = logging.getLogger("glm_lora.data")
READERS = {"pretrain": formats.read_pretrain, "sft": formats.read_sft, "dpo": formats.read_dpo,
           "kto": formats.read_kto}


class StageData:
    def __init__(self, cfg: Config, tokenizer_dir: Path, data_dir: Path, device: torch.device | str = "cpu"):
        self.cfg, self.tokenizer_dir, self.data_dir = cfg, Path(tokenizer_dir), Path(data_dir)
        self.device = torch.device(device)
        self.tok = load_tokenizer(self.tokenizer_dir)

    def store(self, kind: str, tc: TrainConfig, split: str | None = None) -> TokenStore:
        """One split of a `kind` (pretrain / sft / dpo) as a token store: the training split, or `split`."""
        dc, split = self.cfg.data, split or kind
        path, sha = split_source(self.data_dir, split)
        report = CleanReport(max_examples=dc.report_examples)
        # Read lazily (only on a cache miss), checked against the hash the cache key is made of; rows the
        # data stage held out of this file for evaluation are skipped.
        held = held_out_ids(self.data_dir, split)
        store_kind = "kto" if kind == "dpo" and getattr(tc, "loss", "dpo") == "kto" else kind
        group_meta = {"group_labels": []} if store_kind == "kto" else None
        rows = without(unchanged_rows(READERS[store_kind](path, on_bad_row=dc.on_bad_row, report=report,
                                                          max_line_bytes=dc.max_line_bytes), path, sha, split), held)
        if kind == "pretrain":          # the two large kinds: encoded in worker processes past a few seconds
            examples = encoded("pretrain", clean_texts(rows, dedup=dc.dedup, report=report), self.tok, report,
                               seq_len=tc.seq_len, min_tokens=dc.min_tokens)
        elif kind == "sft":
            examples = encoded("sft", clean_conversations(rows, dedup=dc.dedup, report=report), self.tok, report,
                               seq_len=tc.seq_len, overlong=dc.overlong, min_tokens=dc.min_tokens)
        elif store_kind == "kto":           # unpaired rows (pairs are unpaired), each with its mismatched KL twin
            examples = kto_examples(clean_kto(rows, dedup=dc.dedup, report=report), self.tok, seq_len=tc.seq_len,
                                    overlong=dc.overlong, report=report, desirable=group_meta["group_labels"])
        else:
            examples = dpo_examples(clean_pairs(rows, dedup=dc.dedup, report=report), self.tok, seq_len=tc.seq_len,
                                    overlong=dc.overlong, report=report)
        settings = {"seq_len": tc.seq_len, "min_tokens": dc.min_tokens, "overlong": dc.overlong, "dedup": dc.dedup,
                    "on_bad_row": dc.on_bad_row, "max_line_bytes": dc.max_line_bytes, "held_out": sha256_json(held)}
        store = tokenized(store_kind, sha, self.tokenizer_dir, examples, group_meta=group_meta,
                          cache_root=self.cfg.runs_dir.resolve() / ".cache" / "tokens", settings=settings, report=report)
        check_drop_fraction(store.meta.get("clean") or {}, split, dc.max_drop_fraction,
                            seq_len=f"{kind}.seq_len ({tc.seq_len})")
        if len(store) < store.meta["group_size"]:
            raise DataError(f"data.{split}: no examples left after cleaning ({store.meta.get('clean')}); "
                            f"check {kind}.seq_len ({tc.seq_len}) and data.min_tokens / data.overlong")
        return store

    def batches(self, kind: str, tc: TrainConfig, rank: int = 0,
                world_size: int = 1) -> tuple[Callable[[dict | None], Prefetcher], dict]:
        """`make_batches(data_state)`, the training split's batch stream positioned by a checkpoint's
        data state, and a summary (examples, clean report). With several processes each `rank` of
        `world_size` gets its own share of every epoch (data/sampler.py): no row is in two ranks' batches.

        A data state saved by the same rank of the same world size continues exactly; one saved on another
        world size continues the same epoch at the same share of it (see `_continue_elsewhere`).
        """
        store = self.store(kind, tc)
        group = store.meta["group_size"]

        def make_batches(data_state: dict | None) -> Prefetcher:
            order = EpochSampler(len(store) // group, seed=tc.seed, rank=rank, world_size=world_size)
            saved = (data_state or {}).get("order")
            exact = bool(saved) and (saved.get("world_size", 1), saved.get("rank", 0)) == (world_size, rank)
            if exact:
                order.load_state_dict(saved)
            elif saved:
                _continue_elsewhere(order, saved, len((data_state.get("packer") or {}).get("buffer", [])))
            if tc.packing:
                batches = PackedBatches(store, order, rows=tc.batch_size, seq_len=tc.seq_len, group_size=group,
                                        share_prefix=shares_prompt(tc, group))
                if exact and data_state.get("packer"):
                    batches.load_state_dict(data_state["packer"])
            else:
                batches = padded_batches(store, order, batch_size=tc.batch_size, group_size=group)
            return Prefetcher(batches, depth=tc.prefetch, device=self.device)

        clean = store.meta.get("clean", {})
        log.info("%s: %d examples, %d tokens (%s); clean: %s", kind, len(store) // group, int(store.lengths().sum()),
                 "packed" if tc.packing else "padded", clean)
        return make_batches, {"examples": len(store) // group, "clean": clean}


def shares_prompt(tc: TrainConfig, group_size: int) -> bool:
    """Whether packed groups place their common prompt once: `dpo.share_prompt` (only that stage has groups)."""
    return group_size > 1 and getattr(tc, "share_prompt", False)


def _continue_elsewhere(order: EpochSampler, saved: dict, buffered: int) -> None:
    """Position `order` from a sampler state of another world size (a checkpoint of N processes resumed on
    M): the same epoch, at the same share of its permutation. The saved rank had handed out `position`
    indices of its 1/N share, `buffered` of them still waiting in its packer's look-ahead (not trained on):
    about (position - buffered) × N of the epoch are done, so each of the M ranks skips that many / M of its
    share. Not exact: look-ahead rows of the other saved ranks may repeat or be skipped once (a few hundred
    examples at most); the next epochs are the same as in any run."""
    done = max(int(saved["position"]) - buffered, 0) * int(saved.get("world_size", 1))
    state = order.state_dict()     # this rank's order; n and seed must be the saved ones (else: other data)
    state.update(n=saved.get("n"), seed=saved.get("seed"), epoch=int(saved["epoch"]),
                 position=min(done // order.world_size, order.num_samples))
    order.load_state_dict(state)
    log.warning("data: resuming on %d process(es) from a data position saved on %d: epoch %d continues at about "
                "%d of %d examples (exact only on the same number of processes)", order.world_size,
                saved.get("world_size", 1), state["epoch"], done, order.n)

