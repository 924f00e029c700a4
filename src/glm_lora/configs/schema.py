"""The one typed schema for glm-lora configs; YAML presets in this folder fill it in.

Every field's default and its user-facing description live here and nowhere else (docs/config.md and
`glm-lora config KEY` are generated from them: configs/reference.py). Unknown keys and bad values are
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
                "experts.gate_proj", "experts.up_proj", "experts.down_proj",
                # multi-head latent attention (glm4_moe_lite, glm_moe_dsa): the query latent, the key / value latent
                "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                # gated DeltaNet (qwen3_5_text, qwen3_5_moe_text): its input projections and output; Qwen's shared expert
                "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
# GLM-5's DSA indexer projections: frozen (they only choose keys, without gradients), never a target.
INDEXER_PROJECTIONS = ("wq_b", "wk", "weights_proj")
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
    """A bilingual (English / Chinese) corpus and SFT / DPO task sets (arithmetic, unit conversion, copying and
    reversing strings), used for every split you leave null under `data`."""

    seed: int = Field(0, description="Seed of the generator: the same seed gives the same files.")
    n_pretrain: int = Field(4000, ge=3, description="Pretraining documents generated.")
    n_sft: int = Field(40000, ge=1, description="SFT conversations generated: enough distinct rows that SFT "
                                                "generalises instead of memorising.")
    n_dpo: int = Field(4000, ge=1, description="DPO preference pairs generated.")
    n_eval: int = Field(200, ge=1, description="Rows of each held-out evaluation set.")
    sft_weights: dict[str, PositiveFloat] = Field(
        {}, description="Task family → its share of the SFT file, as a weight (families not named weigh 1), e.g. "
                        "`{add_en: 3, add_zh: 3}`. Families: add_en, add_zh, sub_en, sub_zh, copy_en, copy_zh, "
                        "reverse_en, reverse_zh, units_en, units_zh. The evaluation sets stay balanced.")
    held_out_prompts: list[str] = Field(
        COMPARE_PROMPTS, description="Prompts (phrased as in the task templates) whose problems no training file "
                                     "holds, in either language, so that a right answer shows generalisation. "
                                     "Default: the compared prompts. It does not follow eval.compare_prompts or "
                                     "serve.prompt: set it again when you change those.")


class HoldoutConfig(Section):
    fraction: float = Field(0.02, ge=0, le=0.2, description="Fraction of the split's good rows held out: at least "
                                                            "min_rows, at most eval.max_rows and a fifth of the "
                                                            "split.")
    min_rows: int = Field(8, ge=0, description="Rows held out at least, however small the fraction (still at most "
                                               "eval.max_rows and a fifth of the split).")
    seed: int = Field(0, description="Seed of the choice of held-out rows.")


def _eval_file(split: str, rows: str):
    return Field(None, description=f"Held-out {rows}, in the formats of data.{split}. null: rows held out of "
                                   f"data.{split} (data.holdout), or the synthetic set where data.{split} is null.")


class DataConfig(Section):
    """Paths to your own files; any left null comes from the synthetic generator (`data.synthetic`).

    A file may be JSON Lines (`.jsonl`), a JSON array (`.json`), plain text (`.txt`, pretraining only: one document
    a line), Parquet, Arrow, or a directory written by `datasets`' `save_to_disk`. A split you supply without its
    `*_eval` file is evaluated on rows held out of the same file (`data.holdout`), never on the synthetic sets;
    those are used only with synthetic training data.
    """

    synthetic: SyntheticData = Field(SyntheticData(), description="The bundled synthetic data generator.")
    pretrain: Path | None = Field(None, description='Pretraining documents: rows `{"text": ...}`, or a `.txt` file '
                                                    "with one document a line. null: synthetic.")
    pretrain_eval: Path | None = _eval_file("pretrain", "pretraining documents")
    sft: Path | None = Field(None, description='SFT conversations: rows `{"conversations": [{"role", "content"}, '
                                               '...]}` (or "messages"), ShareGPT `{"from", "value"}` messages, or '
                                               "Alpaca `instruction` / `input` / `output`; each ends with the "
                                               "assistant's answer. null: synthetic.")
    sft_eval: Path | None = _eval_file("sft", "SFT conversations")
    dpo: Path | None = Field(None, description='Preference pairs: rows `{"chosen": [messages], "rejected": '
                                               '[messages]}` that differ only in the last answer, or `{"prompt", '
                                               '"chosen", "rejected"}` (TRL). With dpo.loss kto: unpaired rows '
                                               '`{"prompt" or "messages", "completion", "label": true/false}`. '
                                               "null: synthetic.")
    dpo_eval: Path | None = _eval_file("dpo", "preference rows")
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="A malformed row: error fails the stage naming the file, row and field; skip counts it "
                             "in the stage's report and goes on.")
    dedup: bool = Field(False, description="Drop exact duplicate rows.")
    min_tokens: int = Field(2, ge=1, description="Drop documents and conversations shorter than this many tokens.")
    overlong: Literal["truncate_prompt", "truncate", "drop"] = Field(
        "truncate_prompt", description="SFT / DPO rows longer than the stage's seq_len: truncate_prompt cuts the "
                                       "prompt from the left (oldest turns first, then the start of the first "
                                       "message) and keeps the last answer whole (an answer too long alone is cut "
                                       "at its end); truncate cuts the end; drop drops the row.")
    max_line_bytes: int = Field(
        8 * 2**20, ge=1024, le=2**31 - 1,
        description="Longest row in bytes: a longer JSONL / .txt line, JSON array element, or string field of a "
                    "Parquet / Arrow row is a bad row naming its place, so memory stays bounded however large a row "
                    "in the file is.")
    report_examples: int = Field(3, ge=0, le=100, description="Dropped-row messages kept per reason in the stage's "
                                                              "report; 0: none.")
    max_drop_fraction: float = Field(
        0.2, ge=0.0, le=1.0,
        description="Fail the stage, with the counts by reason, when a split loses more than this fraction of its "
                    "rows for any reason (bad_row, empty, duplicate, overlong, no_target, min_tokens...); 1: never.")
    holdout: HoldoutConfig = Field(HoldoutConfig(), description="Rows held out of your own file for evaluation, for "
                                                                "a split you supply without its `*_eval` file.")


class TokenizerConfig(Section):
    vocab_size: int = Field(2000, ge=300, description="Vocabulary size; an upper bound where the corpus has fewer "
                                                      "distinct pieces. Not used with path.")
    path: Path | None = Field(
        None, description="A tokenizer you already have, to pretrain with instead of training one: a local directory "
                          "of Hugging Face tokenizer files (tokenizer.json or tokenizer.model, tokenizer_config.json "
                          "with a chat_template, or chat_template.jinja), e.g. MiniMind's `model/` or a Llama / Qwen "
                          "model's. Its files are copied into the run; the model's vocabulary is its size. null: "
                          "train a BPE on the pretraining text.")


class ModelConfig(Section):
    arch: Literal["llama", "qwen2", "qwen3", "glm", "glm4"] = Field(
        "llama", description="Layout, named by Hugging Face model_type: llama; qwen2 (llama + q/k/v bias); qwen3 "
                             "(llama + per-head q/k RMSNorm, which bounds attention logits); glm (GlmForCausalLM: "
                             "q/k/v bias, fused gate_up_proj, GLM's interleaved RoPE on half of each head); glm4 "
                             "(Glm4ForCausalLM: glm + a norm after attention and after the MLP).")
    vocab_size: int | None = Field(None, description="Embedding rows; null: the tokenizer's vocabulary size.")
    hidden_size: int = Field(192, ge=8, description="Width of the residual stream; divisible by num_heads.")
    num_layers: int = Field(3, ge=1, description="Decoder blocks.")
    num_heads: int = Field(6, ge=1, description="Attention (query) heads. The head size, hidden_size / num_heads, "
                                                "must be even (divisible by 4 for glm and glm4), and one that "
                                                "vLLM's CPU backend serves when serving on the CPU.")
    num_kv_heads: int = Field(2, ge=1, description="Key / value heads (grouped-query attention); divides num_heads.")
    intermediate_size: int = Field(512, ge=8, description="Width of the MLP's hidden layer.")
    max_seq_len: int = Field(512, ge=16, description="Longest sequence in tokens; every stage's seq_len and "
                                                     "serve.max_model_len must fit in it.")
    rope_theta: float = Field(10000.0, description="RoPE base frequency.")
    rms_norm_eps: float = Field(1e-5, description="Epsilon of the RMSNorm layers.")
    tie_embeddings: bool = Field(False, description="Share one matrix between the input embeddings and the output "
                                                    "head.")
    mtp_layers: int = Field(
        0, ge=0, le=1, description="1: a multi-token prediction (MTP) layer beside the decoder, as GLM and DeepSeek-V3 "
                                   "have: from the last hidden state and the next token's embedding it predicts the "
                                   "token after next (a draft for speculative decoding). Pretraining trains it "
                                   "(pretrain.mtp_weight); fine-tuning carries or trains it (sft.mtp, dpo.mtp) and "
                                   "reports its draft acceptance. It stays in the native checkpoints: these layouts' "
                                   "transformers and vLLM classes have no MTP layer, so the export leaves it out.")

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
    """A LoRA adapter: its rank and scale, which projections it adapts, what else is trained in full."""

    r: int = Field(16, ge=1, description="Rank of the adapter's matrices: capacity, and its size and compute.")
    alpha: float = Field(32.0, description="Scale: the adapter's update is multiplied by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        ALL_LINEAR, description="The projections adapted: all-linear (every linear projection of the model's layout, "
                                "not the output head), or a list of names: " + ", ".join(LORA_TARGETS) + ". The "
                                "model must have them (gate_up_proj exists only in the GLM layouts, gate_proj and "
                                "up_proj only in the others; shared_experts.* and experts.* only in mixture-of-"
                                "experts models; q_a_proj, q_b_proj, kv_a_proj_with_mqa and kv_b_proj only with "
                                "latent attention, GLM-4.7-Flash and GLM-5; in_proj_* and out_proj only in Qwen3.5's "
                                "gated DeltaNet layers, shared_expert.* in its MoE): checked when the adapter is added. "
                                "GLM-5's DSA indexer is never adapted.")
    b_lr_ratio: float = Field(1.0, gt=0, description="LoRA+: the B matrices' learning rate is this × lr; 1: plain "
                                                     "LoRA.")
    modules_to_save: list[Literal["embed_tokens", "lm_head", "gate"]] = Field(
        [], description="Modules trained in full beside the adapter and saved with it (PEFT's modules_to_save). "
                        "gate: a mixture-of-experts model's router, frozen unless named here. Only in sft.")
    quantization: Literal["none", "nf4"] = Field(
        "none", description="QLoRA: nf4 keeps the frozen base weight of each adapted layer in 4 bits (bitsandbytes' "
                            "NF4 with double-quantised scales, about 0.52 byte a weight instead of 2-4) and "
                            "dequantises it at every use; the adapter stays in the model's dtype. Merging and export "
                            "use the dequantised base. Not with dist.strategy fsdp2.")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _known_targets(cls, targets):
        if isinstance(targets, str) and targets != ALL_LINEAR:
            raise ValueError(f"got {targets[:100]!r}; expected {ALL_LINEAR!r} or a list from {list(LORA_TARGETS)}")
        if isinstance(targets, (list, tuple)):
            bad = [t for t in targets if t not in LORA_TARGETS]
            if indexer := [t for t in bad if t.rsplit(".", 1)[-1] in INDEXER_PROJECTIONS]:
                raise ValueError(f"{indexer} name the DSA indexer (GLM-5), which stays frozen: it only chooses each "
                                 "query's keys, without gradients, as every GLM-5 trainer keeps it")
            if bad or not targets:
                raise ValueError(f"unknown {bad or '(empty)'}; allowed: {list(LORA_TARGETS)} or {ALL_LINEAR!r}")
        return targets


class TrainConfig(Section):
    """The keys every training stage (pretrain, sft, dpo, rl) has.

    A micro-batch is `batch_size` rows of `seq_len` tokens; with packing each row holds as many
    whole documents as fit, so the token budget per micro-batch is batch_size × seq_len. One optimizer
    step takes batch_size × grad_accum × world size rows (world size: `dist`, one process by default).
    """

    max_steps: int = Field(100, ge=1, description="Optimizer steps the stage takes (fewer if it stops early: "
                                                  "patience). Raising it later resumes from the stage's checkpoint.")
    batch_size: int = Field(8, ge=1, description="Rows per micro-batch, per process.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches whose gradients add up to one optimizer step. Leave "
                                                 "it at 1 when global_batch_size is set.")
    global_batch_size: int | None = Field(
        None, ge=1, description="Rows per optimizer step over all processes; when set, grad_accum is derived: "
                                "global_batch_size / (batch_size × world size), which must divide. null: use "
                                "grad_accum.")
    seq_len: int = Field(128, ge=8, description="Tokens per row; at most model.max_seq_len (or the base model's "
                                                "limit).")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (AdamW), reached after warmup_steps and then "
                                              "decayed along a cosine to min_lr_ratio × lr at max_steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Where the cosine decay ends, as a fraction of lr; 0: "
                                                             "down to 0.")
    warmup_steps: int = Field(10, ge=0, description="Steps of linear warmup up to lr.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay, on weight matrices only.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the gradients' global norm to this; 0 disables clipping.")
    log_every: int = Field(10, ge=1, description="Log the loss, throughput and learning rate every this many steps "
                                                 "(and at the last).")
    seed: int = Field(0, description="Seed of the stage's randomness: initialisation, data order, dropout.")
    packing: bool = Field(True, description="Several documents per row (attention stays within each document); "
                                            "false: one document per row, padded.")
    prefetch: int = Field(2, ge=0, description="Batches built ahead in a background thread; 0: built inline.")
    nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="A NaN or infinite loss: stop fails the stage; skip skips the batch and counts it (more "
                            "than 100 skipped fail the stage).")
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder block's activations in the backward pass: less memory, more "
                           "compute.")
    compile: bool | Literal["auto", "max-autotune"] = Field(
        False, description="torch.compile the training forward and backward: faster steps after a one-off compile "
                           "(cached per user in ~/.cache/glm-lora/inductor), the same learning up to rounding. "
                           "max-autotune: inductor also times its GEMM templates (CUDA; a longer compile). auto: "
                           "compile only a CPU stage long enough for the compile to pay back (PAYBACK_STEPS in "
                           "engine/compile.py), eager on CUDA. Eager with a warning where there is no C++ compiler "
                           "(CPU) and under torchrun.")
    cuda_graphs: bool = Field(
        False, description="Replay the decoder blocks' training forward and backward as CUDA graphs: for a small "
                           "model on a fast GPU, whose step waits on the host launching kernels. One process, CUDA, "
                           "no gradient accumulation or activation checkpointing; eager with a warning elsewhere. "
                           "Not with compile true or max-autotune.")
    eval_every: int = Field(
        0, ge=0, description="Validation loss on the stage's held-out split every this many steps; 0: off. When on, "
                             "the stage saves the weights with the best validation loss, not the last.")
    patience: int = Field(0, ge=0, description="Stop after this many validations without improvement; 0: never.")
    min_delta: float = Field(0.0, ge=0, description="An improvement must lower the validation loss by more than "
                                                    "this.")
    router_aux_loss: float = Field(
        0.0, ge=0, description="Mixture-of-experts models: weight of the load-balance loss (DeepSeek-V3's) added to "
                               "the stage's loss; 0: off, as under LoRA the router is frozen. Router health is "
                               "reported either way.")

    @model_validator(mode="after")
    def _one_graph_maker(self):
        if self.cuda_graphs and self.compile in (True, "max-autotune"):
            raise ValueError(f"cuda_graphs: true with compile: {self.compile!r}: choose one (cuda_graphs captures "
                             "the eager blocks; a compiled graph would be captured inside it)")
        return self


def _mtp_weight(what: str):
    return Field(0.3, ge=0, description=f"Weight of the MTP layer's loss (cross-entropy of the token after next) added "
                                        f"to the stage's loss{what}; GLM and DeepSeek-V3 pretrain with 0.3 early, "
                                        "0.1 later.")


def _mtp_mode(stage: str, tokens: str):
    return Field(
        "carry", description="The model's multi-token prediction (MTP) layer, the draft of vLLM's speculative "
                             "decoding (GLM-4.5 / 4.7-Flash / 5 checkpoints, or model.mtp_layers: 1). carry: left as "
                             "it is, byte for byte in every export that holds it. train: its loss (its prediction of "
                             f"token t+2 from position t, on {tokens}) × {stage}.mtp_weight is added to the stage's "
                             "loss, and a LoRA with this stage's lora settings (the same targets) trains the layer while "
                             "the main adapter trains as usual; the MTP loss's gradient reaches the main model through "
                             "its hidden states, as DeepSeek-V3 trains it. The MTP LoRA is saved with the stage's "
                             "adapter and merged into the exported MTP layer; the PEFT adapter holds none (vLLM applies "
                             "no LoRA to the draft), so a final adapter that trained it is served merged. Needs a "
                             "model with an MTP layer. Either way the stage reports mtp_acceptance (held-out share "
                             "of drafts equal to the model's own greedy token).")


class SFTConfig(TrainConfig):
    """A LoRA adapter on the pretrained (or base) model, trained on the assistants' answers of data.sft."""

    lora: LoRAConfig = Field(LoRAConfig(), description="The SFT adapter.")
    mtp: Literal["carry", "train"] = _mtp_mode("sft", "the answer tokens the main loss counts")
    mtp_weight: float = _mtp_weight(" with mtp: train")


