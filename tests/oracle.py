"""A model whose next token is a lookup table: the Decoder's decoding interface (config.max_seq_len,
hidden_states with position_ids / doc_ids / a KVCache, lm_head, forward, generate) with logits that
put SCALE on the token the table gives for the current document's prefix (uniform logits otherwise,
so argmax picks token 0). Used to check decoding and metrics exactly, without training."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn

from glm_lora.model import Decoder

SCALE = 30.0   # one-hot logit: the oracle's token has p = 1 - O(V e^-30)


class Oracle(nn.Module):
    """Next token = table[prefix of the current document]; unknown prefixes get uniform logits."""

    def __init__(self, vocab: int, table: dict[tuple[int, ...], int] | None = None, max_seq_len: int = 512):
        super().__init__()
        self.table = dict(table or {})
        self.config = SimpleNamespace(max_seq_len=max_seq_len)
        self.lm_head = nn.Linear(vocab, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.eye(vocab))
        self.vocab = vocab

    def teach(self, context: list[int], continuation: list[int]) -> "Oracle":
        for k, t in enumerate(continuation):
            prefix = tuple(context + continuation[:k])
            assert self.table.setdefault(prefix, t) == t, "two continuations of one prefix: no model is perfect"

        return self

    def hidden_states(self, input_ids, position_ids=None, doc_ids=None, cache=None, prefix_docs=None):
        B, T = input_ids.shape
        out = torch.zeros(B, T, self.vocab)
        if cache is not None:       # decoding (model.KVCache): the oracle keeps each row's tokens so far instead
            rows = getattr(cache, "oracle_rows", None) or [[] for _ in range(B)]
            for b in range(B):
                for t, (tok, pos) in enumerate(zip(input_ids[b].tolist(), position_ids[b].tolist())):
                    rows[b][pos:] = [tok]
                    nxt = self.table.get(tuple(rows[b]))
                    if nxt is not None:
                        out[b, t, nxt] = SCALE
            cache.oracle_rows = rows
            return out
        rows = input_ids.tolist()
        for b in range(B):
            for t in range(T):
                start = t - int(position_ids[b, t]) if position_ids is not None else 0   # document start
                nxt = self.table.get(tuple(rows[b][start:t + 1]))
                if nxt is not None:
                    out[b, t, nxt] = SCALE
        return out

    def forward(self, input_ids, position_ids=None, doc_ids=None):
        return self.lm_head(self.hidden_states(input_ids, position_ids, doc_ids))

    generate = Decoder.generate
