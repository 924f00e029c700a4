"""Which copy / cast / cat / add ops our 1B LoRA SFT step launches, and their GPU time (torch.profiler by op), then
the same ops by input shape (which tensors are copied), then the step's top kernels.

    PYTHONPATH=. python bench/probe/copy_probe.py        (CUDA; bench/RESULTS.md "Sibling projections" and
                                                          "Residual adds inside the RMSNorms")
"""
import torch
from torch.profiler import profile, ProfilerActivity
from glm_lora.kernels import ops as kernels
from glm_lora.configs.schema import LoRAConfig
from glm_lora.model import inject_lora
from glm_lora.model.lora import cast_frozen_gemm_weights
from glm_lora.model.heads import causal_lm_loss
from bench.workloads import decoder_config, our_model, TARGETS
dev = torch.device("cuda")
cfg = decoder_config("1b", 32000, 2048)
model = our_model(cfg, dev); inject_lora(model, LoRAConfig(target_modules=TARGETS, r=64, alpha=128))
cast_frozen_gemm_weights(model, torch.bfloat16)
B, T = 8, 2048
g = torch.Generator().manual_seed(0)
ids = torch.randint(3, 32000, (B, T), generator=g).to(dev)
doc = torch.cumsum((torch.rand(B, T, generator=g) < 1 / 200).long(), 1).to(dev) + 1
pos = torch.zeros(B, T, dtype=torch.long)
for b in range(B):
    d = doc[b].cpu(); start = 0
    for t in range(T):
        if t and d[t] != d[t - 1]: start = t
        pos[b, t] = t - start
labels = ids.clone(); labels[:, :int(T * 0.7)] = -100
batch = {"input_ids": ids, "labels": labels, "doc_ids": doc, "position_ids": pos.to(dev), "packed": True}
params = [p for p in model.parameters() if p.requires_grad]
def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = causal_lm_loss(model, batch)
    loss.backward()
    for p in params: p.grad = None
with kernels.using("auto", "flex"):
    for _ in range(3): step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as p:
        step(); torch.cuda.synchronize()
OPS = ("aten::copy_", "aten::clone", "aten::cat", "aten::contiguous", "aten::_to_copy", "aten::add", "aten::add_")


def top(events, n, label):
    rows = sorted((e for e in events if e.key in OPS), key=lambda e: -e.device_time_total)
    for e in rows[:n]:
        print(f"{e.device_time_total/1e3:8.2f} ms  x{e.count:4d}  {e.key}  {label(e)}")


print("by op"); top(p.key_averages(), 25, lambda e: "")
print("\nby input shape"); top(p.key_averages(group_by_input_shape=True), 30, lambda e: e.input_shapes)
print("\nall kernels, top 40"); print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70))
