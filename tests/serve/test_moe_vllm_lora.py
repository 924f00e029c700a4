"""Our exported GLM-4.5 (glm4_moe) adapter through vLLM's own LoRA loader: every projection's update — attention,
dense MLP, shared expert and each routed expert — lands in vLLM's LoRA buffers equal to our merged model minus
the base (vllm_moe_lora_check.py says why no forward: vLLM's CPU build has no MoE LoRA kernels)."""
import json
import subprocess
from pathlib import Path

import pytest
import torch

from glm_lora.configs.schema import LoRAConfig
from glm_lora.export.hf_peft import write_peft_adapter
from glm_lora.model import inject_lora, merge_lora
from glm_lora.model.adapters import save_adapter, served_form
from glm_lora.model.hf import load_hf, save_hf
from tests.serve.serve_helpers import NEEDS_VLLM_AND_NGINX

pytestmark = NEEDS_VLLM_AND_NGINX


def test_vllm_reads_every_experts_lora_from_our_export(tmp_path):
    from glm_lora.serve import vllm_server as vs
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    from glm_lora.data.tokenizer import load_tokenizer, train_tokenizer

    base = tmp_path / "base"
    (tmp_path / "corpus.txt").write_text("\n".join(f"line {i} of words and numbers {i * 7}" for i in range(200)))
    train_tokenizer([tmp_path / "corpus.txt"], base, vocab_size=400)
    tok = load_tokenizer(base)
    torch.manual_seed(0)
    Glm4MoeForCausalLM(Glm4MoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
        num_nextn_predict_layers=0, max_position_embeddings=128, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)).save_pretrained(base)
    ours = load_hf(base)
    lora = LoRAConfig(r=4, alpha=8.0, target_modules="all-linear")
    inject_lora(ours, lora)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    (tmp_path / "ours").mkdir()
    save_adapter(ours, lora, tmp_path / "ours")
    write_peft_adapter(tmp_path / "ours", tmp_path / "adapter", str(base), moe=True)
    save_hf(merge_lora(ours), tmp_path / "merged", bos_id=None, eos_id=None, pad_id=None)
    rank = vs.lora_rank_for(served_form(tmp_path, "adapter", moe=True)["r"])
    proc = subprocess.run([str(vs.vllm_python()), str(Path(__file__).with_name("vllm_moe_lora_check.py")), str(base),
                           str(tmp_path / "adapter"), str(tmp_path / "merged"), str(rank)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["n_missing"] == 0, result                   # no update silently left out
    assert result["extra"] == [], result
    assert result["experts_checked"] == 2 * 8 * 3             # 2 MoE layers × 8 experts × gate/up/down
    assert result["max_rel_err"] < 1e-4, result
