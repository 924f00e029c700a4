"""Tokenizer stage: a sentencepiece BPE model saved as Hugging Face tokenizer files.

One place decides the chat format (`CHAT_TEMPLATE`) and the special tokens; training,
SFT/DPO data and vLLM serving all read them from the saved tokenizer directory. A base model's
tokenizer keeps its own template (GLM-4, Llama-3, ChatML, ...): `tokenize_chat` labels whatever
the template renders for each answer plus its end-of-turn token, and `end_of_turn_ids` gives the
tokens generation stops at, both found by rendering the template (`template_info`).

Design choices (measured on the CPU default: bench/RESULTS.md):
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
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import sentencepiece as spm

from glm_lora.configs.errors import UserError, quote
from glm_lora.data.cleaning import CleanReport
from glm_lora.data.formats import MAX_LINE_BYTES, DataError, read_pretrain
from glm_lora.data.token_store import IGNORE as IGNORE_INDEX

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
    """Load the tokenizer in `tokenizer_dir` (ours, or a base model's; local files only).

    The class its tokenizer_config.json names, where transformers exports it, is loaded directly: that is the class
    AutoTokenizer would pick, but AutoTokenizer's module imports transformers' model registry (and torch._dynamo
    through it), ~2 CPU-seconds in every stage process that only needs the tokenizer. Anything else goes through
    AutoTokenizer."""
    import transformers

    path = Path(tokenizer_dir).resolve()
    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        from transformers import AutoTokenizer as cls
    return cls.from_pretrained(str(path), local_files_only=True)


class ChatTemplateError(DataError):
    """The tokenizer's chat template cannot give SFT/DPO labels that match inference: the stage fails."""


class ChatRowError(DataError):
    """One conversation this template cannot label as it is served; the row is dropped, counted by `reason`."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class TemplateInfo:
    """What a chat template does around an assistant answer (probed once per tokenizer, `template_info`).

    turn_end: the special token the template puts right after an answer when the conversation goes on
      (<|im_end|> for ChatML, <|eot_id|> for Llama-3, the next role token <|user|> for GLM-4).
    last_end: the one it puts after the conversation's final answer, or None where it puts nothing
      (GLM-4): then the answer's label ends with whatever token the template renders next, and the
      final answer's with the eos token (as GLM-4's own fine-tuning code does).
    stop_ids: every token generation must stop at (`end_of_turn_ids`).
    """

    turn_end: int
    last_end: int | None
    last_end_text: str | None
    eos: int | None
    stop_ids: tuple[int, ...]


_PROBE = ("Ping one two", "Pong three four", "Ping five six")   # survive trimming templates (Llama-3)
_TEMPLATE_INFO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _render(tok, messages: list[dict], generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def _encode(tok, text: str) -> list[int]:
    """Tokens of `text` exactly as apply_chat_template(tokenize=True) makes them (no automatic bos/eos)."""
    return tok(text, add_special_tokens=False)["input_ids"] if text else []


def prompt_ids(tok, messages: list[dict]) -> list[int]:
    """What the server feeds for `messages`: apply_chat_template(messages, add_generation_prompt=True)."""
    return prompt_ids_many(tok, [messages])[0]


def prompt_ids_many(tok, conversations: list[list[dict]]) -> list[list[int]]:
    """prompt_ids of each conversation: rendered one by one, tokenised in one batched call (as _encode does)."""
    if not conversations:
        return []
    texts = [_render(tok, messages, True) for messages in conversations]
    return [ids if text else [] for text, ids in zip(texts, tok(texts, add_special_tokens=False)["input_ids"])]


def _is_special(tok, token_id: int) -> bool:
    added = tok.added_tokens_decoder.get(token_id)
    return token_id in tok.all_special_ids or bool(added is not None and added.special)


def _generation_config_eos(tok) -> list[int]:
    """eos_token_id of a generation_config.json beside the tokenizer (a base model's own stop tokens)."""
    name = getattr(tok, "name_or_path", "") or ""
    path = Path(name) / "generation_config.json" if name else None
    if path is None or not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    ids = eos if isinstance(eos, list) else [eos]
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tok)]


def _first_token_after(tok, text: str, what: str) -> tuple[int, str]:
    ids = _encode(tok, text)
    if not ids or not _is_special(tok, ids[0]):
        raise ChatTemplateError(
            f"chat template: after an assistant answer it renders {quote(text, 80)} ({what}), which does not start "
            "with a special token; generation could not stop at the end of the turn. Use a template that ends "
            "each assistant turn with a special token (e.g. <|im_end|>, <|eot_id|>, or GLM-4's next role token)")
    return ids[0], tok.convert_ids_to_tokens(ids[0])


def template_info(tok) -> TemplateInfo:
    """Probe the chat template with a short conversation; cached per tokenizer (and template text)."""
    template = tok.chat_template
    try:
        cached = _TEMPLATE_INFO.get(tok)
    except TypeError:
        cached = None
    if cached is not None and cached[0] == template:
        return cached[1]
    if not template:
        raise ChatTemplateError("the tokenizer has no chat_template; SFT/DPO need one")
    q1, a1, q2 = _PROBE
    user1, answer, user2 = ({"role": "user", "content": q1}, {"role": "assistant", "content": a1},
                            {"role": "user", "content": q2})
    try:
        going_on, last = _render(tok, [user1, answer, user2], False), _render(tok, [user1, answer], False)
    except Exception as e:  # noqa: BLE001 - any template failure is the template's problem here
        raise ChatTemplateError(f"chat template fails on a plain user/assistant/user conversation: {e}") from None
    i, j = going_on.find(a1), last.find(a1)
    if i < 0 or j < 0 or going_on.find(q2, i) < 0:
        raise ChatTemplateError("chat template does not render the messages' content (probed with a plain "
                                "user/assistant/user conversation)")
    turn_end, _ = _first_token_after(tok, going_on[i + len(a1):going_on.find(q2, i)], "before the next user turn")
    after_last = last[j + len(a1):]
    last_end, last_end_text = None, None
    if after_last:
        first = _encode(tok, after_last)[0]
        if _is_special(tok, first):
            last_end, last_end_text = first, tok.convert_ids_to_tokens(first)
    eos = tok.eos_token_id
    stops = [turn_end, last_end, eos, *_generation_config_eos(tok)]
    info = TemplateInfo(turn_end=turn_end, last_end=last_end, last_end_text=last_end_text, eos=eos,
                        stop_ids=tuple(dict.fromkeys(t for t in stops if t is not None)))
    try:
        _TEMPLATE_INFO[tok] = (template, info)
    except TypeError:
        pass
    return info


