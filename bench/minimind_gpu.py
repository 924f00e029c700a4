"""From scratch against MiniMind's own scripts: pretraining and SFT on one GPU, the same data, model shape,
tokenizer, token budget, batch and sequence length; then each model evaluated by the same code.

    python -m bench.minimind_gpu --minimind PATH [--pretrain-docs N] [--sft-rows N] [--their-variants eager,compiled]
                                 [--work DIR] [--smoke]

PATH is a checkout of jingyaogong/minimind that you point to (nothing of it is in this repository). It is copied
into the scratch directory, and its scripts run there from their `trainer/` directory as its README runs them, each
under `bench.minimind_observe`, which counts their tokens and times their steps without changing them.

What is the same on both sides:
- the model: MiniMind's default dense config, read from its `MiniMindConfig()` (minimind-3: hidden 768, 8 layers,
  8 query / 4 key-value heads of 96, MLP 2432, vocabulary 6400, tied embeddings, per-head q/k RMSNorm, RoPE θ 1e6):
  ours is `model.arch: qwen3` with those sizes, the layout MiniMind says it follows;
- the tokenizer: MiniMind's own `model/` files (ours takes them through `tokenizer.path`), so both see the same ids;
- the data: our synthetic pretraining corpus and SFT conversations (data stage), written as MiniMind's JSONL
  (`{"text"}` and `{"conversations"}`) for its scripts;
- the budget: one epoch of each on both sides; the rows per micro-batch and their length (pretraining 32 × 340, its
  defaults; SFT 16 × `--sft-seq-len`, default 128, which holds every SFT row whole: MiniMind's default 768 would pad
  each row 6× more); bf16 autocast; one GPU.

What differs, as each project trains:
- MiniMind pads every row to its length; ours packs whole documents into each row. tokens/s counts real (non-pad)
  tokens on both sides, and MiniMind's padded slots/s is recorded beside it;
- MiniMind accumulates 8 micro-batches per optimizer step in pretraining (≈ the tokens of 2 packed micro-batches, so
  ours accumulates 2); learning rates are each project's: MiniMind's defaults (5e-4 pretraining, 1e-5 full SFT),
  ours 5e-4 pretraining and `--sft-lr` for the LoRA;
- SFT: MiniMind fine-tunes every weight, ours trains a LoRA (r 64, all linear projections), as the DAG does.

Recorded for each: tokens/s over the steady part of training (after the first 10% of optimizer steps), MFU against
the bf16 matmul peak measured in this run, peak GPU memory, wall time of each step of the way (ours: the DAG's
stages; MiniMind: its two scripts), held-out perplexity and bits per byte on the same pretraining text after
pretraining, and exact match and answer loss on the same SFT rows after SFT, by `evaluation.heldout` for both (MiniMind's
saved weights are read as a Qwen3 checkpoint, after a logits check against MiniMind's own model class).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from bench.common import write_result
from bench.minimind_observe import PAD_ENV, WARMUP_ENV

REPO = Path(__file__).resolve().parents[1]
# MiniMind's argparse defaults (trainer/train_pretrain.py, trainer/train_full_sft.py), passed explicitly.
THEIR_PRETRAIN = {"batch_size": 32, "accumulation_steps": 8, "max_seq_len": 340, "learning_rate": 5e-4}
THEIR_SFT = {"batch_size": 16, "accumulation_steps": 1, "learning_rate": 1e-5}
OUR_PRETRAIN_ACCUM = 2        # 32 packed rows × 340 ≈ 10.9k tokens a micro-batch; theirs ≈ 8 × 32 padded rows
WARMUP_FRACTION = 0.1         # optimizer steps left out of the steady throughput
COPIED = ("trainer", "model", "dataset")


def sh(cmd: list[str], cwd: Path, log: Path, env: dict | None = None) -> float:
    """Run `cmd`, its output to `log`; return its wall time. A failure stops the bench with the log's tail."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
    return wall


# ---------------------------------------------------------------- MiniMind's side

def copy_checkout(minimind: Path, dest: Path) -> Path:
    """The checkout's code and tokenizer, copied: its scripts write ../out and ../checkpoints beside trainer/."""
    for name in COPIED:
        if not (minimind / name).is_dir():
            raise SystemExit(f"--minimind {minimind}: no {name}/ directory; expected a jingyaogong/minimind checkout")
        shutil.copytree(minimind / name, dest / name, ignore=shutil.ignore_patterns("*.jsonl", "__pycache__"))
    return dest


