import json
import re
from pathlib import Path

import pytest

from glm_lora.configs.load import load_config
from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import COMPARE_PROMPTS

from glm_lora.data.formats import read_dpo, read_pretrain, read_sft
from glm_lora.data.synthetic import TASK_FAMILIES, UNITS, check_answer, generate, held_out_keys, prompt_keys, solve

COUNTS = dict(n_pretrain=300, n_sft=400, n_dpo=100, n_eval=50, held_out_prompts=COMPARE_PROMPTS)


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> dict[str, Path]:
    return generate(tmp_path_factory.mktemp("syn"), seed=3, **COUNTS)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def user(row: dict) -> str:
    return (row.get("conversations") or row["chosen"])[0]["content"]


def answer(row: dict) -> str:
    return row["conversations"][1]["content"]


def test_same_seed_same_bytes_other_seed_differs(out, tmp_path):
    again = generate(tmp_path / "a", seed=3, **COUNTS)
    other = generate(tmp_path / "b", seed=4, **COUNTS)
    assert set(again) == set(out) == {"pretrain", "pretrain_eval", "sft", "sft_eval", "dpo", "dpo_eval"}
    for name in out:
        assert again[name].read_bytes() == out[name].read_bytes(), name
        assert other[name].read_bytes() != out[name].read_bytes(), name


def test_eval_sets_do_not_depend_on_train_counts(out, tmp_path):
    bigger = generate(tmp_path, seed=3, **{**COUNTS, "n_sft": 500})
    assert bigger["sft_eval"].read_bytes() == out["sft_eval"].read_bytes()


def test_counts_and_families(out):
    n = {"pretrain": 300, "pretrain_eval": 50, "sft": 400, "sft_eval": 50, "dpo": 100, "dpo_eval": 50}
    for name, count in n.items():
        assert len(rows(out[name])) == count, name
    for name in ("sft", "sft_eval", "dpo", "dpo_eval"):
        assert {r["task"] for r in rows(out[name])} == set(TASK_FAMILIES), name


def test_eval_prompts_held_out(out):
    held_out = {user(r) for r in rows(out["sft_eval"])}
    assert len(held_out) == 50  # distinct
    assert held_out == {user(r) for r in rows(out["dpo_eval"])}
    for name in ("sft", "dpo"):
        assert not held_out & {user(r) for r in rows(out[name])}, name
    # task documents hold "Q: <prompt>\nA: <answer>" lines ("问：…" in Chinese); "3加4是多少？" is a
    # substring of "13加4是多少？", so match whole lines
    lines = {line for r in rows(out["pretrain"]) for line in r["text"].split("\n")}
    assert not {q + p for p in held_out for q in ("Q: ", "问：")} & lines
    assert not {r["text"] for r in rows(out["pretrain_eval"])} & {r["text"] for r in rows(out["pretrain"])}


def expected(task: str, prompt: str) -> set[str]:
    """Recompute the answer from the prompt alone (a set: units are matched by name)."""
    kind, lang = task.split("_")
    if kind in ("add", "sub"):
        a, b = map(int, re.findall(r"\d+", prompt))
        assert a >= b or kind == "add"
        return {str(a + b if kind == "add" else a - b)}
    if kind in ("copy", "reverse"):
        (s,) = re.findall(r'["“](.+?)["”]', prompt)
        return {s if kind == "copy" else s[::-1]}
    (v,) = map(int, re.findall(r"\d+", prompt))
    words = set(re.findall(r"[a-z]+", prompt))
    out = set()
    for en_big, en_small, zh_big, zh_small, f in UNITS:
        big, small, sep = (en_big, en_small, " ") if lang == "en" else (zh_big, zh_small, "")
        present = (lambda u: u in words) if lang == "en" else (lambda u: u in prompt)
        if present(big) and present(small):
            out.add(f"{v * f}{sep}{small}")
            if v % f == 0:
                out.add(f"{v // f}{sep}{big}")
    return out


@pytest.mark.parametrize("name", ["sft", "sft_eval"])
def test_every_sft_answer_is_correct(out, name):
    for r in rows(out[name]):
        assert [m["role"] for m in r["conversations"]] == ["user", "assistant"]
        assert answer(r) in expected(r["task"], user(r)), r
        assert solve(user(r)) == answer(r), r


