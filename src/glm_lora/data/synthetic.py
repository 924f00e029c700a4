"""Deterministic bilingual (English + Chinese) toy data: a pretraining corpus, SFT and DPO sets.

Ten task families with short, exactly checkable answers (add/sub/copy/reverse/units × en/zh).
Choices worth knowing:
- Arithmetic operands are drawn by digit count, then by value: 1, 2 or 3 digits evenly (0–9,
  10–99, 100–999), each operand on its own, so "12 + 7" is as common as "512 + 347" (drawn
  uniformly from 0–999, 99% of problems had two 3-digit operands and small sums went unlearnt).
- Subtraction keeps a >= b, so correct answers are never negative (a DPO rejected answer
  may be negative: off by 1 or 10 below 0).
- Held-out means held-out *problem*: an eval example's key (task + operands/string/units,
  not the phrasing) appears in no train file, including the task-like pretraining text and
  the pretraining facts ("12 plus 7 is 19."). `sft_eval` and `dpo_eval` share the same
  held-out prompts.
- The fixed prompts (README demo, `serve.prompt`, `eval.compare_prompts`: passed as
  `held_out_prompts`) are held out the same way, in both languages, so a right answer to
  them shows generalisation, not recall.
- Each output file has its own random stream derived from `seed`, so changing `n_sft`
  leaves the eval sets (and the other files) unchanged.
- The pretraining corpus opens with a few "character list" documents covering every
  character the task files can use, so a tokenizer trained on it never meets an unseen
  character in SFT/DPO.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from glm_lora.artifacts.manifest import atomic_write_text
from glm_lora.configs.errors import UserError

TASK_FAMILIES: tuple[str, ...] = (
    "add_en", "add_zh", "sub_en", "sub_zh", "copy_en", "copy_zh",
    "reverse_en", "reverse_zh", "units_en", "units_zh",
)

# 100 common, concrete characters for the Chinese copy/reverse tasks.
ZH_CHARS = (
    "猫狗鱼鸟马牛羊猪鸡鸭" "天地山水火木金土日月" "星云雨雪风花草树叶果" "红黄蓝绿白黑大小多少"
    "上下左右前后东南西北" "一二三四五六七八九十" "人口手足目耳心头家门" "车船书笔纸米面茶饭肉"
    "春夏秋冬年时学生老师" "好美男女父母兄弟朋友"
)
assert len(set(ZH_CHARS)) == 100

# (en big, en small, zh big, zh small, small units per big unit)
UNITS: tuple[tuple[str, str, str, str, int], ...] = (
    ("km", "m", "千米", "米", 1000),
    ("m", "cm", "米", "厘米", 100),
    ("cm", "mm", "厘米", "毫米", 10),
    ("kg", "g", "千克", "克", 1000),
    ("h", "min", "小时", "分钟", 60),
    ("min", "s", "分钟", "秒", 60),
)

# Every template keeps operands in reading order (a before b), so answers can be recomputed
# from the numbers in the prompt.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "add_en": ("What is {a} + {b}?", "Compute {a} plus {b}.", "Add {a} and {b}."),
    "add_zh": ("{a} 加 {b} 等于多少？", "计算 {a} + {b}。", "{a}加{b}是多少？"),
    "sub_en": ("What is {a} - {b}?", "Compute {a} minus {b}.", "What is {a} minus {b}?"),
    "sub_zh": ("{a} 减 {b} 等于多少？", "计算 {a} - {b}。", "{a}减去{b}是多少？"),
    "copy_en": ('Copy the word "{s}".', 'Repeat "{s}" exactly.', 'Write "{s}" again.'),
    "copy_zh": ("请重复“{s}”。", "把“{s}”照抄一遍。", "复制“{s}”。"),
    "reverse_en": ('Reverse the word "{s}".', 'Write "{s}" backwards.', 'Spell "{s}" in reverse order.'),
    "reverse_zh": ("请把“{s}”倒过来写。", "把“{s}”反过来。", "倒序写出“{s}”。"),
    "units_en": ("Convert {v} {src} to {dst}.", "How many {dst} are in {v} {src}?", "{v} {src} = ? {dst}"),
    "units_zh": ("{v}{src}等于多少{dst}？", "把{v}{src}换算成{dst}。", "{v}{src}是多少{dst}？"),
}


@dataclass(frozen=True)
class Example:
    task: str
    key: tuple  # the problem without its phrasing; eval keys never appear in train
    prompt: str
    answer: str
    wrong: str  # a plausible wrong answer of the same shape (DPO rejected)


def _operand(rng: random.Random) -> int:
    """1, 2 or 3 digits with equal chance, then a value of that many digits (0–9, 10–99, 100–999)."""
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def _arith(rng: random.Random, task: str) -> Example:
    a, b = _operand(rng), _operand(rng)
    if task.startswith("sub"):
        a, b = max(a, b), min(a, b)
        r = a - b
    else:
        r = a + b
    wrong = r + rng.choice((-10, -1, 1, 10))
    prompt = rng.choice(TEMPLATES[task]).format(a=a, b=b)
    return Example(task, (task, a, b), prompt, str(r), str(wrong))


def _corrupt(s: str, alphabet: str, rng: random.Random) -> str:
    """One swapped adjacent pair, one dropped or one replaced character; never `s` itself."""
    while True:
        i = rng.randrange(len(s))
        op = rng.choice(("swap", "drop", "replace"))
        if op == "swap" and i + 1 < len(s):
            out = s[:i] + s[i + 1] + s[i] + s[i + 2:]
        elif op == "drop":
            out = s[:i] + s[i + 1:]
        else:
            out = s[:i] + rng.choice(alphabet) + s[i + 1:]
        if out != s:
            return out


def _string(rng: random.Random, task: str) -> Example:
    alphabet, lo, hi = (string.ascii_lowercase, 3, 8) if task.endswith("en") else (ZH_CHARS, 2, 6)
    s = "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))
    answer = s[::-1] if task.startswith("reverse") else s
    prompt = rng.choice(TEMPLATES[task]).format(s=s)
    return Example(task, (task, s), prompt, answer, _corrupt(answer, alphabet, rng))


def _units(rng: random.Random, task: str) -> Example:
    i = rng.randrange(len(UNITS))
    en_big, en_small, zh_big, zh_small, f = UNITS[i]
    big, small, sep = (en_big, en_small, " ") if task.endswith("en") else (zh_big, zh_small, "")
    n = rng.randint(1, 99)
    if rng.random() < 0.5:  # big → small
        v, r, src, dst = n, n * f, big, small
    else:
        v, r, src, dst = n * f, n, small, big
    # Wrong factor: off by 10× either way (÷10 only when it stays a non-zero integer).
    wrong = r // 10 if r % 10 == 0 and r >= 100 and rng.random() < 0.5 else r * 10
    prompt = rng.choice(TEMPLATES[task]).format(v=v, src=src, dst=dst)
    return Example(task, (task, i, src, v), prompt, f"{r}{sep}{dst}", f"{wrong}{sep}{dst}")


_MAKERS: dict[str, Callable[[random.Random, str], Example]] = {
    t: {"add": _arith, "sub": _arith, "copy": _string, "reverse": _string, "units": _units}[t.split("_")[0]]
    for t in TASK_FAMILIES
}


def make_example(rng: random.Random, task: str) -> Example:
    return _MAKERS[task](rng, task)


def _pattern(template: str) -> re.Pattern:
    """A template as a regex: numbers ({a}, {b}, {v}) as digits, strings and unit names as text."""
    out = ""
    for literal, field, _, _ in string.Formatter().parse(template):
        out += re.escape(literal)
        if field is not None:
            out += rf"(?P<{field}>\d+)" if field in ("a", "b", "v") else rf"(?P<{field}>.+?)"
    return re.compile(out)


_PATTERNS = {task: tuple(map(_pattern, ts)) for task, ts in TEMPLATES.items()}


def _parse(prompt: str) -> list[tuple[str, dict]]:
    """(task, fields) for every template the prompt fills in; unit names resolved to (UNITS index, src index)."""
    found = []
    for task, patterns in _PATTERNS.items():
        for m in filter(None, (p.fullmatch(prompt.strip()) for p in patterns)):
            g = m.groupdict()
            if task.startswith("units"):
                for i, u in enumerate(UNITS):
                    names = u[:2] if task.endswith("en") else u[2:4]
                    if (g["src"], g["dst"]) in (names, names[::-1]):
                        found.append((task, {**g, "unit": i, "src_i": names.index(g["src"])}))
            else:
                found.append((task, g))
    return found


def prompt_keys(prompt: str) -> set[tuple]:
    """The problem keys a prompt in one of the templates asks: arithmetic and units in both languages
    (the same problem translated), copy/reverse as written; empty if it is none of the templates."""
    keys: set[tuple] = set()
    for task, g in _parse(prompt):
        kind, lang = task.split("_")
        twin = f"{kind}_{'zh' if lang == 'en' else 'en'}"
        if kind in ("add", "sub"):
            keys |= {(task, int(g["a"]), int(g["b"])), (twin, int(g["a"]), int(g["b"]))}
        elif kind in ("copy", "reverse"):
            keys.add((task, g["s"]))
        else:
            u, v = UNITS[g["unit"]], int(g["v"])
            keys |= {(f"units_{x}", g["unit"], u[g["src_i"] + (0 if x == "en" else 2)], v) for x in ("en", "zh")}
    return keys


def solve(prompt: str) -> str | None:
    """The reference answer to a prompt in one of the templates (as the generator writes it), else None."""
    for task, g in _parse(prompt):
        kind, lang = task.split("_")
        if kind in ("add", "sub"):
            a, b = int(g["a"]), int(g["b"])
            return str(a + b if kind == "add" else a - b)
        if kind in ("copy", "reverse"):
            return g["s"] if kind == "copy" else g["s"][::-1]
        v, f = int(g["v"]), UNITS[g["unit"]][4]
        if g["src_i"] == 0 or v % f == 0:
            return f"{v * f if g['src_i'] == 0 else v // f}{' ' if lang == 'en' else ''}{g['dst']}"
    return None


def held_out_keys(prompts: Iterable[str]) -> set[tuple]:
    """Every problem key the fixed prompts ask (`prompt_keys`); a prompt in no template is an error."""
    keys: set[tuple] = set()
    for p in prompts:
        found = prompt_keys(p)
        if not found:
            raise UserError(f"data.synthetic.held_out_prompts: {p!r} is in none of the synthetic task templates "
                            "(data/synthetic.py TEMPLATES), so there is no problem to hold out; remove it")
        keys |= found
    return keys


def _families(n: int, weights: dict[str, float] | None) -> Iterable[str]:
    """n family names interleaved evenly in proportion to `weights` (default: round-robin)."""
    weights = {t: (weights or {}).get(t, 1.0) for t in TASK_FAMILIES}
    total, counts = sum(weights.values()), dict.fromkeys(TASK_FAMILIES, 0)
    for i in range(n):
        task = max(TASK_FAMILIES, key=lambda t: weights[t] * (i + 1) / total - counts[t])
        counts[task] += 1
        yield task


def _examples(rng: random.Random, n: int, exclude: set[tuple], unique: bool = False,
              weights: dict[str, float] | None = None) -> list[Example]:
    """n examples, families interleaved by `weights`, none whose key is in `exclude` (nor repeated, if unique)."""
    out: list[Example] = []
    seen = set(exclude)
    for task in _families(n, weights):
        for _ in range(10_000):
            ex = make_example(rng, task)
            if ex.key not in seen:
                break
        else:
            raise UserError(f"data.synthetic: cannot draw {n} distinct {task} problems; lower data.synthetic.n_sft / "
                            "n_dpo / n_eval")
        if unique:
            seen.add(ex.key)
        out.append(ex)
    return out


def check_answer(task: str, prediction: str, reference: str) -> bool:
    """Exact match after stripping surrounding whitespace (the same rule for every family)."""
    return prediction.strip() == reference.strip()


# ---------------------------------------------------------------- pretraining corpus
# Each fact is a parallel (English, Chinese) pair; documents use one side or both.
_COLOURS = (("The sky", "天空", "blue", "蓝色"), ("Grass", "草", "green", "绿色"),
            ("Snow", "雪", "white", "白色"), ("Coal", "煤", "black", "黑色"),
            ("A banana", "香蕉", "yellow", "黄色"), ("Blood", "血", "red", "红色"),
            ("An orange", "橙子", "orange", "橙色"))
_ANIMALS = (("cat", "猫", 4, "只"), ("dog", "狗", 4, "只"), ("bird", "鸟", 2, "只"),
            ("horse", "马", 4, "匹"), ("duck", "鸭子", 2, "只"), ("cow", "牛", 4, "头"))
_CITIES = (("Beijing", "北京", "China", "中国"), ("Shanghai", "上海", "China", "中国"),
           ("London", "伦敦", "England", "英国"), ("Paris", "巴黎", "France", "法国"),
           ("Tokyo", "东京", "Japan", "日本"), ("New York", "纽约", "America", "美国"),
           ("Berlin", "柏林", "Germany", "德国"))
_DAYS = (("Monday", "星期一"), ("Tuesday", "星期二"), ("Wednesday", "星期三"), ("Thursday", "星期四"),
         ("Friday", "星期五"), ("Saturday", "星期六"), ("Sunday", "星期天"))
_PEOPLE = (("Tom", "小明", "He", "他"), ("Amy", "小红", "She", "她"),
           ("Li Lei", "李雷", "He", "他"), ("Anna", "安娜", "She", "她"))
_THINGS = (("ball", "球", "个"), ("book", "书", "本"), ("apple", "苹果", "个"), ("cup", "杯子", "个"))


def _fact(rng: random.Random, exclude: set[tuple]) -> tuple[str, str]:
    """A (English, Chinese) fact; never a sum or unit conversion whose problem key is in `exclude`."""
    kind = rng.randrange(8)
    if kind == 0:
        thing, thing_zh, c, c_zh = rng.choice(_COLOURS)
        return f"{thing} is {c}.", f"{thing_zh}是{c_zh}的。"
    if kind == 1:
        a, a_zh, legs, _ = rng.choice(_ANIMALS)
        return f"A {a} has {legs} legs.", f"{a_zh}有{legs}条腿。"
    if kind == 2:
        city, city_zh, country, country_zh = rng.choice(_CITIES)
        return f"{city} is a city in {country}.", f"{city_zh}是{country_zh}的一个城市。"
    if kind == 3:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        if {("add_en", a, b), ("add_zh", a, b)} & exclude:
            return _fact(rng, exclude)
        return f"{a} plus {b} is {a + b}.", f"{a}加{b}等于{a + b}。"
    if kind == 4:
        a, b = sorted(rng.sample(range(100), 2), reverse=True)
        return f"{a} is bigger than {b}.", f"{a}比{b}大。"
    if kind == 5:
        i = rng.randrange(7)
        (d, d_zh), (e, e_zh) = _DAYS[i], _DAYS[(i + 1) % 7]
        return f"After {d} comes {e}.", f"{d_zh}之后是{e_zh}。"
    if kind == 6:
        i = rng.randrange(len(UNITS))
        big, small, big_zh, small_zh, f = UNITS[i]
        v = rng.choice((1, 1, 2, 3, 5, 10))
        if {("units_en", i, big, v), ("units_zh", i, big_zh, v)} & exclude:
            return _fact(rng, exclude)
        return f"{v} {big} is {v * f} {small}.", f"{v}{big_zh}等于{v * f}{small_zh}。"
    return _story(rng)


def _story(rng: random.Random) -> tuple[str, str]:
    (p, p_zh, he, he_zh), (q, q_zh, *_) = rng.sample(_PEOPLE, 2)
    if rng.random() < 0.5:
        thing, thing_zh, mw = rng.choice(_THINGS)
        _, _, c, c_zh = rng.choice(_COLOURS)
        art = "an" if c[0] in "aeiou" else "a"
        return (f"{p} has {art} {c} {thing}. {he} gives the {thing} to {q}. Now {q} has the {thing}.",
                f"{p_zh}有一{mw}{c_zh}的{thing_zh}。{he_zh}把{thing_zh}给了{q_zh}。现在{q_zh}有{thing_zh}。")
    city, city_zh, *_ = rng.choice(_CITIES)
    day, day_zh = rng.choice(_DAYS)
    a, a_zh, _, mw = rng.choice(_ANIMALS)
    _, _, c, c_zh = rng.choice(_COLOURS)
    return (f"{p} goes to {city} on {day}. {he} sees a {a}. The {a} is {c}.",
            f"{p_zh}{day_zh}去{city_zh}。{he_zh}看见一{mw}{a_zh}。这{mw}{a_zh}是{c_zh}的。")


def _document(rng: random.Random, exclude: set[tuple]) -> str:
    """One document of 20–400 characters, lengths skewed short."""
    target = 20 + int(380 * rng.random() ** 2.5)
    kind = rng.choices(("en", "zh", "parallel", "tasks"), weights=(35, 35, 10, 20))[0]
    sep = {"en": " ", "zh": "", "parallel": " ", "tasks": "\n"}[kind]
    doc = ""
    while len(doc) < target:
        if kind == "tasks":
            ex = make_example(rng, rng.choice(TASK_FAMILIES))
            if ex.key in exclude:  # held-out problems stay out of pretraining too
                continue
            q, a = ("Q: ", "A: ") if ex.task.endswith("en") else ("问：", "答：")
            part = f"{q}{ex.prompt}\n{a}{ex.answer}"
        else:
            en, zh = _fact(rng, exclude)
            part = {"en": en, "zh": zh, "parallel": f"{en} {zh}"}[kind]
        longer = f"{doc}{sep}{part}" if doc else part
        if len(longer) > 400:
            break
        doc = longer
    return doc


def task_charset() -> str:
    """Every character the SFT/DPO files can contain."""
    literal = "".join(lit for ts in TEMPLATES.values() for t in ts
                      for lit, *_ in string.Formatter().parse(t))
    units = "".join("".join(u[:4]) for u in UNITS)
    return "".join(sorted(set(literal + units + ZH_CHARS + string.ascii_letters + string.digits + "-")))


def _coverage_docs() -> list[str]:
    chars = task_charset().replace(" ", "")
    k = -(-len(chars) // 100)  # ceil: chunks of ≤ 100 characters
    step = -(-len(chars) // k)
    return [f"Characters 字符: {' '.join(chars[i:i + step])}" for i in range(0, len(chars), step)]


def _pretrain(rng: random.Random, n: int, exclude_tasks: set[tuple], exclude_docs: set[str],
              coverage: bool) -> list[str]:
    docs = _coverage_docs() if coverage else []
    if len(docs) > n:
        raise UserError(f"data.synthetic.n_pretrain must be at least {len(docs)} (the character-coverage documents)")
    seen = set(exclude_docs) | set(docs)
    while len(docs) < n:
        doc = _document(rng, exclude_tasks)
        if doc not in seen:
            seen.add(doc)
            docs.append(doc)
    rng.shuffle(docs)
    return docs


# ---------------------------------------------------------------- output
def _sft_row(ex: Example) -> dict:
    return {"conversations": [{"role": "user", "content": ex.prompt},
                              {"role": "assistant", "content": ex.answer}], "task": ex.task}


def _dpo_row(ex: Example) -> dict:
    user = {"role": "user", "content": ex.prompt}
    return {"chosen": [user, {"role": "assistant", "content": ex.answer}],
            "rejected": [user, {"role": "assistant", "content": ex.wrong}], "task": ex.task}


def _write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def generate(out_dir: Path, *, seed: int = 0, n_pretrain: int = 4000, n_sft: int = 4000,
             n_dpo: int = 1000, n_eval: int = 200, sft_weights: dict[str, float] | None = None,
             held_out_prompts: Iterable[str] = ()) -> dict[str, Path]:
    """Write the six JSONL files into `out_dir`; the same seed gives byte-identical files.

    `sft_weights` (family → weight, default 1) sets the SFT file's mix; eval sets stay balanced.
    `held_out_prompts`: fixed prompts (demo, comparison) whose problems no training file may hold.
    """
    unknown = set(sft_weights or ()) - set(TASK_FAMILIES)
    if unknown:
        raise UserError(f"data.synthetic.sft_weights: unknown task families {sorted(unknown)}; known: "
                        f"{', '.join(TASK_FAMILIES)}")
    out_dir = Path(out_dir)

    def rng(name: str) -> random.Random:  # one stream per file (str seeds are hashed stably)
        return random.Random(f"glm-lora-synthetic:{seed}:{name}")

    fixed = held_out_keys(held_out_prompts)
    evals = _examples(rng("eval"), n_eval, exclude=set(), unique=True)
    held_out = {ex.key for ex in evals} | fixed
    pretrain_eval = _pretrain(rng("pretrain_eval"), n_eval, held_out, set(), coverage=False)
    pretrain = _pretrain(rng("pretrain"), n_pretrain, held_out, set(pretrain_eval), coverage=True)
    rows = {
        "pretrain": ({"text": t} for t in pretrain),
        "pretrain_eval": ({"text": t} for t in pretrain_eval),
        "sft": map(_sft_row, _examples(rng("sft"), n_sft, held_out, weights=sft_weights)),
        "sft_eval": map(_sft_row, evals),
        "dpo": map(_dpo_row, _examples(rng("dpo"), n_dpo, held_out)),
        "dpo_eval": map(_dpo_row, evals),
    }
    return {name: _write_jsonl(out_dir / f"{name}.jsonl", r) for name, r in rows.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--seed", type=int, default=0)
    for name, default in (("pretrain", 4000), ("sft", 4000), ("dpo", 1000), ("eval", 200)):
        p.add_argument(f"--n-{name}", type=int, default=default)
    a = p.parse_args(argv)
    paths = generate(a.out_dir, seed=a.seed, n_pretrain=a.n_pretrain, n_sft=a.n_sft,
                     n_dpo=a.n_dpo, n_eval=a.n_eval)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
