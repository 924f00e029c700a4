"""The one typed schema for glm-lora configs; YAML presets in this folder fill it in.

Every field's default lives here and nowhere else. Unknown keys and bad values are
rejected with the dotted key and the allowed values named.
"""
from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator, PositiveFloat

LORA_STAGES = ("sft", "dpo", "rl")       # the adapter-training stages (engine/dist.py: DDP by default)
# vLLM's CPU attention backend supports only these head sizes (a server with another one starts,
# then dies on the first request).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Projection names of every supported layout (gate_up_proj: GLM's fused MLP input). Which of them a
# model has depends on its layout (model.arch or the base model): checked when LoRA is injected.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj",
                # mixture of experts (glm4_moe): the shared expert only, the routed experts only (per expert)
                "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj",
                "experts.gate_proj", "experts.up_proj", "experts.down_proj")
ALL_LINEAR = "all-linear"   # PEFT's term: every linear projection of the layout (not the output head)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value, info):
        """pydantic takes `true` as 1 for an int field; `max_steps: true` is a mistake, not a number."""
        if isinstance(value, bool):
            annotation = cls.model_fields[info.field_name].annotation
            if bool not in (typing.get_args(annotation) or (annotation,)):
                raise ValueError(f"expected a number, got {str(value).lower()}")
        return value


# The fixed prompts people see answered: the README's demo question (the served smoke test) and the
# side-by-side comparison. Their problems are held out of the synthetic training files (below).
DEMO_PROMPT = "What is 12 + 7?"
COMPARE_PROMPTS = [
    DEMO_PROMPT, "计算 45 + 38。", "What is 91 minus 17?", "计算 80 - 26。",
    'Copy the word "planet".', "请重复“山水”。", 'Spell "garden" in reverse order.',
    "请把“猫狗鱼”倒过来写。", "3 km = ? m", "2小时等于多少分钟？"]


class SyntheticData(Section):
    """The bundled generator (data/synthetic.py): bilingual corpus + SFT/DPO task sets."""

    seed: int = 0
    n_pretrain: int = Field(4000, ge=3)
    n_sft: int = Field(40000, ge=1)     # enough distinct rows that SFT generalises instead of memorising
    n_dpo: int = Field(4000, ge=1)
    n_eval: int = Field(200, ge=1)
    sft_weights: dict[str, PositiveFloat] = {}  # task family → share weight in the SFT file (default 1 each)
    # Prompts (in the task templates) whose problems no training file holds, in either language, so
    # answering them shows generalisation; default: the fixed prompts. Set it again if you change
    # eval.compare_prompts or serve.prompt (it is the data stage's key, they are not).
    held_out_prompts: list[str] = COMPARE_PROMPTS


class HoldoutConfig(Section):
    """Held-out rows taken from your own file for a split without its own `*_eval` path (data/holdout.py)."""

    fraction: float = Field(0.02, ge=0, le=0.2)   # of the split's good rows ...
    min_rows: int = Field(8, ge=0)                # ... but at least this many (at most eval.max_rows, a fifth of the split)
    seed: int = 0