def test_string_tasks_shapes(out):
    for r in rows(out["sft"]):
        if r["task"].startswith(("copy", "reverse")):
            s = answer(r)
            assert (3 <= len(s) <= 8 and s.isascii() and s.islower()) if r["task"].endswith("en") else 2 <= len(s) <= 6


def test_dpo_chosen_correct_and_rejected_wrong_same_shape(out):
    for r in rows(out["dpo"]) + rows(out["dpo_eval"]):
        chosen, rejected = r["chosen"][1]["content"], r["rejected"][1]["content"]
        assert r["chosen"][0] == r["rejected"][0]
        assert chosen in expected(r["task"], r["chosen"][0]["content"])
        assert rejected != chosen
        if r["task"].startswith(("add", "sub")):
            assert re.fullmatch(r"-?\d+", rejected)
        if r["task"].startswith("units"):
            assert re.sub(r"\d+", "", rejected) == re.sub(r"\d+", "", chosen)


def test_pretrain_documents(out):
    docs = list(read_pretrain(out["pretrain"]))
    assert all(20 <= len(d) <= 400 for d in docs)
    assert sum(len(d) < 150 for d in docs) > len(docs) / 2  # skewed short
    assert any(re.search(r"[a-z]", d) for d in docs) and any(re.search("[\u4e00-\u9fff]", d) for d in docs)
    # a tokenizer trained on pretrain.jsonl sees every character the task files use
    corpus = set("".join(docs))
    for name in ("sft", "sft_eval", "dpo", "dpo_eval"):
        for r in rows(out[name]):
            for m in r.get("conversations", []) + r.get("chosen", []) + r.get("rejected", []):
                assert set(m["content"]) <= corpus, (name, m["content"])


def test_files_pass_the_readers(out):
    assert len(list(read_sft(out["sft"]))) == 400
    prompt, chosen, rejected = next(read_dpo(out["dpo"]))
    assert prompt[0]["role"] == "user" and chosen["role"] == rejected["role"] == "assistant"
    assert len(list(read_dpo(out["dpo_eval"]))) == 50
    assert len(list(read_pretrain(out["pretrain_eval"]))) == 50


def test_check_answer():
    assert check_answer("add_en", " 19\n", "19")
    assert not check_answer("add_en", "019", "19")
    assert check_answer("units_zh", "3000米", "3000米") and not check_answer("units_en", "3000m", "3000 m")


def test_cli(tmp_path):
    from glm_lora.data.synthetic import main

    main([str(tmp_path), "--seed", "1", "--n-pretrain", "20", "--n-sft", "20", "--n-dpo", "10", "--n-eval", "10"])
    assert len(rows(tmp_path / "sft.jsonl")) == 20


def test_sft_weights_set_the_mix_and_leave_the_eval_sets_alone(tmp_path):
    import collections
    from glm_lora.data import synthetic
    plain = synthetic.generate(tmp_path / "a", n_pretrain=20, n_sft=300, n_dpo=20, n_eval=20)
    heavy = synthetic.generate(tmp_path / "b", n_pretrain=20, n_sft=300, n_dpo=20, n_eval=20,
                               sft_weights={"add_en": 3})
    count = lambda p: collections.Counter(json.loads(l)["task"] for l in p.open(encoding="utf-8"))
    assert set(count(plain["sft"]).values()) == {30}
    assert count(heavy["sft"])["add_en"] == 75 and count(heavy["sft"])["sub_en"] == 25
    assert plain["sft_eval"].read_bytes() == heavy["sft_eval"].read_bytes()
    with pytest.raises(UserError, match="unknown task families"):
        synthetic.generate(tmp_path / "c", n_pretrain=20, n_sft=10, n_dpo=5, n_eval=10, sft_weights={"mul_en": 1})


def operands(row: dict) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", user(row))]


