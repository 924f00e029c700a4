"""GPU only: `<stage>.cuda_graphs` (engine.cuda_graphs.graphed_training, as engine/fit.py runs it). The blocks
replayed as CUDA graphs train what the eager blocks train on packed rows whose documents differ from batch to
batch (the document mask is rebuilt inside the graph from each batch's doc_ids, not baked in from the capture), the
adapter's gradients come out of the backward graph, the reference pass (no_grad, the adapter off: DPO's) replays
its own forward graph between the policy's forward and backward, and other forwards (the adapter on under no_grad,
eval mode) run eager."""
import pytest
import torch

from glm_lora.kernels import ops as kernels
from glm_lora.configs.schema import LoRAConfig
from glm_lora.engine.cuda_graphs import graphed_training
from glm_lora.model.heads import causal_lm_loss
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from glm_lora.model.lora import lora_disabled

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")
B, T, V = 4, 128, 512


def _batches(n: int) -> list[dict]:
    """Packed rows, each batch cut into documents at different places; a learnable next token (previous + 3)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = (torch.randint(0, V, (B, 1), generator=g) + 3 * torch.arange(T)) % V
        doc_ids, position_ids = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
        for r in range(B):
            cuts = sorted(torch.randint(8, T - 8, (3,), generator=g).tolist())
            for d, (a, b) in enumerate(zip([0, *cuts], [*cuts, T]), start=1):
                doc_ids[r, a:b], position_ids[r, a:b] = d, torch.arange(b - a)
        out.append({"input_ids": ids.cuda(), "labels": ids.cuda(), "doc_ids": doc_ids.cuda(),
                    "position_ids": position_ids.cuda(), "packed": True})
    return out


def _model() -> Decoder:
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=V, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                  intermediate_size=512, max_seq_len=T)).cuda().train()
    inject_lora(model, LoRAConfig(r=8, alpha=16, target_modules="all-linear"))
    return model


def _train(enabled: bool, batches: list[dict], amp: torch.dtype | None, attention: str = "sdpa"):
    """DPO's order each step: the policy's forward, the reference forward (no_grad, adapter off), the backward."""
    model = _model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, references = [], []
    with kernels.using("auto", attention), graphed_training(model, enabled, device=CUDA) as info:
        for b in batches:
            with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
                loss, _ = causal_lm_loss(model, b)
                with torch.no_grad(), lora_disabled(model):
                    references.append(model.hidden_states(b["input_ids"], b.get("position_ids"), b.get("doc_ids")))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        b = batches[0]
        with torch.no_grad():                           # the adapter on under no_grad: not the captured reference
            others = [model.hidden_states(b["input_ids"], b.get("position_ids"), b.get("doc_ids"))]
            model.eval()
            others.append(model.hidden_states(b["input_ids"], b.get("position_ids"), b.get("doc_ids")))
    adapter = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    return losses, adapter, torch.stack(references), torch.stack(others), info


@pytest.mark.parametrize("amp,tol,attention,packed", [(None, 1e-3, "sdpa", True), (torch.bfloat16, 2e-2, "sdpa", True),
                                                      (None, 1e-3, "flex", True), (None, 1e-3, "sdpa", False)])
def test_graphed_blocks_train_what_eager_blocks_train(amp, tol, attention, packed):
    """flex: FlexAttention's block mask, built inside the graph too (what attention "auto" takes at 1B); unpacked:
    rows with neither doc_ids nor position_ids (plain causal attention, as a padded stage or a pretraining bench)."""
    batches = _batches(6) * 2
    if not packed:
        batches = [{"input_ids": b["input_ids"], "labels": b["labels"], "packed": False} for b in batches]
    eager, w_eager, ref_eager, other_eager, info_e = _train(False, batches, amp, attention)
    graphed, w_graphed, ref_graphed, other_graphed, info_g = _train(True, batches, amp, attention)
    assert info_e == {"cuda_graphs": False}
    assert info_g["cuda_graphs"] is True and info_g["cuda_graphs_reference"] is True, info_g
    assert not any(k.endswith("fallback") for k in info_g), info_g
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=tol, atol=tol)
    for k in w_eager:
        torch.testing.assert_close(w_graphed[k], w_eager[k], rtol=tol, atol=tol, msg=k)
    torch.testing.assert_close(ref_graphed, ref_eager, rtol=tol, atol=tol)       # every step's reference pass
    torch.testing.assert_close(other_graphed, other_eager, rtol=tol, atol=tol)
    assert graphed[-1] < graphed[0] - 0.5          # it learned (6 batches seen twice)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_a_graph_does_not_keep_the_capture_batchs_document_mask(attention):
    """The mask cache (kernels.document_causal_mask) hands back the mask last built for the same doc_ids tensor;
    make_graphed_callables warms up on the very tensors it then captures with, so without the capture check the
    graph would replay the first batch's mask for every batch."""
    a, b = _batches(2)
    model = _model()
    with kernels.using("auto", attention), graphed_training(model, True, device=CUDA):
        model.hidden_states(a["input_ids"], a["position_ids"], a["doc_ids"])               # captures on batch a
        graphed = model.hidden_states(b["input_ids"], b["position_ids"], b["doc_ids"]).detach().clone()
    with kernels.using("auto", attention):
        eager = model.hidden_states(b["input_ids"], b["position_ids"], b["doc_ids"])
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