class DataConfig(Section):
    """Paths to your own files; any left null comes from the synthetic generator.

    A split you supply without its `*_eval` file is evaluated on rows held out of the same file
    (`holdout`), never on the synthetic sets; those are used only with synthetic training data.
    """

    synthetic: SyntheticData = SyntheticData()
    pretrain: Path | None = None       # JSONL {"text"} or .txt
    pretrain_eval: Path | None = None
    sft: Path | None = None            # JSONL {"conversations": [{"role","content"}...]}
    sft_eval: Path | None = None
    dpo: Path | None = None            # JSONL {"chosen": [msgs], "rejected": [msgs]}
    dpo_eval: Path | None = None
    on_bad_row: Literal["error", "skip"] = "error"   # skip: count and report malformed rows
    dedup: bool = False                # drop exact duplicates
    min_tokens: int = Field(2, ge=1)   # drop shorter documents / conversations
    # SFT/DPO rows longer than seq_len: truncate_prompt cuts the prompt from the left (oldest turns, then the
    # start of the first message) and keeps the last answer whole (an answer too long alone is cut at its end);
    # truncate cuts the end; drop drops the row.
    overlong: Literal["truncate_prompt", "truncate", "drop"] = "truncate_prompt"
    # A longer JSONL/.txt line (or JSON array element, or string field of a Parquet/Arrow row) is a
    # bad row naming its place: memory stays bounded however large a row in the file is.
    max_line_bytes: int = Field(8 * 2**20, ge=1024, le=2**31 - 1)
    report_examples: int = Field(3, ge=0, le=100)   # dropped-row messages kept per reason in reports; 0 = none
    # A split that loses more than this fraction of its rows (any reason: bad_row, empty, duplicate, overlong,
    # no_target, min_tokens...) fails the stage, with the counts by reason; 1 = never.
    max_drop_fraction: float = Field(0.2, ge=0.0, le=1.0)
    holdout: HoldoutConfig = HoldoutConfig()


class TokenizerConfig(Section):
    vocab_size: int = Field(2000, ge=300)


