"""GPU only: inside torch.compile, kernels "auto" takes the torch reference ops (inductor fuses them), so the
decoder's blocks compile without breaks at our Triton calls (only the explicit cut before each MLP on CUDA), and
give what the eager fused path gives."""
import pytest
import torch

from glm_lora.kernels import ops as kernels
from glm_lora.model import Decoder, DecoderConfig
from tests.kernel_check import close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_compiled_blocks_break_only_where_split_and_match_the_eager_fused_path():
    """No graph break at our Triton calls: the only breaks are the explicit cut before each block's MLP
    (model.COMPILE_SPLITS_BLOCKS["cuda"]). torch 2.11's dynamo also broke at `bool(tuple)` in MLP.reads_input_once,
    at the same place — the split every GPU figure of compiled blocks was measured with."""
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                  intermediate_size=512, max_seq_len=128)).cuda()
    ids = torch.randint(0, 512, (2, 128), device="cuda")
    with kernels.using("auto"):
        explained = torch._dynamo.explain(model.hidden_states)(ids)
        assert {r.reason.splitlines()[0] for r in explained.break_reasons} == \
            {"Call to `torch._dynamo.graph_break()`"}, explained.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(model.hidden_states)(ids)
        eager = model.hidden_states(ids)           # the Triton ops
    close(compiled, eager, (2e-4, 2e-4))


def test_a_stage_compiled_on_cuda_learns_what_eager_learns(tmp_path):
    """`<stage>.compile: true` on CUDA (engine.compile.compiled_training, as engine/fit.py runs it): the compiled
    steps' losses follow the eager fused path's, and the stage reports that it compiled. (`max-autotune` here did not
    finish in 7 minutes on an H100 — inductor benchmarks its GEMM templates for every shape; its mode is checked in
    tests/engine/test_compile.py and its path ran in bench.e2e_pretrain_gpu's `ours_fused_autotune`, 2026-12-06.)"""
    from glm_lora.engine.compile import compiled_training
    from glm_lora.model.heads import causal_lm_loss
    cuda = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 512, (8, 4, 1), generator=g)
    rows = ((starts + 3 * torch.arange(128)) % 512).cuda()        # a learnable next token: the previous + 3
    batches = [{"input_ids": ids, "labels": ids, "packed": False} for ids in rows]

    def train(enabled):
        torch.manual_seed(0)
        model = Decoder(DecoderConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                      intermediate_size=512, max_seq_len=128)).cuda().train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        with kernels.using("auto"), compiled_training(model, enabled, device=cuda, runs_dir=tmp_path) as info:
            for b in batches * 2:
                loss, _ = causal_lm_loss(model, b)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
        return losses, info

    eager, info_e = train(False)
    compiled, info_c = train(True)
    assert info_e == {"compile": False}
    assert info_c["compile"] is True and "compile_fallback" not in info_c, info_c
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=2e-3, atol=2e-3)
    assert compiled[-1] < compiled[0] - 0.5          # it learned (the 8 batches seen twice)