class PretrainConfig(TrainConfig):
    """Pretraining from scratch: the decoder of `model.*` on the pretraining documents, next-token loss."""

    mtp_weight: float = _mtp_weight(" when model.mtp_layers is 1")


class DPOConfig(TrainConfig):
    """A fresh LoRA adapter on the SFT model, trained with `loss` on the preference rows of data.dpo."""

    lora: LoRAConfig = Field(LoRAConfig(), description="The preference adapter; modules_to_save must stay empty (the "
                                                       "reference model is the same weights with the adapter off).")
    mtp: Literal["carry", "train"] = _mtp_mode("dpo", "the chosen answers only")
    mtp_weight: float = _mtp_weight(" with mtp: train")
    loss: Literal["dpo", "ipo", "simpo", "orpo", "kto"] = Field(
        "dpo", description="dpo: DPO's sigmoid loss; ipo: IPO's squared loss; simpo, orpo: reference-free (one "
                           "forward per step instead of two); kto: KTO on unpaired rows, each answer labelled "
                           'desirable or not (`{"prompt" or "messages", "completion", "label": true/false}` in '
                           "data.dpo; pairs there count as two unpaired rows).")
    beta: float = Field(0.1, gt=0, description="β of every loss but ORPO, the scale of the implicit reward (DPO, "
                                               "IPO, KTO: higher keeps the model closer to the reference). SimPO's "
                                               "paper uses 2-2.5, KTO's 0.1.")
    nll_weight: float = Field(1.0, ge=0, description="Weight of the chosen answer's NLL term beside the preference "
                                                     "loss; 0: pure preference loss, which can wreck generation. "
                                                     "ORPO has its own (weight 1) and ignores this.")
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO's target reward margin γ.")
    orpo_lambda: float = Field(0.1, gt=0, description="ORPO's λ: weight of the odds-ratio term beside the chosen "
                                                      "answer's NLL.")
    kto_desirable_weight: float = Field(1.0, gt=0, description="KTO's λ_D, the desirable answers' weight: choose "
                                                               "λ_D and λ_U so that λ_D·n_D is about λ_U·n_U (up to "
                                                               "4/3 of it, the paper says).")
    kto_undesirable_weight: float = Field(1.0, gt=0, description="KTO's λ_U, the undesirable answers' weight (see "
                                                                 "kto_desirable_weight).")
    share_prompt: bool = Field(True, description="Packed rows place a pair's common prompt once, both answers "
                                                 "attending to it: the same log-probs from fewer tokens, so more "
                                                 "pairs fit a batch. false: each answer repeats its prompt.")

    @model_validator(mode="after")
    def _reference_stays_frozen(self):
        if self.lora.modules_to_save:
            raise ValueError("dpo.lora.modules_to_save must be empty: DPO's reference is the same weights with the "
                             "adapter switched off, so fully trained modules would move the reference too")
        return self


