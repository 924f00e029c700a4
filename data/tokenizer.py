"""Tokenizer stage: a sentencepiece BPE model saved as Hugging Face tokenizer files.

One place decides the chat format (`CHAT_TEMPLATE`) and the special tokens; training,
SFT/DPO data and vLLM serving all read them from the saved tokenizer directory.

Design choices (see NOTES.md, "Learning on the CPU default"):
- Every Latin letter, digit and newline is its own token. Plain BPE merges letters
  ("hello" -> "he ll o"), which makes a tiny model fail at reversing unseen words. We
  train with sentencepiece's `pretokenization_delimiter` around each such character, so
  no piece containing one of them next to anything else is ever learned; encoding then
  cannot merge them either. CJK characters, punctuation and spaces may still merge.
- Isolated newlines also mean no merge crosses the "\n" after a chat role, so a turn
  tokenized on its own equals the same turn inside the whole conversation.
- Identity normalization, no dummy prefix, byte fallback: decode(encode(x)) == x.
"""
from __future__ import annotations

import io
import itertools
import json
import random
import re
import string
from pathlib import Path
from typing import Iterator

import sentencepiece as spm

from configs.errors import UserError
from data.cleaning import CleanReport
from data.formats import MAX_LINE_BYTES, read_pretrain

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
# id order is fixed: 0 unk, 1 bos, 2 eos, 3 pad, 4 <|im_start|>, 5 <|im_end|>.
# <s>/</s> are never added automatically. Pretraining ends each document with the HF eos
# (<|im_end|>), the token generation stops on, so the model learns to stop before SFT.
# For chat, the Hugging Face eos is <|im_end|>: generation stops on it.
SPECIAL_TOKENS: dict[str, str] = {
    "unk_token": UNK, "bos_token": BOS, "eos_token": IM_END, "pad_token": PAD,
    "im_start": IM_START, "im_end": IM_END, "doc_end": EOS,
}
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
IGNORE_INDEX = -100
# One token per role name: the chat wrapper around a short turn would otherwise outweigh the turn
# itself (letters never merge, so "assistant" alone would be 9 tokens).
CHAT_ROLES = ("system", "user", "assistant")

_DELIM = "\x1f"  # ASCII unit separator: never in our text; removed by the trainer
# Letters, digits and CJK characters stay single pieces: copying, reversing and arithmetic
# then see the same pieces inside a quote and in the answer (BPE merges would differ).
_ISOLATE = re.compile(r"([A-Za-z0-9\n\u3400-\u4dbf\u4e00-\u9fff])")
# Special tokens written in the text (chat-formatted documents) are cut out before BPE training,
# so no merges like '".<|' are learnt from them; the tokenizer still maps them to their ids.
_SPECIAL = re.compile("|".join(re.escape(t) for t in (IM_START, IM_END, BOS, EOS, PAD, UNK)))
# One line with every ASCII letter, digit and punctuation mark, so each has a piece
# even if the corpus lacks it (else it would fall back to a byte token).
_ALPHABET = _DELIM.join("\n" + string.ascii_letters + string.digits + string.punctuation)


def _training_sentences(text_files: list[Path], max_line_bytes: int) -> Iterator[str]:
    for path in text_files:
        # Bad rows were already judged by the data stage (data.on_bad_row): here they are only skipped.
        for text in read_pretrain(path, on_bad_row="skip", report=CleanReport(max_examples=0),
                                  max_line_bytes=max_line_bytes):
            # Lines keep sentences short (the trainer drops sentences > 4192 bytes);
            # "\n" itself is in _ALPHABET and never merges, so nothing is lost.
            for line in _SPECIAL.sub(_DELIM, text).split("\n"):
                if line:
                    yield _ISOLATE.sub(_DELIM + r"\1" + _DELIM, line)


def _reservoir_sample(items: Iterator[str], k: int, seed: int) -> list[str]:
    """A uniform sample of k items from a stream, deterministic for a seed (Algorithm R)."""
    rng = random.Random(seed)
    sample: list[str] = []
    for i, item in enumerate(items):
        if i < k:
            sample.append(item)
        elif (j := rng.randrange(i + 1)) < k:
            sample[j] = item
    return sample


