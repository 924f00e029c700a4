"""Any chat template: SFT labels and generation stops come from the tokenizer's own template
(GLM-4, Llama-3, ChatML, Qwen3 tokenizers built locally by tests/chat_templates.py)."""
from __future__ import annotations

import json

import pytest
import torch

from glm_lora.data.cleaning import CleanReport
from glm_lora.data.formats import DataError
from glm_lora.data.encode import dpo_examples, sft_examples
from glm_lora.data.tokenizer import (
    IGNORE_INDEX, ChatRowError, ChatTemplateError, end_of_turn_ids, load_tokenizer, prompt_ids, tokenize_chat,
    train_tokenizer,
)
from glm_lora.evaluation.decode import greedy_answers, greedy_decode
from tests.oracle import Oracle
from tests.chat_templates import CHATML, FAMILIES, build_tokenizer, corpus, labelled_spans as spans

torch.set_num_threads(1)

# What the labels must cover: each answer as its template renders it + the token ending its turn.
END = {"glm4": ("<|user|>", "<|endoftext|>"), "llama3": ("<|eot_id|>", "<|eot_id|>"),
       "chatml": ("<|im_end|>", "<|im_end|>")}
STOPS = {"glm4": ["<|user|>", "<|endoftext|>", "<|observation|>"], "llama3": ["<|eot_id|>", "<|end_of_text|>"],
         "chatml": ["<|im_end|>", "<|endoftext|>"]}

CONV = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "How many legs does a cat have?"},
    {"role": "assistant", "content": "A cat has 4 legs."},
    {"role": "user", "content": "And a bird?\n\nAnswer in one word."},
    {"role": "assistant", "content": "Two.\nBirds walk on 2 legs!"},
    {"role": "user", "content": "reverse hello"},
    {"role": "assistant", "content": "olleh"},
]


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("templates")
    return {name: load_tokenizer(build_tokenizer(root / name, name)) for name in FAMILIES}


def rendered_answer(family: str, content: str) -> str:
    return {"glm4": "\n" + content, "llama3": content.strip(), "chatml": content}[family]


# ---------------------------------------------------------------- labels

@pytest.mark.parametrize("family", ["glm4", "llama3", "chatml"])
@pytest.mark.parametrize("system", [True, False])
def test_labels_cover_exactly_each_answer_and_its_end_of_turn(toks, family, system):
    tok = toks[family]
    conv = CONV if system else CONV[1:]
    ids, labels = tokenize_chat(tok, conv)
    answers = [m["content"] for m in conv if m["role"] == "assistant"]
    mid, last = END[family]
    want = [rendered_answer(family, a) + (last if n == len(answers) - 1 else mid) for n, a in enumerate(answers)]
    assert [tok.decode(s) for s in spans(ids, labels)] == want
    # Each answer's prompt is what apply_chat_template (and vLLM) feeds at inference, unlabelled at its end.
    for k, m in enumerate(conv):
        if m["role"] == "assistant":
            prompt = tok.apply_chat_template(conv[:k], add_generation_prompt=True, tokenize=True, return_dict=False)
            assert prompt == prompt_ids(tok, conv[:k])
            assert ids[:len(prompt)] == prompt
            assert labels[len(prompt) - 1] == IGNORE_INDEX and labels[len(prompt)] == ids[len(prompt)]
    # The whole sequence is the rendered conversation: ChatML without its final "\n", GLM-4 plus eos.
    full = tok.apply_chat_template(conv, tokenize=True, return_dict=False)
    extra = {"glm4": [], "llama3": [], "chatml": full[len(ids):]}[family]
    assert ids == (full + [tok.eos_token_id] if family == "glm4" else full[:len(full) - len(extra)])
    if family == "chatml":
        assert tok.decode(extra) == "\n"


@pytest.mark.parametrize("family", ["glm4", "llama3", "chatml"])
def test_sft_and_dpo_examples_use_the_template(toks, family):
    tok = toks[family]
    report = CleanReport()
    [(ids, labels)] = sft_examples([CONV], tok, seq_len=512, overlong="truncate_prompt", min_tokens=1, report=report)
    assert (ids, labels) == tokenize_chat(tok, CONV) and report.kept == 1
    prompt, chosen, rejected = CONV[:6], CONV[6], {"role": "assistant", "content": "hello"}
    got = list(dpo_examples([(prompt, chosen, rejected)], tok, seq_len=1024, overlong="truncate_prompt",
                            report=report))
    assert got == [tokenize_chat(tok, prompt + [chosen]), tokenize_chat(tok, prompt + [rejected])]
    last = END[family][1]
    assert [tok.decode(spans(*ex)[-1]) for ex in got] == [rendered_answer(family, "olleh") + last,
                                                          rendered_answer(family, "hello") + last]


def test_our_own_tokenizer_keeps_its_chatml_labels(tmp_path):
    text = tmp_path / "c.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(300)))
    tok = load_tokenizer(train_tokenizer([text], tmp_path / "tok", vocab_size=400))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(tok) == [im_end] == [tok.eos_token_id]
    ids, labels = tokenize_chat(tok, CONV)
    want = []
    for k, m in enumerate(CONV):     # the formula of the ChatML-only code this replaced
        if m["role"] == "assistant":
            prompt = tok.apply_chat_template(CONV[:k], add_generation_prompt=True, tokenize=True, return_dict=False)
            want = prompt + tok.encode(m["content"], add_special_tokens=False) + [im_end]
    assert ids == want
    assert [tok.decode(s) for s in spans(ids, labels)] == [m["content"] + "<|im_end|>" for m in CONV
                                                           if m["role"] == "assistant"]