class ModelConfig(Section):
    """Decoder shape and layout; maps 1:1 onto the transformers class of `arch` (see model/hf.py)."""

    # Layout, named by HF model_type: llama; qwen2 (+ q/k/v bias); qwen3 (+ per-head q/k RMSNorm, which
    # bounds attention logits); glm (GlmForCausalLM: q/k/v bias, fused gate_up_proj, GLM's interleaved RoPE
    # on half of each head); glm4 (Glm4ForCausalLM, GLM-4-0414: glm + a norm after attention and after the MLP).
    arch: Literal["llama", "qwen2", "qwen3", "glm", "glm4"] = "llama"   # = model/model.py LAYOUTS
    vocab_size: int | None = None      # None: taken from the tokenizer
    hidden_size: int = Field(192, ge=8)
    num_layers: int = Field(3, ge=1)
    num_heads: int = Field(6, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(512, ge=8)
    max_seq_len: int = Field(512, ge=16)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @model_validator(mode="before")
    @classmethod
    def _qk_norm_is_arch(cls, data):
        if isinstance(data, dict) and "qk_norm" in data:
            raise ValueError("model.qk_norm was replaced by model.arch (qk_norm: true is arch: qwen3)")
        return data

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads ({self.num_kv_heads})")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("model.hidden_size / model.num_heads (head dim) must be even for RoPE")
        if self.arch in ("glm", "glm4") and (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"model.arch {self.arch} rotates pairs in half of each head: model.hidden_size / "
                             "model.num_heads (head dim) must be divisible by 4")
        return self


class LoRAConfig(Section):
    r: int = Field(16, ge=1)
    alpha: float = 32.0
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # "all-linear": every linear projection of the model's layout; or names from LORA_TARGETS, which the
    # model must have (checked at injection: gate_up_proj exists only in GLM layouts, gate_proj/up_proj only in others).
    target_modules: list[str] | Literal["all-linear"] = ALL_LINEAR
    b_lr_ratio: float = Field(1.0, gt=0)   # LoRA+: B's learning rate = this × lr (1 = plain LoRA)
    # Trained in full beside the adapter and saved with it (PEFT's modules_to_save); "gate": a MoE model's
    # router (GLM-4.5's mlp.gate), frozen unless named here.
    modules_to_save: list[Literal["embed_tokens", "lm_head", "gate"]] = []
    # QLoRA: "nf4" keeps the frozen base weight of each target layer in 4 bits (bitsandbytes' NF4 with
    # double-quantised scales, ~0.52 byte a weight instead of 2-4) and dequantises it for every use; the
    # adapter stays in the model's dtype. Merging and export use the dequantised base. model/quant.py.
    quantization: Literal["none", "nf4"] = "none"

    @field_validator("target_modules", mode="before")
    @classmethod
    def _known_targets(cls, targets):
        if isinstance(targets, str) and targets != ALL_LINEAR:
            raise ValueError(f"got {targets[:100]!r}; expected {ALL_LINEAR!r} or a list from {list(LORA_TARGETS)}")
        if isinstance(targets, (list, tuple)):
            bad = [t for t in targets if t not in LORA_TARGETS]
            if bad or not targets:
                raise ValueError(f"unknown {bad or '(empty)'}; allowed: {list(LORA_TARGETS)} or {ALL_LINEAR!r}")
        return targets


class TrainConfig(Section):
    """One training stage's loop settings (the engine is shared by all stages).

    A micro-batch is `batch_size` rows of `seq_len` tokens; with packing each row holds as many
    whole documents as fit, so the token budget per micro-batch is batch_size × seq_len. One optimizer
    step takes batch_size × grad_accum × world size rows (world size: `dist`, one process by default).
    """

    max_steps: int = Field(100, ge=1)
    batch_size: int = Field(8, ge=1)    # rows per micro-batch, per process
    grad_accum: int = Field(1, ge=1)
    # Rows per optimizer step over all processes; when set, grad_accum is derived from it:
    # global_batch_size / (batch_size × world size), which must divide (grad_accum is then left at 1).
    global_batch_size: int | None = Field(None, ge=1)
    seq_len: int = Field(128, ge=8)
    lr: float = Field(1e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, ge=0)   # 0 disables clipping
    log_every: int = Field(10, ge=1)
    seed: int = 0
    packing: bool = True    # several documents per row (block-diagonal attention); False = padded rows
    prefetch: int = Field(2, ge=0)   # batches built ahead in a background thread; 0 = inline
    nonfinite: Literal["stop", "skip"] = "stop"   # NaN/inf loss: stop the stage, or skip the batch (counted)
    activation_checkpointing: bool = False   # recompute each decoder block in backward (less memory, more compute)
    # torch.compile the training forward/backward (engine/compile.py): on the CPU 1.34-1.52x the steps/s of the
    # tiny SFT step after a one-off ~24 s compile on 2 cores (cached per user: ~/.cache/glm-lora/inductor); on CUDA
    # 1.38x the 125M pretraining step, 1.48x with "max-autotune" (inductor times its GEMM templates), not at 1B.
    # Eager with a warning where there is no C++ compiler (CPU) and under torchrun. Same learning up to rounding.
    # "auto": compile only a CPU stage of at least engine.compile.PAYBACK_STEPS steps (where a compile pays back).
    compile: bool | Literal["auto", "max-autotune"] = False
    # Replay the blocks' training forward/backward as CUDA graphs (engine/cuda_graphs.py): for a small model on a fast
    # GPU, whose step waits on the host's kernel launches (125M LoRA SFT on an H100: 78 -> 44 ms). One process, CUDA,
    # no gradient accumulation or activation checkpointing; eager with a warning elsewhere. Not with compile true.
    cuda_graphs: bool = False
    # Validation loss on the stage's held-out split every eval_every steps (0 = off). When on, the
    # weights with the best validation loss (not the last) are what the stage saves.
    eval_every: int = Field(0, ge=0)
    patience: int = Field(0, ge=0)        # stop after this many validations without improvement; 0 = never
    min_delta: float = Field(0.0, ge=0)   # an improvement must lower the validation loss by more than this
    # Mixture-of-experts models: weight of DeepSeek-V3's load-balance loss added to the stage's loss; 0 = off
    # (the default: under LoRA the router is frozen). Router health is reported either way (engine/router_stats.py).
    router_aux_loss: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _one_graph_maker(self):
        if self.cuda_graphs and self.compile in (True, "max-autotune"):
            raise ValueError(f"cuda_graphs: true with compile: {self.compile!r}: choose one (cuda_graphs captures "
                             "the eager blocks; a compiled graph would be captured inside it)")
        return self


class SFTConfig(TrainConfig):
    lora: LoRAConfig = LoRAConfig()


class DPOConfig(TrainConfig):
    """The preference stage: a fresh LoRA on the SFT model, trained with `loss` (engine/losses.py)."""

    lora: LoRAConfig = LoRAConfig()
    # dpo: DPO's sigmoid loss; ipo: IPO's squared loss; simpo, orpo: reference-free (no reference forward: the
    # stage runs one forward per step instead of two); kto: KTO on unpaired rows, each answer labelled desirable or
    # not ({"prompt" or "messages", "completion", "label": true/false} in data.dpo; pairs there are unpaired).
    loss: Literal["dpo", "ipo", "simpo", "orpo", "kto"] = "dpo"
    beta: float = Field(0.1, gt=0)        # β of every loss but ORPO (SimPO's paper uses 2–2.5, KTO's 0.1)
    nll_weight: float = Field(1.0, ge=0)   # chosen-answer NLL term; 0 = pure DPO (see NOTES: pure DPO wrecked generation).
    #                                        ORPO has its own (its L_SFT, weight 1) and ignores this
    simpo_gamma: float = Field(0.5, ge=0)  # SimPO's target reward margin γ
    orpo_lambda: float = Field(0.1, gt=0)  # ORPO's λ: weight of the odds-ratio term beside the chosen NLL
    kto_desirable_weight: float = Field(1.0, gt=0)     # KTO's λ_D and λ_U: weigh them so that λ_D·n_D ≈ λ_U·n_U
    kto_undesirable_weight: float = Field(1.0, gt=0)   # (to 4/3 of it, the paper says)
    # Packed rows place a pair's common prompt once, both answers attending to it: the same log-probs from fewer
    # tokens, so more pairs fit a batch's rows (data/packing.py). Off: each answer repeats its prompt.
    share_prompt: bool = True

    @model_validator(mode="after")
    def _reference_stays_frozen(self):
        if self.lora.modules_to_save:
            raise ValueError("dpo.lora.modules_to_save must be empty: DPO's reference is the same weights with the "
                             "adapter switched off, so fully trained modules would move the reference too")
        return self


class RLConfig(TrainConfig):
    """The optional online RL stage `rl` (GRPO, engine/rl.py): a fresh LoRA on the DPO model (the SFT model with
    dpo off), trained on its own sampled answers to the SFT prompts, scored by reward functions.

    Each optimizer step draws `batch_size` prompts, samples `group_size` answers to each (temperature sampling with
    a KV cache, seeded by step: a resumed stage draws the same answers), scores them with `rewards` and normalises
    each group's summed reward to advantages (r − mean) / (std + 1e-4); the loss is GRPO's clipped-ratio objective
    with one update per rollout (the ratio is 1, so the step is the policy gradient with those advantages), plus
    `kl_beta` times the k3 estimate of KL to the reference (the same weights with this adapter off)."""

    enabled: bool = False                 # off in the tiny default; on: the DAG runs it after dpo and exports it
    lora: LoRAConfig = LoRAConfig()
    group_size: int = Field(8, ge=2)      # answers sampled per prompt (G)
    max_new_tokens: int = Field(24, ge=1)
    temperature: float = Field(1.0, gt=0)
    # Reward functions, summed: built-ins (engine/rewards.py: exact_match, format) or "package.module:function",
    # called as fn(completion, reference=..., prompt=..., task=..., finished=...) -> float.
    rewards: list[str] = Field(["exact_match"], min_length=1)
    families: list[str] = []              # sample prompts of these task families only ("task" field); [] = all
    # The prompts to sample answers to: a JSONL file in any SFT format (chat / ShareGPT / Alpaca rows), the last
    # assistant message of each row the reference the rewards see, an optional "task" field; null = the SFT split.
    prompts: Path | None = None
    clip_epsilon: float = Field(0.2, gt=0, lt=1)
    kl_beta: float = Field(0.0, ge=0)     # 0: no KL term and no reference forward (DAPO, Dr. GRPO drop it too)
    # grpo: each answer's mean token loss, averaged over answers (the paper); token: every answer token weighs the
    # same over the whole batch (DAPO's token-level loss: long answers are not under-weighted).
    loss_type: Literal["grpo", "token"] = "grpo"
    # Train each rollout's batch_size × group_size answers in this many equal micro-batches, gradients accumulated:
    # the same update with 1/train_chunks of the training activations (sampling stays one batch, which is what
    # keeps it fast). Memory, not speed: with activation_checkpointing it is what brings the stage's peak down.
    train_chunks: int = Field(1, ge=1)
    # Who samples the answers: ours (engine/evaluate.sample_decode, in the training process) or vllm (a vLLM server
    # beside the trainer, the adapter loaded into it after every update: engine/vllm_rollouts.py; one process only).
    sampler: Literal["ours", "vllm"] = "ours"
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, lt=1)   # vLLM's share of the GPU it shares with training

    @model_validator(mode="after")
    def _online(self):
        if (self.batch_size * self.group_size) % self.train_chunks:
            raise ValueError(f"rl.train_chunks ({self.train_chunks}) must divide rl.batch_size × rl.group_size "
                             f"({self.batch_size} × {self.group_size}): the answers are split into equal parts")
        if self.eval_every:
            raise ValueError("rl.eval_every must be 0: the RL stage has no held-out loss (its held-out view is the "
                             "exact match after training, eval.enabled)")
        if self.lora.modules_to_save:
            raise ValueError("rl.lora.modules_to_save must be empty: the KL reference is the same weights with the "
                             "adapter switched off")
        return self


