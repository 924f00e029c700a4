"""GPU only: inside torch.compile, kernels "auto" takes the torch reference ops (inductor fuses them), so the
decoder's blocks compile to one graph without breaks at our Triton calls, and give what the eager fused path gives."""
import pytest
import torch

from glm_lora import kernels
from glm_lora.model import Decoder, DecoderConfig
from tests.kernel_check import close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_compiled_blocks_are_one_graph_and_match_the_eager_fused_path():
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                  intermediate_size=512, max_seq_len=128)).cuda()
    ids = torch.randint(0, 512, (2, 128), device="cuda")
    with kernels.using("auto"):
        explained = torch._dynamo.explain(model.hidden_states)(ids)
        assert explained.graph_break_count == 0, explained.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(model.hidden_states)(ids)
        eager = model.hidden_states(ids)           # the Triton ops
    close(compiled, eager, (2e-4, 2e-4))
