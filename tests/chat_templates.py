"""Chat templates of the model families users bring (GLM-4, Llama-3, ChatML, Qwen3) and a builder for
small local tokenizers that carry them: nothing is downloaded. Shared by the template, DAG and vLLM tests.

The templates are written from the public tokenizer_config.json files (transformers ships none of them):
- GLM-4: THUDM/glm-4-9b-chat(-hf), tools preamble shortened (it only renders with `tools`);
  eos <|endoftext|>, generation_config eos_token_id [<|endoftext|>, <|user|>, <|observation|>].
- Llama-3: meta-llama/Meta-Llama-3-8B-Instruct (as first released: eos <|end_of_text|>, so stopping
  at <|eot_id|> must come from the template); generation_config eos_token_id [128001, 128009].
- ChatML: Qwen2.5-Instruct without the tools branch (a default system prompt when none is given).
- Qwen3: the assistant branch of Qwen3's template, which renders <think> blocks only after the last
  user turn, i.e. drops earlier reasoning: its renders don't extend each other.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")

GLM4 = (
    "[gMASK]<sop>{% for item in messages %}{% if item['tools'] is defined %}<|system|>\n"
    "你是一个名为 ChatGLM 的人工智能助手。\n\n# 可用工具{% set tools = item['tools'] %}{% for tool in tools %}"
    "{% if tool['type'] == 'function' %}\n\n## {{ tool['function']['name'] }}\n\n"
    "{{ tool['function'] | tojson(indent=4) }}\n在调用上述函数时，请使用 Json 格式表示调用的参数。{% endif %}"
    "{% endfor %}{% endif %}{% if item['content'] %}<|{{ item['role'] }}|>{{ item['metadata'] }}\n"
    "{{ item['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant') %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' "
    "+ '\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
QWEN3 = (
    "{%- set ns = namespace(last_query_index=0) %}{%- for message in messages %}{%- if message.role == 'user' %}"
    "{%- set ns.last_query_index = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' "
    "+ content.lstrip('\n') }}{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}{{- '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

FAMILIES = {
    "glm4": dict(template=GLM4, eos="<|endoftext|>", bos=None, pad="<|endoftext|>",
                 specials=["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
                           "<|user|>", "<|assistant|>", "<|observation|>"],
                 generation_eos=["<|endoftext|>", "<|user|>", "<|observation|>"]),
    "llama3": dict(template=LLAMA3, eos="<|end_of_text|>", bos="<|begin_of_text|>", pad="<|end_of_text|>",
                   specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eot_id|>"],
                   generation_eos=["<|end_of_text|>", "<|eot_id|>"]),
    "chatml": dict(template=CHATML, eos="<|im_end|>", bos=None, pad="<|endoftext|>",
                   specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                   generation_eos=["<|im_end|>", "<|endoftext|>"]),
    "qwen3": dict(template=QWEN3, eos="<|im_end|>", bos=None, pad="<|endoftext|>",
                  specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], generation_eos=None),
}
def corpus(n: int = 1500):
    rng = random.Random(0)
    words = ("hello world reverse copy the answer is add what how many legs does a cat have bird two one word "
             "system user assistant you briefly walk on").split()
    for _ in range(n):
        yield " ".join(rng.choices(words, k=6)) + rng.choice([".", "?", "!\n", "\n\n", " 42", ":\n"])


def build_tokenizer(out: Path, family: str, *, generation_config: bool = True) -> Path:
    """A byte-level BPE tokenizer with `family`'s special tokens and chat template, saved as HF files."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    f = FAMILIES[family]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=500, special_tokens=f["specials"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=f["eos"], bos_token=f["bos"], pad_token=f["pad"])
    tok.chat_template = f["template"]
    tok.save_pretrained(str(out))
    if generation_config and f["generation_eos"]:
        ids = [tk.token_to_id(t) for t in f["generation_eos"]]
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return out


def labelled_spans(ids: list[int], labels: list[int], ignore: int = -100) -> list[list[int]]:
    """The labelled runs of an (ids, labels) example, checking every label is the token at its position."""
    out, cur = [], []
    for i, lab in zip(ids, labels):
        if lab != ignore:
            assert lab == i
            cur.append(i)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])