class RLConfig(TrainConfig):
    """A fresh LoRA adapter on the DPO model, trained on its own sampled answers to the SFT prompts, scored by
    reward functions.

    Each optimizer step draws `batch_size` prompts, samples `group_size` answers to each (temperature sampling with
    a KV cache, seeded by step: a resumed stage draws the same answers), scores them with `rewards` and normalises
    each group's summed reward to advantages (r − mean) / (std + 1e-4); the loss is GRPO's clipped-ratio objective
    with one update per rollout (the ratio is 1, so the step is the policy gradient with those advantages), plus
    `kl_beta` times the k3 estimate of KL to the reference (the same weights with this adapter off)."""

    enabled: bool = Field(False, description="Run the stage: after dpo, and export its model as the final one.")
    lora: LoRAConfig = Field(LoRAConfig(), description="The RL adapter; modules_to_save must stay empty (the KL "
                                                       "reference is the same weights with the adapter off).")
    group_size: int = Field(8, ge=2, description="Answers sampled per prompt (GRPO's G).")
    max_new_tokens: int = Field(24, ge=1, description="Longest sampled answer, in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    rewards: list[str] = Field(
        ["exact_match"], min_length=1,
        description="Reward functions, summed: built-ins (exact_match, format) or `package.module:function`, called "
                    "as `fn(completion, reference=..., prompt=..., task=..., finished=...) -> float`.")
    families: list[str] = Field([], description='Sample only prompts of these task families (the rows\' "task" '
                                                "field); []: all.")
    prompts: Path | None = Field(
        None, description="The prompts to sample answers to: a JSONL file in any SFT format, the last assistant "
                          'message of each row the reference the rewards see, an optional "task" field. null: the '
                          "SFT split.")
    clip_epsilon: float = Field(0.2, gt=0, lt=1, description="GRPO's clip range ε of the probability ratio.")
    kl_beta: float = Field(0.0, ge=0, description="Weight of the KL term to the reference; 0: no KL term and no "
                                                  "reference forward (as DAPO and Dr. GRPO).")
    loss_type: Literal["grpo", "token"] = Field(
        "grpo", description="grpo: each answer's mean token loss, averaged over answers (the paper); token: every "
                            "answer token weighs the same over the whole batch (DAPO's token-level loss: long "
                            "answers are not under-weighted).")
    train_chunks: int = Field(
        1, ge=1, description="Train each rollout's batch_size × group_size answers in this many equal micro-batches, "
                             "gradients accumulated: the same update with 1/train_chunks of the training "
                             "activations (sampling stays one batch). A memory setting, not a speed one: with "
                             "activation_checkpointing it is what lowers the stage's peak memory.")
    sampler: Literal["ours", "vllm"] = Field(
        "ours", description="Who samples the answers: ours (in the training process) or vllm (a vLLM server beside "
                            "the trainer, the adapter loaded into it after every update; one process only).")
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, lt=1, description="sampler vllm: vLLM's share of the GPU "
                                                                            "it shares with training.")

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
    save_every: int = Field(100, ge=0, description="Save the weights, RNG state and data position every this many "
                                                   "steps; 0: only on SIGTERM / SIGINT.")
    save_optimizer_every: int = Field(100, ge=1, description="Save the optimizer state too every this many steps "
                                                             "(and on a stop signal): an exact resume needs it.")
    keep_last: int = Field(2, ge=1, description="Newest complete checkpoints kept per stage (plus the newest with "
                                                "optimizer state).")
    async_save: bool = Field(True, description="Compress and write checkpoints in a background thread.")
    resume: Literal["auto", "never"] = Field("auto", description="auto: a stage continues from its newest verified "
                                                                 "checkpoint; never: it starts over.")


