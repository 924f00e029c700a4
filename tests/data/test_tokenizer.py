"""Tokenizer stage: sentencepiece BPE <-> Hugging Face parity, single-char letters, chat format."""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import sentencepiece as spm

from glm_lora.data.tokenizer import (
    CHAT_TEMPLATE, IGNORE_INDEX, IM_END, IM_START, load_tokenizer, tokenize_chat, train_tokenizer,
)
from tests.chat_templates import labelled_spans

VOCAB = 500
SAMPLES = [
    "hello world",
    "reverse abcxyz",
    "Add 123 and 4567: the answer is 4690.\n",
    "  leading spaces,\ttabs and\n\nblank lines  ",
    "把 hello 反转过来是 olleh。\n请计算 12 加 30 等于多少？",
    "unseen: Zebra QUIZ é ü 日本 😀 ~`|",
]
CHAT = [
    {"role": "system", "content": "You are tiny."},
    {"role": "user", "content": "reverse hello"},
    {"role": "assistant", "content": "olleh"},
    {"role": "user", "content": "12 加 30 等于多少？"},
    {"role": "assistant", "content": "42\n答案是 42。"},
]


def _corpus(path: Path, n: int = 3000) -> Path:
    rng = random.Random(0)
    words = "hello world reverse copy the answer is add subtract meters kilometers".split()
    zh = "你好世界请把这个单词反转复制加上减去等于答案是多少米公里千克"
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            en = " ".join(rng.choices(words, k=5))
            cn = "".join(rng.choices(zh, k=6))
            f.write(json.dumps({"text": f"{en} {rng.randint(0, 9999)}\n{cn}。"}, ensure_ascii=False) + "\n")
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("tok")
    t0 = time.monotonic()
    out = train_tokenizer([_corpus(tmp / "corpus.jsonl")], tmp / "tokenizer", vocab_size=VOCAB)
    seconds = time.monotonic() - t0
    print(f"\ntokenizer trained in {seconds:.2f}s")
    assert seconds < 20
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def test_files_and_autotokenizer_load(tok_dir: Path, tok) -> None:
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tok_dir / name).exists(), name
    assert json.loads((tok_dir / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert type(tok).__name__ == "LlamaTokenizer"
    sp = spm.SentencePieceProcessor(model_file=str(tok_dir / "tokenizer.model"))
    assert len(tok) == sp.get_piece_size() > 300  # not the silent 3-token tokenizer
    assert len(tok) <= VOCAB     # an upper bound: this corpus cannot fill it (every letter/digit/CJK char is one piece)
    assert tok.eos_token == IM_END and tok.pad_token == "<pad>"
    assert tok.pad_token_id != tok.eos_token_id


def test_load_tokenizer_gives_what_autotokenizer_gives_without_its_model_registry(tok_dir: Path, tmp_path: Path) -> None:
    """load_tokenizer takes the class tokenizer_config.json names (AutoTokenizer's pick, without importing its model
    registry: ~2 CPU-s per stage process); a config naming no class transformers exports goes through AutoTokenizer."""
    import shutil
    import subprocess
    import sys

    from transformers import AutoTokenizer
    chat = [{"role": "user", "content": "12 + 7 = ?"}, {"role": "assistant", "content": "19"}]
    probe = ("import json, sys; from glm_lora.data.tokenizer import load_tokenizer; t = load_tokenizer(sys.argv[1]); "
             "print(json.dumps([type(t).__name__, t.get_vocab(), t(sys.argv[2])['input_ids'], "
             "t.apply_chat_template(json.loads(sys.argv[3]), tokenize=False), t.all_special_ids, "
             "'transformers.models.auto.tokenization_auto' in sys.modules]))")
    unnamed = tmp_path / "unnamed"
    shutil.copytree(tok_dir, unnamed)
    config = json.loads((unnamed / "tokenizer_config.json").read_text())
    del config["tokenizer_class"]
    (unnamed / "tokenizer_config.json").write_text(json.dumps(config))
    for d, through_auto in ((tok_dir, False), (unnamed, True)):
        out = subprocess.run([sys.executable, "-c", probe, str(d), SAMPLES[0], json.dumps(chat)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        name, vocab, ids, text, special, auto_imported = json.loads(out.stdout.strip().splitlines()[-1])
        ref = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        assert (name, vocab, ids, text, special) == (type(ref).__name__, ref.get_vocab(), ref(SAMPLES[0])["input_ids"],
                                                     ref.apply_chat_template(chat, tokenize=False), ref.all_special_ids)
        assert auto_imported == through_auto


@pytest.mark.parametrize("text", SAMPLES)
def test_roundtrip_and_sentencepiece_parity(tok_dir: Path, tok, text: str) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(tok_dir / "tokenizer.model"))
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)
    assert tok.decode(ids) == text
    assert sp.decode(ids) == text


@pytest.mark.parametrize("text", ["hello world", "reverse abcxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 9876",
                                  "你好世界", "界世好你"])
def test_letters_digits_and_cjk_are_single_tokens(tok, text: str) -> None:
    pieces = tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))
    assert pieces == ["▁" if c == " " else c for c in text]  # one piece each, none a byte fallback


