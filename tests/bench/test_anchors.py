"""bench/anchors.py: the answer positions handed to Liger's DPO loss, and the padding-free packing check (CPU)."""
import numpy as np
import pytest
import torch

from bench import anchors
from bench.e2e_dpo_gpu import sequence_logps
from bench.workloads import RandomDPO, decoder_config, hf_model, hf_peft
from glm_lora.data.packing import IGNORE, PackedBatches, padded_batches
from glm_lora.data.sampler import EpochSampler


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = decoder_config("smoke", 1000, 256)
    model = hf_peft(cfg, torch.device("cpu"), base=hf_model(cfg, torch.device("cpu"), use_cache=False))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)          # an adapter that changes the output
    src = RandomDPO(60, 1000, 256)
    batch = next(PackedBatches(src, iter(EpochSampler(30, seed=0)), rows=4, seq_len=256, group_size=2))
    return model.eval(), batch


def _pairs_alone(b):
    """The packed batch's pairs as (ids, labels) documents, in group order."""
    out = []
    for chosen, rejected in b["group_docs"]:
        out.append([(b["input_ids"][b["doc_ids"] == d].numpy(), b["labels"][b["doc_ids"] == d].numpy())
                    for d in (chosen, rejected)])
    return out


class _Docs:
    def __init__(self, pairs):
        self.docs = [d for p in pairs for d in p]

    def __len__(self):
        return len(self.docs)

    def lengths(self):
        return np.array([len(ids) for ids, _ in self.docs])

    def example(self, i):
        return self.docs[i]


@torch.no_grad()
def test_answer_positions_give_each_sequence_its_own_logprobs(setup):
    model, b = setup
    b = anchors.add_answer_index(b)
    n = len(b["group_docs"])
    h = anchors.hidden(model, b).flatten(0, 1)[b["answer_index"]]                  # (2n, L, C), packed rows
    logp = model.get_base_model().lm_head(h).log_softmax(-1)
    target = b["answer_target"]
    tok = logp.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1) * (target != IGNORE)
    packed = tok.sum(-1).view(2, n).T                                              # (pairs, [chosen, rejected])
    pairs = _pairs_alone(b)
    alone = next(padded_batches(_Docs(pairs), iter(range(n)), batch_size=n, group_size=2))
    assert torch.allclose(packed, sequence_logps(model, alone), atol=1e-4)       # each pair run on its own rows


def test_packing_check_tells_document_attention_from_plain_causal(setup):
    model, b = setup
    check = anchors.check_packing(model, b, torch.device("cpu"), torch.autocast("cpu", enabled=False))
    assert check["ok"] and check["max_abs_diff_packed_vs_alone"] < 1e-4 < check["max_abs_diff_plain_causal_vs_alone"]