class ExportConfig(Section):
    gguf: list[str] = Field(
        [], description="GGUF files of the final model, for llama.cpp, Ollama or LM Studio (stage gguf): any of "
                        "f32, f16, bf16, q8_0 (written by the gguf package) and q4_0, q4_k_m, q5_k_m, q6_k "
                        "(llama.cpp's quantizer, from the llama extra); []: none.")


class HarnessConfig(Section):
    """lm-evaluation-harness (`lm_eval`, the `harness` extra) runs on the exported model in the stage `harness`,
    after export. Nothing is downloaded: tasks come from the shipped folder (glm_lora_arithmetic,
    glm_lora_strings, over the run's held-out synthetic rows), from `include_path`, or from lm_eval's own tasks
    whose datasets are already in the local Hugging Face cache."""

    tasks: list[str] = Field([], description="Task, group or tag names; []: no harness stage.")
    include_path: list[Path] = Field([], description="Your task folders (YAML and data files), as lm_eval's "
                                                     "--include_path.")
    limit: int | None = Field(None, ge=1, description="Samples per task; null: all.")
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples per prompt; null: each task's own.")
    batch_size: int = Field(8, ge=1, description="Requests evaluated together.")
    chat_template: bool = Field(True, description="Send prompts through the model's chat template (the exports are "
                                                  "chat models).")
    base: bool = Field(True, description="Score export/base too: serve.gate.harness compares with it where the "
                                         "served model has no score (the first promotion).")

    @field_validator("tasks")
    @classmethod
    def _names(cls, tasks: list[str]) -> list[str]:
        if any(not t.strip() for t in tasks) or len(set(tasks)) != len(tasks):
            raise ValueError(f"expected distinct, non-empty task names, got {tasks}")
        return tasks