class CheckpointConfig(Section):
    """Training checkpoints under runs/<run>/checkpoints/<stage>-<config hash>/ (see engine/checkpoint.py)."""

    save_every: int = Field(100, ge=0)             # weights + RNG + data position; 0 = only on SIGTERM/SIGINT
    save_optimizer_every: int = Field(100, ge=1)   # optimizer state too (exact resume needs it)
    keep_last: int = Field(2, ge=1)
    async_save: bool = True                        # compress + write in a background thread
    resume: Literal["auto", "never"] = "auto"      # auto: continue from the newest verified checkpoint


class ExportConfig(Section):
    """What the export writes besides the Hugging Face + PEFT directories."""

    # GGUF files of the final model for llama.cpp / Ollama / LM Studio (stage `gguf`, export/gguf.py): any of
    # f32, f16, bf16, q8_0 (written by gguf) and q4_0, q4_k_m, q5_k_m, q6_k (llama.cpp's quantizer); [] = none
    gguf: list[str] = []


class HarnessConfig(Section):
    """Standard benchmarks: lm-evaluation-harness (`lm_eval`, the `harness` extra) on the exported model, in the
    stage `harness` after export (engine/harness.py). Nothing is downloaded: tasks come from the shipped folder
    (engine/harness_tasks: glm_lora_arithmetic, glm_lora_strings, over the run's held-out synthetic rows), from
    `include_path`, or from lm_eval's own tasks whose datasets are already in the local Hugging Face cache."""

    tasks: list[str] = []                 # task, group or tag names; [] = no harness stage
    include_path: list[Path] = []         # your task folders (YAML + data files), as lm_eval's --include_path
    limit: int | None = Field(None, ge=1)            # samples per task (None: all)
    num_fewshot: int | None = Field(None, ge=0)      # None: each task's own
    batch_size: int = Field(8, ge=1)
    chat_template: bool = True            # prompts through the model's chat template (our exports are chat models)
    # Score export/base too: serve.gate.harness compares with it where the served model has no score (first promotion)
    base: bool = True

    @field_validator("tasks")
    @classmethod
    def _names(cls, tasks: list[str]) -> list[str]:
        if any(not t.strip() for t in tasks) or len(set(tasks)) != len(tasks):
            raise ValueError(f"expected distinct, non-empty task names, got {tasks}")
        return tasks