def train_tokenizer(
    text_files: list[Path],
    out_dir: Path,
    *,
    vocab_size: int = 2000,
    seed: int = 0,
    max_sentences: int | None = None,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> Path:
    """Train the BPE model on `text_files` (any pretraining format data.formats reads) and write HF files.

    out_dir gets tokenizer.json, tokenizer_config.json, chat_template.jinja and the raw
    tokenizer.model. `max_sentences` trains on a seeded uniform sample of that many lines.
    `vocab_size` is an upper bound: a corpus too small to fill it gives fewer pieces (the
    manifest records the real size; the model takes its vocabulary from the tokenizer).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(seed)
    sentences = _training_sentences(text_files, max_line_bytes)
    if max_sentences is not None:
        sentences = iter(_reservoir_sample(sentences, max_sentences, seed))
    model = io.BytesIO()
    try:
        _train_bpe(sentences, model, vocab_size)
    except RuntimeError as e:
        need = re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", str(e))
        if need:    # every distinct character gets a piece (character_coverage=1.0)
            raise UserError(f"tokenizer.vocab_size ({vocab_size}) is smaller than the {need[1]} distinct characters "
                            f"(plus special pieces) in the pretraining text; raise tokenizer.vocab_size above "
                            f"{need[1]}") from None
        raise
    (out_dir / "tokenizer.model").write_bytes(model.getvalue())
    tok = _hf_tokenizer(spm.SentencePieceProcessor(model_proto=model.getvalue()))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out_dir))
    # transformers 5 writes chat_template.jinja; vLLM and older readers also look here.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out_dir


def _train_bpe(sentences, model: io.BytesIO, vocab_size: int) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=itertools.chain([_ALPHABET], sentences),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,  # every seen character (incl. each CJK one) gets a piece
        hard_vocab_limit=False,  # a small corpus yields fewer pieces instead of an error
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        pretokenization_delimiter=_DELIM,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        unk_piece=UNK, bos_piece=BOS, eos_piece=EOS, pad_piece=PAD,
        control_symbols=[IM_START, IM_END],
        user_defined_symbols=list(CHAT_ROLES),
        num_threads=2,
        minloglevel=2,
    )


def _hf_tokenizer(sp: spm.SentencePieceProcessor):  # -> transformers.LlamaTokenizer
    """The same BPE as a fast Hugging Face tokenizer: identical vocab ids, merges in piece order.

    Built from the processor rather than `LlamaTokenizer.from_pretrained(dir)`, which
    needs the protobuf package to read tokenizer.model; `LlamaTokenizer(vocab_file=...)`
    silently yields a 3-token tokenizer. The size check below guards both pitfalls.
    """
    from tokenizers import AddedToken
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    atomic = {sp.id_to_piece(i) for i in range(n) if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i)}
    atomic |= set(CHAT_ROLES)
    tok = LlamaTokenizer(
        vocab=vocab,
        merges=generate_merges(vocab, skip_tokens=atomic),
        add_prefix_space=False,  # matches add_dummy_prefix=False
        legacy=False,
        add_bos_token=False,
        add_eos_token=False,
        unk_token=UNK, bos_token=BOS, eos_token=IM_END, pad_token=PAD,
        additional_special_tokens=[AddedToken(t, special=True, normalized=False) for t in (EOS, IM_START, IM_END)],
    )
    # sentencepiece matches user-defined pieces anywhere before BPE; so must the HF tokenizer.
    tok.add_tokens([AddedToken(r, special=False, normalized=False) for r in CHAT_ROLES])
    if len(tok) != n:
        raise RuntimeError(f"Hugging Face tokenizer has {len(tok)} tokens, sentencepiece {n}")
    return tok


def load_tokenizer(tokenizer_dir: str | Path):  # -> transformers.PreTrainedTokenizerBase
    """Load a tokenizer written by `train_tokenizer` (local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(tokenizer_dir).resolve()), local_files_only=True)


def tokenize_chat(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids and labels for SFT: labels are IGNORE_INDEX except assistant content + its <|im_end|>.

    Each assistant turn's prompt is exactly `apply_chat_template(messages[:k],
    add_generation_prompt=True)`, i.e. what the server feeds at inference; the answer is
    encoded on its own, as the model generates it. Messages after the last assistant
    turn carry no loss and are dropped.
    """
    im_end = tok.convert_tokens_to_ids(IM_END)
    ids: list[int] = []
    labels: list[int] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(
            messages[:k], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if prompt[: len(ids)] != ids:
            raise ValueError(f"turn {k}: chat prompt does not extend the previous turns' tokens")
        labels += [IGNORE_INDEX] * (len(prompt) - len(ids))
        answer = tok.encode(message["content"], add_special_tokens=False) + [im_end]
        ids = prompt + answer
        labels += answer
    return ids, labels