def their_config(checkout: Path, hidden_size: int | None, layers: int | None):
    """MiniMind's own default config (its MiniMindConfig), with the smoke run's sizes where given."""
    sys.path.insert(0, str(checkout))
    try:
        from model.model_minimind import MiniMindConfig
    finally:
        sys.path.remove(str(checkout))
    kw = {k: v for k, v in (("hidden_size", hidden_size), ("num_hidden_layers", layers)) if v is not None}
    return MiniMindConfig(**kw)


def write_their_data(data_dir: Path, dest: Path) -> dict[str, Path]:
    """Our data stage's pretraining and SFT files in the JSONL MiniMind's datasets read."""
    out = {"pretrain": dest / "pretrain.jsonl", "sft": dest / "sft.jsonl"}
    with open(data_dir / "pretrain.jsonl") as src, open(out["pretrain"], "w") as f:
        for line in src:
            f.write(json.dumps({"text": json.loads(line)["text"]}, ensure_ascii=False) + "\n")
    with open(data_dir / "sft.jsonl") as src, open(out["sft"], "w") as f:
        for line in src:
            turns = [{"role": m["role"], "content": m["content"]} for m in json.loads(line)["conversations"]]
            f.write(json.dumps({"conversations": turns}, ensure_ascii=False) + "\n")
    return out


def run_theirs(checkout: Path, script: str, args: dict, out: Path, pad_id: int, warmup: int, log: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.minimind_observe", str(out), script]
    for k, v in args.items():
        cmd += [f"--{k}", str(v)]
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), PAD_ENV: str(pad_id),
           WARMUP_ENV: str(max(warmup, 1)), "TOKENIZERS_PARALLELISM": "false"}
    wall = sh(cmd, checkout / "trainer", log, env)
    return {**json.loads(out.read_text()), "wall_s": wall}