class EvalConfig(Section):
    enabled: bool = Field(True, description="Evaluate each trained model on the held-out splits (loss, exact match "
                                            "and more).")
    max_rows: int = Field(200, ge=1, description="Rows evaluated per held-out split.")
    max_new_tokens: int = Field(24, ge=1, description="Longest greedy answer, in tokens, for exact match.")
    compare_prompts: list[str] = Field(COMPARE_PROMPTS, description="Prompts answered by the pretrained, SFT and DPO "
                                                                    "models side by side in the run's report.")
    harness: HarnessConfig = Field(HarnessConfig(), description="Standard benchmarks with lm-evaluation-harness.")


class GateConfig(Section):
    """Metric names are `<stage>.<metric>`, e.g. sft.exact_match."""

    min: dict[str, float] = Field({}, description="Metric → threshold the candidate must reach (a maximum for "
                                                  "loss-like metrics: loss, perplexity, ...). A missing metric "
                                                  "fails the gate.")
    no_regression: list[str] = Field(["dpo.exact_match", "dpo.implicit_reward_accuracy"],
                                     description="Metrics that must not fall below the served model's (within "
                                                 "tolerance).")
    tolerance: float = Field(0.0, ge=0, description="How far a no_regression metric may fall behind the served "
                                                    "model's, in the metric's units.")
    harness: dict[str, float] = Field(
        {}, description="lm-evaluation-harness task (from eval.harness.tasks) → min_delta: the candidate's score must "
                        "be at least the served model's + min_delta (negative: that much loss is allowed); where the "
                        "served model has no score, export/base's.")