class EvalConfig(Section):
    """Held-out evaluation after each training stage (engine/evaluate.py), on the *_eval splits."""

    enabled: bool = True
    max_rows: int = Field(200, ge=1)        # rows per eval split
    max_new_tokens: int = Field(24, ge=1)   # greedy answer length for exact match
    compare_prompts: list[str] = COMPARE_PROMPTS   # answered by the pretrain, SFT and DPO models side by side
    harness: HarnessConfig = HarnessConfig()


class GateConfig(Section):
    """Promotion gate before serving: metric names are <stage>.<metric> (e.g. sft.exact_match)."""

    min: dict[str, float] = {}                              # thresholds (maximum for loss-like metrics)
    no_regression: list[str] = ["dpo.exact_match", "dpo.implicit_reward_accuracy"]   # vs the served model
    tolerance: float = Field(0.0, ge=0)
    # lm-evaluation-harness task (from eval.harness.tasks) → min_delta: the candidate's score must be ≥ the served
    # model's + min_delta (negative: that much loss is allowed); where the served model has none, export/base's
    harness: dict[str, float] = {}


class ServeConfig(Section):
    """The served endpoint (serve/deploy.py): nginx on host:port in front of the live vLLM server; a new
    export is started beside it on a free loopback port, tested, then switched to (README "Serving")."""

    enabled: bool = True
    # Where the stable endpoint listens (the vLLM servers behind it always listen on 127.0.0.1 only).
    # An address other than loopback needs an API key.
    host: str = "127.0.0.1"
    port: int = Field(8765, ge=1024, le=65535)
    keep_running: bool = True            # false: start, test and stop the candidate; the endpoint is untouched
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_model_len: int = Field(512, ge=16)
    kv_cache_bytes: int = Field(256 * 2**20, ge=2**20)     # vLLM's KV cache on the CPU build
    startup_timeout_s: int = Field(300, ge=10)
    prompt: str = DEMO_PROMPT            # the smoke test's question: greedy parity with our own decoder
    max_tokens: int = Field(32, ge=1)
    # Serve the SFT model and the DPO adapter under their own names beside the final model, on one server
    # (<run>, <run>-sft, <run>-dpo); false: only the merged final model (no LoRA work per token).
    adapters: bool = True
    drain_timeout_s: int = Field(120, ge=1)   # a switch waits this long for the old server's requests
    keep_exports: int = Field(3, ge=1)        # earlier served exports kept in serving/exports/ for rollback
    # CUDA build of vLLM only (refused on the CPU build): GPUs per server; its share of each GPU's memory
    # (unset: 0.45, so the candidate fits beside the live server during a promotion).
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    max_num_seqs: int | None = Field(None, ge=1)   # concurrent sequences per server (unset: vLLM's default)
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 512] | None = None   # unset: the smallest that fits
    gate: GateConfig = GateConfig()
    # The endpoint's API key, by name only (its value never enters configs, manifests or logs): an
    # environment variable, or a Prefect Secret block. Unset: no key (README "Security").
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    api_key_secret: str | None = None

    @field_validator("host")
    @classmethod
    def _ip_address(cls, host: str) -> str:
        import ipaddress
        try:
            return str(ipaddress.ip_address(host))
        except ValueError:
            raise ValueError(f"{host[:100]!r} is not an IP address (e.g. 127.0.0.1, or 0.0.0.0 for every interface)") from None

    @model_validator(mode="after")
    def _one_key_source(self):
        import ipaddress
        if self.api_key_env and self.api_key_secret:
            raise ValueError("set one of serve.api_key_env and serve.api_key_secret, not both")
        if not ipaddress.ip_address(self.host).is_loopback and not (self.api_key_env or self.api_key_secret):
            raise ValueError(f"serve.host {self.host} is reachable from other machines: set serve.api_key_env or "
                             "serve.api_key_secret too")
        return self