def test_special_tokens_are_single_ids(tok) -> None:
    for t in (IM_START, IM_END, "<pad>", "<s>", "</s>"):
        ids = tok.encode(t, add_special_tokens=False)
        assert ids == [tok.convert_tokens_to_ids(t)], t
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)  # no auto bos/eos


def test_chat_template_render(tok) -> None:
    text = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are tiny.<|im_end|>\n"
        "<|im_start|>user\nreverse hello<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(CHAT[:2], tokenize=False).endswith("assistant\n")


def test_tokenize_chat_labels(tok) -> None:
    ids, labels = tokenize_chat(tok, CHAT)
    assert len(ids) == len(labels)
    im_end = tok.convert_tokens_to_ids(IM_END)
    # The labelled spans are exactly each answer followed by <|im_end|>.
    spans = labelled_spans(ids, labels, IGNORE_INDEX)
    answers = [m["content"] for m in CHAT if m["role"] == "assistant"]
    assert [tok.decode(s[:-1]) for s in spans] == answers
    assert all(s[-1] == im_end for s in spans)
    # Each answer's prompt is what apply_chat_template (and vLLM) feeds at inference.
    for k, m in enumerate(CHAT):
        if m["role"] == "assistant":
            prompt = tok.apply_chat_template(CHAT[:k], add_generation_prompt=True, tokenize=True, return_dict=False)
            assert ids[: len(prompt)] == prompt
            assert labels[len(prompt) - 1] == IGNORE_INDEX and labels[len(prompt)] == ids[len(prompt)]
    # And the whole sequence equals the rendered conversation (minus the final "\n").
    full = tok.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert full[: len(ids)] == ids and tok.decode(full[len(ids):]) == "\n"


def test_txt_input_max_sentences_and_determinism(tmp_path: Path) -> None:
    txt = tmp_path / "c.txt"
    lines = [json.loads(line)["text"] for line in _corpus(tmp_path / "c.jsonl", n=400).open(encoding="utf-8")]
    txt.write_text("\n".join(lines) + "\n", encoding="utf-8")
    a = train_tokenizer([txt], tmp_path / "a", vocab_size=400, seed=1, max_sentences=500)
    b = train_tokenizer([txt], tmp_path / "b", vocab_size=400, seed=1, max_sentences=500)
    assert (a / "tokenizer.model").read_bytes() == (b / "tokenizer.model").read_bytes()
    tok = load_tokenizer(a)
    assert 300 < len(tok) <= 400
    assert tok.convert_ids_to_tokens(tok.encode("Quiz 7", add_special_tokens=False)) == ["Q", "u", "i", "z", "▁", "7"]


def test_special_tokens_in_the_corpus_teach_no_merges(tmp_path: Path) -> None:
    corpus = tmp_path / "chat.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for i in range(300):
            f.write(json.dumps({"text": f"{IM_START}user\nhi {i}.{IM_END}\n{IM_START}assistant\nok{IM_END}"}) + "\n")
    tok = load_tokenizer(train_tokenizer([corpus], tmp_path / "tok", vocab_size=400))
    pieces = [p for p in tok.get_vocab() if "<|" in p or "|>" in p]
    assert sorted(pieces) == sorted([IM_START, IM_END])
    ids = tok(f"{IM_START}user\nhi 7.{IM_END}", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[:2] == [IM_START, "user"] and ids[-1] == tok.convert_tokens_to_ids(IM_END)