def end_of_turn_ids(tok) -> list[int]:
    """The token ids generation must stop at for this tokenizer's chat template: the token that ends an
    assistant turn in it (ChatML <|im_end|>, Llama-3 <|eot_id|>, GLM-4 <|user|>), the tokenizer's eos, and
    the eos_token_id list of a generation_config.json beside the tokenizer files (a base model's own)."""
    return list(template_info(tok).stop_ids)


def _diverge(a: str, b: str) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{quote(a[max(0, n - 30):n + 30], 90)} vs {quote(b[max(0, n - 30):n + 30], 90)}"


def chat_tokens(tok, messages: list[dict]) -> tuple[list[int], list[int], int]:
    """`tokenize_chat`'s ids and labels, and where the last labelled answer starts (its prompt's length)."""
    info = template_info(tok)
    ids: list[int] = []
    labels: list[int] = []
    text = ""          # the text ids stand for
    pending = False    # the last answer's end-of-turn is the next token the template renders (GLM-4)
    start = 0
    for k, message in enumerate(messages):
        if message["role"] != "assistant" or k == 0:    # an opening assistant message has no prompt: context only
            continue
        try:
            p_text, f_text = _render(tok, messages[:k], True), _render(tok, messages[:k + 1], False)
        except Exception as e:  # noqa: BLE001 - e.g. a template's raise_exception on this role order
            raise ChatRowError("template_error", f"the chat template rejects this conversation: {e}") from None
        if not p_text.startswith(text):
            raise ChatTemplateError(
                f"chat template does not extend: the prompt for the assistant answer at message {k} does not start "
                f"with the conversation rendered through the previous answer ({_diverge(p_text, text)}); the "
                "template renders earlier turns differently once more turns follow (e.g. it drops earlier "
                "reasoning), so one sequence cannot label every turn with the prompt the server feeds. Use one "
                "assistant answer per row, or a template whose renders extend each other")
        if not f_text.startswith(p_text):
            raise ChatTemplateError(
                f"chat template: its generation prompt (add_generation_prompt=True) is not how it starts the "
                f"assistant turn at message {k} ({_diverge(f_text, p_text)}); the model would be trained on "
                "prompts the server never feeds")
        prompt = _encode(tok, p_text)
        if prompt[:len(ids)] != ids:
            raise ChatRowError("turn_boundary", f"message {k}: an earlier answer tokenises differently inside the "
                                                "conversation than right after its own prompt (its first or last "
                                                "characters merge with the template text around it), so the prompt "
                                                "of this turn would not be the one the server feeds")
        if pending:
            nxt = prompt[len(ids)] if len(prompt) > len(ids) else None
            if nxt is None or not _is_special(tok, nxt):
                raise ChatTemplateError(
                    f"chat template: after the assistant answer before message {k} it renders no special token "
                    "(the end of that turn), so generation could not stop there")
            ids.append(nxt)
            labels.append(nxt)
        labels += [IGNORE_INDEX] * (len(prompt) - len(labels))
        rest = f_text[len(p_text):]
        end = rest.rfind(info.last_end_text) if info.last_end_text else -1
        if end >= 0:
            answer = _encode(tok, rest[:end]) + [info.last_end]
            text, pending = p_text + rest[:end + len(info.last_end_text)], False
        else:
            answer = _encode(tok, rest)
            text, pending = p_text + rest, True
        start = len(prompt)
        ids = prompt + answer
        labels += answer
    if pending:
        if info.eos is None:
            raise ChatTemplateError("chat template puts nothing after the final assistant answer and the tokenizer "
                                    "has no eos_token to end it with")
        ids.append(info.eos)
        labels.append(info.eos)
    return ids, labels, start


def tokenize_chat(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids and labels for SFT, for any chat template: labels are IGNORE_INDEX except each assistant
    answer as the template renders it plus the token that ends its turn.

    Each assistant turn's prompt is exactly `apply_chat_template(messages[:k], add_generation_prompt=True)`,
    i.e. what the server feeds at inference; the answer is the text the template renders after that prompt
    for the turn, encoded on its own (as the model generates it), up to and including the template's
    end-of-turn token (ChatML <|im_end|>, Llama-3 <|eot_id|>; for a template that puts nothing after an
    answer, such as GLM-4's, the next role token it renders, or eos after the final answer). Messages
    after the last assistant turn carry no loss and are dropped.

    Raises ChatTemplateError when the template cannot be labelled this way (its renders of successive
    turns don't extend each other, e.g. it drops earlier reasoning), ChatRowError for one conversation that
    cannot (the template rejects it; an answer's tokens merge with the next prompt's).
    """
    ids, labels, _ = chat_tokens(tok, messages)
    return ids, labels