class DistConfig(Section):
    """Processes per training stage, started by torchrun (engine/dist.py, README "More than one GPU").

    World size = nproc_per_node × nnodes; with one process (the default) a stage runs in-process as always.
    """

    nproc_per_node: Literal["auto"] | Annotated[int, Field(ge=1)] = 1   # auto: the visible CUDA GPUs (1 on CPU)
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)                # this machine's place among the nnodes
    rdzv_endpoint: str = Field("127.0.0.1:29500", pattern=r"^\S+:\d{1,5}$")   # host:port of node 0 (multi-node)
    strategy: Literal["auto", "ddp", "fsdp2"] = "auto"   # auto: fsdp2 for pretraining, ddp for the LoRA stages
    launcher: Literal["auto", "torchrun"] = "auto"   # auto: torchrun when world size > 1; torchrun: always

    @model_validator(mode="after")
    def _node_rank_in_range(self):
        if self.node_rank >= self.nnodes:
            raise ValueError(f"dist.node_rank ({self.node_rank}) must be below dist.nnodes ({self.nnodes})")
        return self


class TrackingConfig(Section):
    """Experiment tracking (tasks/tracking.py, README "Experiment tracking"), off by default. `mlflow`: each flow run
    is one MLflow run (the config as params, every stage's metrics by step, its reports and model cards, the Prefect
    flow-run id) and an export that passes the serve stage is registered in MLflow's model registry. No stage's cache
    key holds it. `tracking: mlflow` is short for `tracking: {backend: mlflow}`."""

    backend: Literal["none", "mlflow"] = "none"
    # Any URI MLflow takes: a server's URL (http://127.0.0.1:5000), a database (sqlite:///abs/path.db). Unset: the
    # local store sqlite:///<runs_dir>/mlflow.db, its artifacts in <runs_dir>/mlartifacts/.
    tracking_uri: str | None = Field(None, min_length=1)
    experiment_name: str | None = Field(None, min_length=1)         # unset: run_name
    # unset: run_name; no quotes (the name goes into a registry search)
    registered_model_name: str | None = Field(None, pattern=r"^[^'\"\\]+$")
    # Register the served export's final model (merged/): its files are uploaded as the run's `model` artifact, a copy
    # the size of the weights (once per export digest); false: metrics and reports only.
    register_model: bool = True

    @model_validator(mode="before")
    @classmethod
    def _backend_shorthand(cls, data):
        return {"backend": data} if isinstance(data, str) else data

    @field_validator("tracking_uri")
    @classmethod
    def _no_password(cls, uri: str | None) -> str | None:
        """The config goes into every manifest and into MLflow's params: a password in it would be everywhere."""
        from urllib.parse import urlsplit
        if uri is not None and urlsplit(uri).password is not None:
            raise ValueError("holds a password: set MLflow's MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
                             "(or MLFLOW_TRACKING_TOKEN) in the environment instead")
        return uri