def test_operands_drawn_by_digit_count(tmp_path):
    """1, 2 and 3 digits a third each, per operand; values spread over each digit count's range."""
    import collections
    files = generate(tmp_path, seed=1, n_pretrain=20, n_sft=6000, n_dpo=10, n_eval=10)
    arith = [r for r in rows(files["sft"]) if r["task"].startswith(("add", "sub"))]
    digits = collections.Counter(len(str(x)) for r in arith for x in operands(r))
    total = sum(digits.values())                     # 4800 operands: a third is 1600 ± 33 (one s.d.)
    assert set(digits) == {1, 2, 3} and all(abs(n / total - 1 / 3) < 0.03 for n in digits.values()), digits
    values = {x for r in arith for x in operands(r)}
    assert set(range(10)) <= values and {10, 99, 100, 999} & values
    assert all(a >= b for r in arith if r["task"].startswith("sub") for a, b in [operands(r)])


def test_prompt_keys_parse_the_fixed_prompts():
    assert prompt_keys("What is 12 + 7?") == {("add_en", 12, 7), ("add_zh", 12, 7)}   # both languages
    assert prompt_keys("计算 80 - 26。") == {("sub_zh", 80, 26), ("sub_en", 80, 26)}
    assert prompt_keys("3 km = ? m") == {("units_en", 0, "km", 3), ("units_zh", 0, "千米", 3)}
    assert prompt_keys("2小时等于多少分钟？") == {("units_zh", 4, "小时", 2), ("units_en", 4, "h", 2)}
    assert prompt_keys('Spell "garden" in reverse order.') == {("reverse_en", "garden")}
    assert all(prompt_keys(p) for p in COMPARE_PROMPTS)
    assert [solve(p) for p in COMPARE_PROMPTS] == ["19", "83", "74", "54", "planet", "山水", "nedrag", "鱼狗猫",
                                                   "3000 m", "120分钟"]
    assert solve("Hello") is None
    with pytest.raises(UserError, match="held_out_prompts: 'Hello' is in none of the synthetic task templates"):
        held_out_keys(["What is 1 + 2?", "Hello"])


def test_default_config_holds_out_every_fixed_prompt():
    cfg = load_config("tiny")
    assert {cfg.serve.prompt, *cfg.eval.compare_prompts} <= set(cfg.data.synthetic.held_out_prompts)


def train_keys(files: dict[str, Path]) -> set[tuple]:
    """Every problem key in the SFT/DPO files and the pretraining task documents."""
    keys = {k for name in ("sft", "dpo") for r in rows(files[name]) for k in prompt_keys(user(r))
            if k[0] == r["task"]}
    for r in rows(files["pretrain"]):
        for line in r["text"].split("\n"):
            if line.startswith(("Q: ", "问：")):
                keys |= prompt_keys(line[3 if line.startswith("Q") else 2:])
    return keys


def test_fixed_prompts_absent_from_every_training_file(out):
    fixed = held_out_keys(COMPARE_PROMPTS)
    assert not fixed & train_keys(out)
    pretrain = out["pretrain"].read_text(encoding="utf-8")
    for fact in ("12 plus 7 is", "12加7等于", "3 km is 3000 m", "3千米等于3000米", "2 h is 120 min", "2小时等于120分钟"):
        assert fact not in pretrain


def test_a_whole_small_key_space_held_out(tmp_path):
    """All 100 one-digit sums held out (both languages): none in any training file or fact, and the
    training files still fill up; eval stays unique where a bucket has few keys (1-digit pairs: 100)."""
    small = [f"What is {a} + {b}?" for a in range(10) for b in range(10)]
    files = generate(tmp_path, seed=2, n_pretrain=1500, n_sft=3000, n_dpo=500, n_eval=1000, held_out_prompts=small)
    keys = train_keys(files)
    assert not {k for k in keys if k[0].startswith("add") and max(k[1:]) < 10}
    assert len(rows(files["sft"])) == 3000 and sum(r["task"] == "add_zh" for r in rows(files["sft"])) == 300
    assert not re.search(r"(?<!\d)\d plus \d is|(?<!\d)\d加\d等于", files["pretrain"].read_text(encoding="utf-8"))
    evals = [user(r) for r in rows(files["sft_eval"])]
    assert len(set(evals)) == 1000
    one_digit = [r for r in rows(files["sft_eval"]) if r["task"] == "add_en" and max(operands(r)) < 10]
    assert one_digit    # held-out prompts do not shape the eval set: it keeps its own 1-digit sums
