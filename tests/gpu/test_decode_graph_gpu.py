"""GPU only: the decode step replayed from a CUDA graph (evaluation/decode.GraphedDecodeStep) gives the token ids of
the eager step — sampled (the RL rollouts, same generator seed) and greedy, under bf16 autocast with an fp32 adapter
over a bf16 frozen base (as a LoRA stage holds it on CUDA) and in fp32, over several batches and ragged prompts,
with and without a stop token."""
import pytest
import torch

from glm_lora.kernels import ops as kernels
from glm_lora.configs.schema import LoRAConfig
from glm_lora.evaluation import decode
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from glm_lora.model.lora import cast_frozen_gemm_weights
from tests.model.test_lora import randomise_b

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 311


def model(arch: str, bf16_base: bool) -> Decoder:
    torch.manual_seed(0)
    m = Decoder(DecoderConfig(vocab_size=VOCAB, hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                              intermediate_size=256, max_seq_len=96, arch=arch))
    inject_lora(m, LoRAConfig(target_modules="all-linear", r=8, alpha=16))
    randomise_b(m)
    if bf16_base:
        cast_frozen_gemm_weights(m, torch.bfloat16)
    return m.cuda().eval()


def prompts(n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("arch", ["qwen3", "glm4", "llama"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_graphed_decoding_gives_the_eager_tokens(arch, precision):
    bf16 = precision == "bf16"
    m = model(arch, bf16_base=bf16)
    assert decode.decode_graph_pays(m)
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16)
    ps = prompts()
    with kernels.using("auto", "auto"), torch.no_grad(), amp:
        def both(eos):
            sampled = [decode.sample_decode(m, ps, max_new_tokens=40, eos_id=eos, temperature=1.0, batch_size=4,
                                              generator=torch.Generator("cuda").manual_seed(5), cuda_graph=graph)
                       for graph in (False, True)]
            greedy = [decode._decode_batch(m, ps, 40, {eos} if eos is not None else set(), lambda x: x.argmax(-1),
                                             cuda_graph=graph) for graph in (False, True)]
            assert sampled[0] == sampled[1] and greedy[0] == greedy[1]
            return sampled[0], greedy[0]

        sampled, greedy = both(None)
        assert all(len(a) == 40 for a in sampled + greedy)
        eos = max(range(VOCAB), key=[t for a in sampled for t in a[1:]].count)    # a token the answers do draw
        sampled, _ = both(eos)
        assert any(a[-1] == eos and len(a) < 40 for a in sampled)


def test_a_second_call_sees_updated_weights():
    """Each batch captures its own graph: after an in-place weight update (the optimizer step between rollouts)
    the next decode uses the new adapter, as the eager step does."""
    m = model("qwen3", bf16_base=True)
    ps = prompts(4)

    def greedy(graph):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return decode._decode_batch(m, ps, 24, set(), lambda x: x.argmax(-1), cuda_graph=graph)

    before = greedy(True)
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.mul_(-3.0)
    after = greedy(True)
    assert after == greedy(False) and after != before