# ---------------------------------------------------------------- templates that can't be labelled

def test_reasoning_template_single_turn_labels_its_think_block(toks):
    tok = toks["qwen3"]
    ids, labels = tokenize_chat(tok, CONV[:3])
    assert [tok.decode(s) for s in spans(ids, labels)] == ["<think>\n\n</think>\n\nA cat has 4 legs.<|im_end|>"]
    assert ids[:len(prompt_ids(tok, CONV[:2]))] == prompt_ids(tok, CONV[:2])


def test_template_that_drops_earlier_reasoning_fails_clearly(toks):
    tok = toks["qwen3"]
    with pytest.raises(ChatTemplateError, match="chat template does not extend.*drops earlier reasoning") as e:
        tokenize_chat(tok, CONV)
    assert isinstance(e.value, DataError)
    report = CleanReport()   # a template problem stops the stage: it is not a row to count and drop
    with pytest.raises(ChatTemplateError):
        list(sft_examples([CONV[:3], CONV], tok, seq_len=512, overlong="truncate_prompt", min_tokens=1,
                          report=report))


def test_generation_prompt_that_is_not_the_turn_start_fails(tmp_path):
    bad = CHATML.replace("{{- '<|im_start|>assistant\n' }}{%- endif %}", "{{- '<|im_start|>bot\n' }}{%- endif %}")
    tok = load_tokenizer(build_tokenizer(tmp_path / "bad", "chatml"))
    tok.chat_template = bad
    with pytest.raises(ChatTemplateError, match="generation prompt"):
        tokenize_chat(tok, CONV[:3])


def test_template_without_a_special_end_of_turn_fails(tmp_path):
    tok = load_tokenizer(build_tokenizer(tmp_path / "plain", "chatml"))
    tok.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ChatTemplateError, match="does not start with a special token"):
        end_of_turn_ids(tok)


def test_answer_merging_with_the_template_text_drops_the_row(toks):
    """ChatML: an answer starting with newlines merges with the "\\n" ending its prompt once the next turn
    is rendered (byte-level BPE joins "\\n\\n\\n"): counted as turn_boundary, not mislabelled."""
    tok = toks["chatml"]
    conv = CONV[:2] + [{"role": "assistant", "content": "\n\nFour."}] + CONV[3:5]
    with pytest.raises(ChatRowError) as e:
        tokenize_chat(tok, conv)
    assert e.value.reason == "turn_boundary"
    report = CleanReport()
    got = list(sft_examples([conv, CONV], tok, seq_len=512, overlong="truncate_prompt", min_tokens=1,
                            report=report))
    assert len(got) == 1 and report.kept == 1 and report.dropped == {"turn_boundary": 1}
    assert "tokenises differently" in report.examples["turn_boundary"][0]


# ---------------------------------------------------------------- stopping

@pytest.mark.parametrize("family", ["glm4", "llama3", "chatml"])
def test_end_of_turn_ids(toks, family, tmp_path):
    tok = toks[family]
    assert end_of_turn_ids(tok) == tok.convert_tokens_to_ids(STOPS[family])
    without = load_tokenizer(build_tokenizer(tmp_path / family, family, generation_config=False))
    want = {"glm4": ["<|user|>", "<|endoftext|>"], "llama3": ["<|eot_id|>", "<|end_of_text|>"],
            "chatml": ["<|im_end|>"]}[family]   # from the template (+ eos) alone
    assert end_of_turn_ids(without) == without.convert_tokens_to_ids(want)


@pytest.mark.parametrize("family", ["glm4", "llama3", "chatml"])
def test_greedy_decode_stops_at_the_templates_end_of_turn(toks, family):
    """The model answers, then emits the template's end of turn and would ramble on: the decode stops
    there (at <|user|> for GLM-4, <|eot_id|> for Llama-3 although its eos is <|end_of_text|>)."""
    tok = toks[family]
    prompts = [CONV[:2], CONV[:4]]
    model = Oracle(len(tok))
    ramble = tok.encode(" and more words", add_special_tokens=False)
    end = tok.convert_tokens_to_ids(END[family][0])
    for p, answer in zip(prompts, ("Four.", "Two.")):
        body = tok.encode(rendered_answer(family, answer), add_special_tokens=False)
        model.teach(prompt_ids(tok, p), body + [end] + ramble + [tok.eos_token_id])
    assert greedy_answers(model, tok, prompts, max_new_tokens=40) == [rendered_answer(family, "Four."),
                                                                       rendered_answer(family, "Two.")]
    ids = [prompt_ids(tok, p) for p in prompts]
    got = greedy_decode(model, ids, max_new_tokens=40, eos_id=end_of_turn_ids(tok))
    assert [g[-1] for g in got] == [end, end]
    # A prompt near the context limit goes through the one-prompt-at-a-time path: the same stop.
    model.config.max_seq_len = len(ids[0]) + len(got[0]) + 1
    assert greedy_decode(model, ids[:1], max_new_tokens=40, eos_id=end_of_turn_ids(tok)) == got[:1]
    model.config.max_seq_len = 512
    # With the tokenizer's eos alone (the old stop), GLM-4 and Llama-3 answers ran on past the turn.
    old = greedy_decode(model, ids, max_new_tokens=40, eos_id=tok.eos_token_id)
    assert (old == got) == (family == "chatml")
