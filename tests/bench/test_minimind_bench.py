"""The parts of bench/minimind_gpu.py that CI can run without a MiniMind checkout (it cannot fetch one):
- the observer that runs MiniMind's scripts unchanged counts the real tokens and optimizer steps of a script's own
  DataLoader / AdamW loop, and times the steady window;
- MiniMind's saved weights (a state dict of fp16 tensors with Qwen3's parameter names) read as a Qwen3 checkpoint load
  into our decoder with transformers' own Qwen3 logits.
The whole bench runs at smoke size where a checkout is (`python -m bench.minimind_gpu --minimind PATH --smoke`)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.minimind_gpu import as_qwen3, flops_per_token, steady
from bench.minimind_observe import PAD_ENV, WARMUP_ENV
from tests.chat_templates import build_tokenizer

REPO = Path(__file__).resolve().parents[2]

LOOP = """
import torch
from torch import optim
from torch.utils.data import DataLoader
ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [1, 2, 3, 4, 5], [7, 0, 0, 0, 0]] * 3)
model = torch.nn.Embedding(10, 4)
opt = optim.AdamW(model.parameters(), lr=1e-3)
for step, (x, y) in enumerate(DataLoader(list(zip(ids, ids)), batch_size=2), start=1):
    model(x).sum().backward()
    if step % 2 == 0:
        opt.step()
        opt.zero_grad()
"""


def test_the_observer_counts_a_scripts_own_tokens_and_steps(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LOOP))
    out = tmp_path / "observed.json"
    env = {"PYTHONPATH": str(REPO), PAD_ENV: "0", WARMUP_ENV: "1", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-m", "bench.minimind_observe", str(out), str(script)], cwd=tmp_path, env=env,
                   check=True)
    got = json.loads(out.read_text())
    assert (got["tokens"], got["slots"], got["batches"], got["optimizer_steps"]) == (3 * 11, 60, 6, 3)
    # the window starts after the first optimizer step (2 batches, 11 real tokens) and ends when the loader is done
    assert got["window_tokens"] == 3 * 11 - 11 and got["window_s"] > 0


def test_minimind_weights_read_as_qwen3_give_transformers_logits(tmp_path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from glm_lora.model.hf import load_hf

    c = SimpleNamespace(vocab_size=500, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=8, hidden_act="silu",
                        max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in vars(c).items()}, attention_bias=False)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.half().float())            # MiniMind saves fp16: compare on the weights it would save
    pth = tmp_path / "full_sft_64.pth"
    torch.save({k: v.half() for k, v in hf.state_dict().items()}, pth)       # as MiniMind's trainer saves
    tokenizer = build_tokenizer(tmp_path / "tok", "qwen3", generation_config=False)
    ours = load_hf(as_qwen3(pth, c, tokenizer, tmp_path / "as-qwen3")).eval()
    ids = torch.randint(3, c.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() < 1e-4


def test_steady_throughput_leaves_the_warmup_windows_out(tmp_path: Path) -> None:
    windows = [{"step": 10, "tokens": 1000, "elapsed_s": 30.0, "stage_tokens_per_s": 33, "stage_token_efficiency": 0.9},
               {"step": 20, "tokens": 2000, "elapsed_s": 31.0, "stage_tokens_per_s": 64, "stage_token_efficiency": 0.9},
               {"step": 30, "tokens": 3000, "elapsed_s": 32.0, "stage_tokens_per_s": 94, "stage_token_efficiency": 0.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(w) + "\n" for w in windows))
    got = steady(tmp_path / "metrics.jsonl", max_steps=30)
    assert math.isclose(got["tokens_per_s"], 1000.0) and got["tokens"] == 3000


def test_lora_counts_no_weight_gradients_in_its_flops() -> None:
    c = SimpleNamespace(hidden_size=768, head_dim=96, num_attention_heads=8, num_key_value_heads=4,
                        intermediate_size=2432, num_hidden_layers=8, vocab_size=6400)
    assert math.isclose(flops_per_token(c, 340, lora=True) / flops_per_token(c, 340, lora=False), 4 / 6)