def as_qwen3(pth: Path, their_cfg, tokenizer_dir: Path, dest: Path) -> Path:
    """MiniMind's saved weights (a state dict of plain tensors: read with weights_only) as a Qwen3 checkpoint: the
    same parameter names, and the layout its README says it follows."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    state = torch.load(pth, map_location="cpu", weights_only=True)
    if their_cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    c = their_cfg
    hf = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                     num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
                     max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
                     rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings, attention_bias=False,
                     bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
    hf.architectures = ["Qwen3ForCausalLM"]
    dest.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(dest)
    save_file({k: v.float().contiguous() for k, v in state.items()}, str(dest / "model.safetensors"))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(f, dest / f.name)
    return dest


def check_logits(checkout: Path, their_cfg, pth: Path, ours, device: torch.device) -> float:
    """Max |logit difference| between MiniMind's own model class and our decoder on the converted weights (fp32)."""
    sys.path.insert(0, str(checkout))
    try:
        from model.model_minimind import MiniMindForCausalLM
    finally:
        sys.path.remove(str(checkout))
    theirs = MiniMindForCausalLM(their_cfg)
    theirs.load_state_dict({k: v.float() for k, v in torch.load(pth, map_location="cpu", weights_only=True).items()},
                           strict=False)
    theirs.to(device).eval()
    ids = torch.randint(3, their_cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        diff = (theirs(ids).logits.float() - ours.to(device).eval()(ids).float()).abs().max().item()
    del theirs
    return diff


def evaluate_theirs(cfg, run_dir: Path, their_cfg, checkout: Path, pth: Path, what: str, work: Path,
                    device: torch.device) -> dict:
    from glm_lora.data.tokenizer import load_tokenizer
    from glm_lora.evaluation.heldout import eval_lm, eval_tasks
    from glm_lora.model.hf import load_hf

    hf_dir = as_qwen3(pth, their_cfg, run_dir / "tokenizer", work / f"theirs-{what}")
    model = load_hf(hf_dir)
    diff = check_logits(checkout, their_cfg, pth, model, device)
    if diff > 1e-2:
        raise SystemExit(f"MiniMind's {pth.name} read as Qwen3 disagrees with MiniMind's model: max |Δlogit| {diff}")
    tok = load_tokenizer(run_dir / "tokenizer")
    model.to(device).eval()
    if what == "pretrain":      # as our pretrain stage evaluates: fp32
        out = eval_lm(cfg, model, tok, run_dir / "data")
    else:                       # as our SFT stage evaluates on CUDA: bf16 autocast
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            out = eval_tasks(cfg, model, tok, run_dir / "data")
    out.pop("samples", None)
    return {**out, "max_abs_logit_diff_vs_minimind_class": diff}


# ---------------------------------------------------------------- our side

def our_config(a, work: Path, checkout: Path, tc, device: str) -> dict:
    smoke = a.smoke
    return {
        "run_name": "minimind", "runs_dir": str(work / "runs"), "device": device,
        "precision": "fp32" if smoke else "bf16",
        "tokenizer": {"path": str(checkout / "model")},
        "data": {"synthetic": {"n_pretrain": a.pretrain_docs, "n_sft": a.sft_rows, "n_dpo": a.dpo_rows,
                               "n_eval": a.eval_rows}},
        "model": {"arch": "qwen3", "hidden_size": tc.hidden_size, "num_layers": tc.num_hidden_layers,
                  "num_heads": tc.num_attention_heads, "num_kv_heads": tc.num_key_value_heads,
                  "intermediate_size": tc.intermediate_size, "max_seq_len": max(THEIR_PRETRAIN["max_seq_len"], a.sft_seq_len),
                  "rope_theta": tc.rope_theta, "rms_norm_eps": tc.rms_norm_eps, "tie_embeddings": tc.tie_word_embeddings},
        "pretrain": {"batch_size": THEIR_PRETRAIN["batch_size"], "seq_len": THEIR_PRETRAIN["max_seq_len"],
                     "grad_accum": OUR_PRETRAIN_ACCUM, "lr": THEIR_PRETRAIN["learning_rate"], "min_lr_ratio": 0.1,
                     "warmup_steps": 0, "weight_decay": 0.01, "compile": not smoke, "log_every": 10},
        "sft": {"batch_size": THEIR_SFT["batch_size"], "seq_len": a.sft_seq_len, "lr": a.sft_lr, "min_lr_ratio": 0.1,
                "warmup_steps": 10, "lora": {"r": 64, "alpha": 128}, "cuda_graphs": not smoke, "log_every": 10},
        "dpo": {"max_steps": a.dpo_steps, "batch_size": 8, "seq_len": a.sft_seq_len, "lora": {"r": 64, "alpha": 128},
                "log_every": 10},
        "checkpoint": {"save_every": 0},     # MiniMind saves once at the end here too (--save_interval)
        "eval": {"max_rows": a.eval_rows, "compare_prompts": ["What is 417 + 4?"]},
        "serve": {"enabled": False},
    }


def steady(metrics_jsonl: Path, max_steps: int) -> dict:
    """Tokens/s of our stage over the windows after the first WARMUP_FRACTION of its optimizer steps."""
    windows = [json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip()]
    first = next((w for w in windows if w["step"] >= WARMUP_FRACTION * max_steps and w is not windows[-1]), windows[0])
    last = windows[-1]
    seconds = last["elapsed_s"] - first["elapsed_s"]
    tokens = last["tokens"] - first["tokens"]
    return {"tokens": last["tokens"], "window_s": seconds, "window_tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds > 0 else last["stage_tokens_per_s"],
            "token_efficiency": last["stage_token_efficiency"], "train_loop_s": last["elapsed_s"]}


def count_tokens(tok, data_dir: Path, seq_len: int) -> tuple[int, int]:
    """Tokens of one epoch of pretraining (documents + eos, as our store holds them) and of SFT (rendered rows)."""
    texts = [json.loads(line)["text"] for line in open(data_dir / "pretrain.jsonl")]
    pre = sum(len(ids) + 1 for ids in tok(texts, add_special_tokens=False)["input_ids"])
    rows = [json.loads(line)["conversations"] for line in open(data_dir / "sft.jsonl")]
    sft = sum(min(len(ids), seq_len) for ids in tok([tok.apply_chat_template(r, tokenize=False) for r in rows],
                                                     add_special_tokens=False)["input_ids"])
    return pre, sft


def matmul_peak(device: torch.device) -> float | None:
    """bf16 dense matmul FLOP/s measured here (the MFU denominator)."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    return 20 * 2 * 8192 ** 3 / (time.perf_counter() - t0)


def flops_per_token(c, seq_len: int, lora: bool) -> float:
    """6·N + 12·L·h·seq for full training (N: the matmul weights, the output head included, not the embedding
    lookup); LoRA: 4·N + 8·L·h·seq (frozen weights get no weight gradient; the adapter's own work left out)."""
    h, d = c.hidden_size, c.head_dim
    per_layer = h * d * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 3 * h * c.intermediate_size
    n = c.num_hidden_layers * per_layer + h * c.vocab_size
    k = 4 if lora else 6
    return k * n + 2 * k * c.num_hidden_layers * h * seq_len


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minimind", type=Path, required=True, help="a checkout of jingyaogong/minimind")
    ap.add_argument("--pretrain-docs", type=int, default=200_000)
    ap.add_argument("--sft-rows", type=int, default=60_000)
    ap.add_argument("--dpo-rows", type=int, default=2_000)
    ap.add_argument("--dpo-steps", type=int, default=30)
    ap.add_argument("--eval-rows", type=int, default=200)
    ap.add_argument("--sft-seq-len", type=int, default=128)
    ap.add_argument("--sft-lr", type=float, default=1e-3)
    ap.add_argument("--their-variants", default="eager,compiled",
                    help="MiniMind runs: eager (its default) and/or compiled (its --use_compile 1); none: ours alone")
    ap.add_argument("--minimind-commit", help="the checkout's commit, where it has no .git (recorded)")
    ap.add_argument("--work", type=Path, help="scratch directory (default: a new temporary one)")
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, a 2-layer 64-wide model, a few hundred rows")
    a = ap.parse_args(argv)
    if a.smoke:
        a.pretrain_docs, a.sft_rows, a.dpo_rows, a.dpo_steps, a.eval_rows = 300, 200, 20, 2, 8
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    work = (a.work or Path(tempfile.mkdtemp(prefix="minimind-bench-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    minimind = a.minimind.expanduser().resolve()
    checkout = copy_checkout(minimind, work / "minimind")
    their_cfg = their_config(checkout, 64 if a.smoke else None, 2 if a.smoke else None)
    if their_cfg.head_dim * their_cfg.num_attention_heads != their_cfg.hidden_size or their_cfg.use_moe:
        raise SystemExit("this MiniMind default is not a dense model with head_dim = hidden / heads")
    from glm_lora.configs.load import load_config
    from glm_lora.data.tokenizer import load_tokenizer

    ours_yaml = work / "ours.yaml"
    ours_yaml.write_text(yaml.safe_dump(our_config(a, work, checkout, their_cfg, device.type)))
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    cli = [sys.executable, "-m", "glm_lora.flows.cli", "stage"]
    walls = {}

    def stage(name: str) -> None:
        walls[name] = sh([*cli, name, "--config", str(ours_yaml)], REPO, logs / f"ours-{name}.log")

    # ---- data and tokenizer first: both sides train on this data, tokenised by MiniMind's tokenizer
    stage("data")
    stage("tokenizer")
    cfg = load_config(str(ours_yaml))
    run_dir = cfg.run_dir
    tok = load_tokenizer(run_dir / "tokenizer")
    pre_tokens, sft_tokens = count_tokens(tok, run_dir / "data", a.sft_seq_len)
    pre_steps = max(2, round(pre_tokens / (THEIR_PRETRAIN["batch_size"] * THEIR_PRETRAIN["max_seq_len"]
                                           * OUR_PRETRAIN_ACCUM * 0.97)))
    sft_steps = max(2, round(sft_tokens / (THEIR_SFT["batch_size"] * a.sft_seq_len * 0.95)))
    config = yaml.safe_load(ours_yaml.read_text())
    config["pretrain"]["max_steps"], config["sft"]["max_steps"] = pre_steps, sft_steps
    ours_yaml.write_text(yaml.safe_dump(config))
    data_files = write_their_data(run_dir / "data", checkout / "dataset")
    figures = {"shape": {k: getattr(their_cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                            "num_key_value_heads", "head_dim", "intermediate_size",
                                                            "vocab_size", "tie_word_embeddings", "rope_theta")},
               "data": {"pretrain_docs": a.pretrain_docs, "pretrain_tokens_one_epoch": pre_tokens,
                        "sft_rows": a.sft_rows, "sft_tokens_one_epoch": sft_tokens},
               "peak_bf16_flops": matmul_peak(device)}
    print(json.dumps(figures), flush=True)

    # ---- MiniMind: pretrain, then full SFT from its pretrained weights (its defaults, one epoch each)
    common = {"hidden_size": their_cfg.hidden_size, "num_hidden_layers": their_cfg.num_hidden_layers, "epochs": 1,
              "num_workers": 2 if a.smoke else 8, "log_interval": 100, "save_interval": 10 ** 9,
              "save_dir": "../out", "device": "cpu" if device.type == "cpu" else "cuda:0"}
    theirs = {}
    pre_micro = math.ceil(a.pretrain_docs / THEIR_PRETRAIN["batch_size"])
    sft_micro = math.ceil(a.sft_rows / THEIR_SFT["batch_size"])
    for variant in [v for v in a.their_variants.split(",") if v not in ("", "none")]:
        extra = {"use_compile": int(variant == "compiled")}
        shutil.rmtree(checkout / "out", ignore_errors=True)
        p = run_theirs(checkout, "train_pretrain.py",
                       {**common, **THEIR_PRETRAIN, **extra, "data_path": data_files["pretrain"]},
                       work / f"theirs-{variant}-pretrain.json", tok.pad_token_id,
                       int(WARMUP_FRACTION * pre_micro / THEIR_PRETRAIN["accumulation_steps"]),
                       logs / f"theirs-{variant}-pretrain.log")
        s = run_theirs(checkout, "train_full_sft.py",
                       {**common, **THEIR_SFT, **extra, "max_seq_len": a.sft_seq_len, "data_path": data_files["sft"],
                        "from_weight": "pretrain"},
                       work / f"theirs-{variant}-sft.json", tok.pad_token_id, int(WARMUP_FRACTION * sft_micro),
                       logs / f"theirs-{variant}-sft.log")
        hidden = their_cfg.hidden_size
        p["eval"] = evaluate_theirs(cfg, run_dir, their_cfg, checkout, checkout / "out" / f"pretrain_{hidden}.pth",
                                    "pretrain", work / variant, device)
        s["eval"] = evaluate_theirs(cfg, run_dir, their_cfg, checkout, checkout / "out" / f"full_sft_{hidden}.pth",
                                    "sft", work / variant, device)
        theirs[variant] = {"pretrain": p, "sft": s, "wall_s_to_chat_model": p["wall_s"] + s["wall_s"]}
        (work / f"theirs-{variant}.json").write_text(json.dumps(theirs[variant], indent=1))

    # ---- ours: the DAG's stages from the tokenizer on (pretrain → SFT → DPO → export), one epoch each
    for name in ("pretrain", "sft", "dpo", "export"):
        stage(name)
        print(f"ours {name}: {walls[name]:.1f} s", flush=True)
    ours = {}
    for name, steps in (("pretrain", pre_steps), ("sft", sft_steps)):
        m = json.loads((run_dir / name / "manifest.json").read_text())["metrics"]
        ev = {k: v for k, v in m.get("eval", {}).items() if k != "samples"}
        ours[name] = {**steady(run_dir / name / "metrics.jsonl", steps), "optimizer_steps": steps,
                      "peak_gpu_memory_gb": m.get("peak_gpu_memory_gb"), "wall_s": walls[name], "eval": ev}
    ours["stage_wall_s"] = walls
    ours["wall_s_to_chat_model"] = sum(walls[k] for k in ("data", "tokenizer", "pretrain", "sft"))
    ours["wall_s_to_export"] = sum(walls.values())

    peak = figures["peak_bf16_flops"]
    for side in [ours, *theirs.values()]:
        for name, lora in (("pretrain", False), ("sft", side is ours)):     # our SFT trains a LoRA, theirs every weight
            seq = THEIR_PRETRAIN["max_seq_len"] if name == "pretrain" else a.sft_seq_len
            f = flops_per_token(their_cfg, seq, lora)
            side[name]["mfu"] = side[name]["tokens_per_s"] * f / peak if peak else None
    figures.update(ours=ours, minimind=theirs)
    if theirs:          # against MiniMind's fastest run of each
        best = max(theirs.values(), key=lambda t: t["pretrain"]["tokens_per_s"])
        figures["ratios"] = {
            "pretrain_tokens_per_s": ours["pretrain"]["tokens_per_s"] / best["pretrain"]["tokens_per_s"],
            "sft_tokens_per_s": ours["sft"]["tokens_per_s"] / max(t["sft"]["tokens_per_s"] for t in theirs.values()),
            "wall_to_chat_model": ours["wall_s_to_chat_model"] / min(t["wall_s_to_chat_model"] for t in theirs.values())}
    figures["minimind_commit"] = a.minimind_commit or _git_head(minimind)
    print(json.dumps(figures.get("ratios")), flush=True)
    if not a.smoke:
        print(write_result("minimind_gpu", figures))
    return figures


def _git_head(path: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