class ServeConfig(Section):
    """The endpoint: nginx on host:port in front of the live vLLM server. A new export is started beside it on
    a free loopback port, tested, then switched to (blue/green)."""

    enabled: bool = Field(True, description="Run the serve stage: test the export on vLLM and put it on the "
                                            "endpoint.")
    host: str = Field("127.0.0.1", description="IP address the endpoint listens on (the vLLM servers behind it "
                                               "always listen on 127.0.0.1 only); 0.0.0.0: every interface. An "
                                               "address other than loopback needs an API key (api_key_env or "
                                               "api_key_secret).")
    port: int = Field(8765, ge=1024, le=65535, description="Port of the endpoint.")
    keep_running: bool = Field(True, description="false: start, test and stop the candidate, leaving the endpoint "
                                                 "untouched.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="The served weights' dtype.")
    max_model_len: int = Field(512, ge=16, description="Longest prompt + answer, in tokens, the server accepts.")
    kv_cache_bytes: int = Field(256 * 2**20, ge=2**20, description="vLLM's KV cache on its CPU build, in bytes.")
    startup_timeout_s: int = Field(300, ge=10, description="Seconds a vLLM server may take to start.")
    prompt: str = Field(DEMO_PROMPT, description="The smoke test's question: the served answer must equal our own "
                                                 "greedy decoder's.")
    max_tokens: int = Field(32, ge=1, description="Longest smoke-test answer, in tokens.")
    adapters: bool = Field(True, description="Serve the SFT model and the DPO adapter under their own names beside "
                                             "the final model, on one server (`<run>`, `<run>-sft`, `<run>-dpo`); false: "
                                             "only the merged final model (no LoRA work per token).")
    drain_timeout_s: int = Field(120, ge=1, description="Seconds a switch waits for the old server's requests to "
                                                        "finish.")
    keep_exports: int = Field(3, ge=1, description="Earlier served exports kept in serving/exports/ for rollback.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per vLLM server (CUDA build of vLLM only).")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Each vLLM server's share of each GPU's memory (CUDA build only); null: 0.45, "
                                      "so that a candidate fits beside the live server during a promotion.")
    max_num_seqs: int | None = Field(None, ge=1, description="Concurrent sequences per server; null: vLLM's default.")
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 512] | None = Field(
        None, description="Largest adapter rank the server accepts; null: the smallest that fits the adapters.")
    gate: GateConfig = Field(GateConfig(), description="The promotion gate a candidate must pass to be served.")
    api_key_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of the environment variable holding the endpoint's API key (the key itself never enters "
                    "configs, manifests or logs). null (and no api_key_secret): no key.")
    api_key_secret: str | None = Field(None, description="Name of a Prefect Secret block holding the endpoint's API "
                                                         "key; instead of api_key_env.")

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
    """World size = nproc_per_node × nnodes; with one process (the default) a stage runs in-process."""

    nproc_per_node: Literal["auto"] | Annotated[int, Field(ge=1)] = Field(
        1, description="Processes per machine; auto: one per visible CUDA GPU (1 on CPU).")
    nnodes: int = Field(1, ge=1, description="Machines taking part. More than one needs runs_dir on a shared "
                                             "filesystem.")
    node_rank: int = Field(0, ge=0, description="This machine's place among the nnodes, from 0.")
    rdzv_endpoint: str = Field("127.0.0.1:29500", pattern=r"^\S+:\d{1,5}$",
                               description="host:port on node 0 where the processes meet (several machines); "
                                           "every node must reach it.")
    node_timeout_s: int = Field(1800, ge=1, description="Several machines: seconds a node waits for the others, at "
                                                        "each training stage's start and (nodes other than 0) for "
                                                        "node 0 to publish a stage.")
    strategy: Literal["auto", "ddp", "fsdp2"] = Field(
        "auto", description="ddp: every process holds the whole model and gradients are all-reduced; fsdp2: "
                            "parameters, gradients and optimizer state sharded over the processes. auto: fsdp2 for "
                            "pretraining, ddp for the LoRA stages.")
    launcher: Literal["auto", "torchrun"] = Field("auto", description="auto: torchrun when the world size is above "
                                                                      "1; torchrun: always.")

    @model_validator(mode="after")
    def _node_rank_in_range(self):
        if self.node_rank >= self.nnodes:
            raise ValueError(f"dist.node_rank ({self.node_rank}) must be below dist.nnodes ({self.nnodes})")
        return self