def derived_grad_accum(tc: TrainConfig, key: str, world_size: int) -> int:
    """Micro-batches per optimizer step for the section `key` (e.g. "sft") on `world_size` processes:
    grad_accum, or global_batch_size / (batch_size × world_size) when global_batch_size is set.
    Raises ValueError naming the keys when the numbers don't divide or grad_accum is set too."""
    if tc.global_batch_size is None:
        return tc.grad_accum
    if tc.grad_accum != 1:
        raise ValueError(f"{key}.grad_accum ({tc.grad_accum}) is derived from {key}.global_batch_size "
                         f"({tc.global_batch_size}); set one of them, not both")
    per_step = tc.batch_size * world_size
    if tc.global_batch_size % per_step:
        raise ValueError(f"{key}.global_batch_size ({tc.global_batch_size}) is not a multiple of {key}.batch_size "
                         f"({tc.batch_size}) × world size ({world_size} = dist.nproc_per_node × dist.nnodes); "
                         f"change {key}.global_batch_size or {key}.batch_size")
    return tc.global_batch_size // per_step


class Config(Section):
    run_name: str = "tiny"             # names the directory runs_dir/run_name
    runs_dir: Path = Path("runs")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"   # auto: bf16 on CUDA and on CPUs with AMX or AVX512-BF16, else fp32
    kernels: Literal["auto", "reference", "triton"] = "auto"       # fused Triton ops or torch: kernels/__init__.py
    attention: Literal["auto", "sdpa", "flex", "varlen"] = "auto"            # packed-row attention: kernels/__init__.py
    threads: int | None = None                                       # torch CPU threads; None = torch default
    base_model: Path | None = None    # local HF dir (Llama, Qwen2/3, GLM, GLM-4 layouts): skip tokenizer + pretrain
    data: DataConfig = DataConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    pretrain: TrainConfig = TrainConfig()
    sft: SFTConfig = SFTConfig()
    dpo: DPOConfig = DPOConfig(lr=5e-5)
    rl: RLConfig = RLConfig(lr=2e-4, batch_size=8, prefetch=0)
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    export: ExportConfig = ExportConfig()
    serve: ServeConfig = ServeConfig()
    dist: DistConfig = DistConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _batch_math(self):
        """global_batch_size must divide into micro-batches; with nproc_per_node "auto" the world size is only
        known where the stage runs (engine.dist.check, from preflight and from each process)."""
        d = self.dist
        world = d.nproc_per_node * d.nnodes if isinstance(d.nproc_per_node, int) else 1
        stages = (("sft", self.sft), ("dpo", self.dpo)) if self.base_model else (
            ("pretrain", self.pretrain), ("sft", self.sft), ("dpo", self.dpo))
        for key, tc in stages:
            derived_grad_accum(tc, key, world)
        return self

    @model_validator(mode="after")
    def _quantized_base_is_replicated(self):
        """The 4-bit base is neither parameter nor buffer: FSDP2 would not shard it and could not gather it."""
        if self.dist.strategy == "fsdp2":
            for key, tc in (("sft", self.sft), ("dpo", self.dpo)):
                if tc.lora.quantization != "none":
                    raise ValueError(f"{key}.lora.quantization {tc.lora.quantization} keeps the base weights out of the "
                                     "parameters FSDP2 shards: set dist.strategy to ddp or auto")
        return self

    @model_validator(mode="after")
    def _servable(self):
        head_dim = self.model.hidden_size // self.model.num_heads
        if self.serve.enabled and self.device == "cpu" and self.base_model is None and head_dim not in VLLM_CPU_HEAD_SIZES:
            raise ValueError(f"model.hidden_size / model.num_heads = {head_dim} is not a head size vLLM's CPU backend "
                             f"serves {list(VLLM_CPU_HEAD_SIZES)}; change model.num_heads or set serve.enabled: false")
        return self

    @model_validator(mode="after")
    def _gated_tasks_are_run(self):
        missing = [t for t in self.serve.gate.harness if t not in self.eval.harness.tasks]
        if missing:
            raise ValueError(f"serve.gate.harness names {missing}, which eval.harness.tasks ({self.eval.harness.tasks}) "
                             "does not run: add them there")
        return self

    @field_validator("run_name")
    @classmethod
    def _one_directory_name(cls, name: str) -> str:
        # "." or ".." would name the runs dir itself or its parent: publishing would replace those.
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name):
            raise ValueError(f"{name[:100]!r} must start with a letter or digit and hold only letters, digits, "
                             "'.', '_' and '-' (at most 100): it names one directory under runs_dir")
        return name

    @model_validator(mode="after")
    def _lengths_fit_the_model(self):
        """Rows longer than the model's positions would fail (or silently wrap RoPE) mid-training.
        A base model's own limit is checked when its config.json is read (engine/preflight.py)."""
        if self.base_model is None:
            limit = self.model.max_seq_len
            for key, value in (("pretrain.seq_len", self.pretrain.seq_len), ("sft.seq_len", self.sft.seq_len),
                               ("dpo.seq_len", self.dpo.seq_len), ("serve.max_model_len", self.serve.max_model_len)):
                if value > limit and (key != "serve.max_model_len" or self.serve.enabled):
                    raise ValueError(f"{key} ({value}) exceeds model.max_seq_len ({limit}); lower it or raise "
                                     "model.max_seq_len")
        return self

    @property
    def run_dir(self) -> Path:
        return (self.runs_dir / self.run_name).resolve()

    def stage_dir(self, stage: str) -> Path:
        """Where a stage's artifact is published: runs/<run_name>/<stage>/."""
        return self.run_dir / stage