class TrackingConfig(Section):
    """`mlflow` (the `tracking` extra): each flow run is one MLflow run (the config as params, every stage's metrics
    by step, its reports and model cards, the Prefect flow-run id) and an export that passes the serve stage is
    registered in MLflow's model registry. No stage's cache key holds it. `tracking: mlflow` is short for
    `tracking: {backend: mlflow}`."""

    backend: Literal["none", "mlflow"] = Field("none", description="none: no tracking; mlflow: MLflow.")
    tracking_uri: str | None = Field(
        None, min_length=1,
        description="Any URI MLflow takes: a server's URL (http://127.0.0.1:5000), a database (sqlite:///abs/path.db). "
                    "No password in it: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                    "MLFLOW_TRACKING_TOKEN) in the environment. null: the local store "
                    "`sqlite:///<runs_dir>/mlflow.db`, its artifacts in `<runs_dir>/mlartifacts/`.")
    experiment_name: str | None = Field(None, min_length=1, description="MLflow experiment; null: run_name.")
    registered_model_name: str | None = Field(None, pattern=r"^[^'\"\\]+$",
                                              description="Name in MLflow's model registry, without quotes or "
                                                          "backslashes; null: run_name.")
    register_model: bool = Field(
        True, description="Register the served export's final (merged) model: its files are uploaded as the run's "
                          "`model` artifact, a copy the size of the weights (once per export); false: metrics and "
                          "reports only.")

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
    """A glm-lora config: the run's name and directory, where and how it computes, then one section per part of
    the pipeline."""

    run_name: str = Field("tiny", description="Names the run's directory, runs_dir/run_name (its stages' outputs, "
                                              "checkpoints and served exports): letters, digits, '.', '_' and '-', "
                                              "starting with a letter or digit, at most 100.")
    runs_dir: Path = Field(Path("runs"), description="Where run directories live; a relative path is taken from the "
                                                     "working directory.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where training runs; auto: CUDA when a GPU "
                                                                       "is visible, else the CPU.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="Training precision (bf16 and fp16 by autocast); auto: bf16 on CUDA and on CPUs with AMX "
                            "or AVX512-BF16, else fp32.")
    kernels: Literal["auto", "reference", "triton"] = Field(
        "auto", description="Fused Triton ops or the plain torch ops: auto takes the Triton op on CUDA wherever it "
                            "measured faster, torch elsewhere (CPU); reference: torch everywhere; triton: every "
                            "Triton op.")
    attention: Literal["auto", "sdpa", "flex", "varlen"] = Field(
        "auto", description="Attention over packed rows: sdpa (a dense document mask), flex (FlexAttention: other "
                            "documents' blocks skipped), varlen (FlashAttention's variable-length kernels; bf16 / "
                            "fp16). auto: sdpa on the CPU, flex or sdpa per model on CUDA, whichever measured "
                            "faster.")
    threads: int | None = Field(None, description="torch's CPU threads; null: torch's default.")
    base_model: Path | None = Field(
        None, description="A local Hugging Face model directory (Llama, Qwen2, Qwen3, GLM, GLM-4 or GLM-4.5 "
                          "mixture-of-experts layouts) to fine-tune instead of pretraining: the tokenizer and "
                          "pretrain stages are skipped, and tokenizer, model and pretrain are not used.")
    data: DataConfig = Field(DataConfig(), description="Training and evaluation data, and how rows are cleaned.")
    tokenizer: TokenizerConfig = Field(TokenizerConfig(), description="The tokenizer trained on the pretraining "
                                                                      "corpus, or yours (`path`); not used with "
                                                                      "base_model, which brings its own.")
    model: ModelConfig = Field(ModelConfig(), description="The decoder pretrained from scratch: its layout (`arch`) "
                                                          "and shape, which map onto the transformers class of that "
                                                          "layout. Not used with base_model.")
    pretrain: PretrainConfig = Field(PretrainConfig(), description="The pretraining stage (from scratch; skipped "
                                                                   "with base_model).")
    sft: SFTConfig = Field(SFTConfig(), description="The supervised fine-tuning stage.")
    dpo: DPOConfig = Field(DPOConfig(lr=5e-5), description="The preference stage: DPO, IPO, SimPO, ORPO or KTO.")
    rl: RLConfig = Field(RLConfig(lr=2e-4, batch_size=8, prefetch=0), description="The optional online RL stage "
                                                                                  "(GRPO), off by default.")
    checkpoint: CheckpointConfig = Field(CheckpointConfig(), description="Training checkpoints, under "
                                                                         "`runs_dir/run_name/checkpoints/`, and "
                                                                         "resuming from them.")
    eval: EvalConfig = Field(EvalConfig(), description="Evaluation after each training stage, on the held-out "
                                                       "splits.")
    export: ExportConfig = Field(ExportConfig(), description="What the export writes besides the Hugging Face and "
                                                             "PEFT directories.")
    serve: ServeConfig = Field(ServeConfig(), description="Serving the exported model with vLLM.")
    dist: DistConfig = Field(DistConfig(), description="Several processes (GPUs, machines) per training stage, "
                                                       "started by torchrun.")
    tracking: TrackingConfig = Field(TrackingConfig(), description="Experiment tracking with MLflow, off by "
                                                                   "default.")

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
    def _one_tokenizer_source(self):
        if self.base_model is not None and self.tokenizer.path is not None:
            raise ValueError("tokenizer.path is for pretraining from scratch; base_model brings its own tokenizer: "
                             "set one of them")
        return self

    @model_validator(mode="after")
    def _mtp_to_train(self):
        """A from-scratch model has an MTP layer only with model.mtp_layers; a base model's is checked against its
        config.json before any stage runs (engine/preflight.py)."""
        if self.base_model is None and not self.model.mtp_layers:
            for key, tc in (("sft", self.sft), ("dpo", self.dpo)):
                if tc.mtp == "train":
                    raise ValueError(f"{key}.mtp: train needs a model with an MTP (multi-token prediction) layer, and "
                                     "model.mtp_layers is 0: set model.mtp_layers: 1 (pretraining then trains one) "
                                     f"or {key}.mtp: carry")
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
