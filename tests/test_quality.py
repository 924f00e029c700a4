"""The embedded default learns: the whole tiny DAG (default config, no serving) clears stated floors.

These floors sit below what the default reaches (bench/RESULTS.md, "The tiny default's answer quality") so that noise between
machines passes while a regression in learning (data, tokenizer, model, losses, schedule) fails.
"""
import pytest

from glm_lora.configs.load import load_config
from bench.quality.fresh import WEAK_FAMILIES, fresh_eval
from bench.quality.on_run import grpo_gain
from glm_lora.flows.cli import run_one_stage

pytestmark = pytest.mark.slow

# Measured on the default (bench/RESULTS.md): stated here, checked below.
# The same seed lands differently from run to run on the CPU (bf16 rounding follows the thread layout: three fresh-clone
# flows of the 4000-step default, all seed 0, gave SFT exact match 0.905, 0.905 and 0.93), so the floors sit at or
# below the lowest of the 15-seed GPU sweep (bench/results/quality_sweep_fewer_steps_*.jsonl) and of the CPU runs,
# not at their medians. They were set for the 4500-step recipe and are unchanged; the 4000-step one reached them
# closer in its tails (bench/RESULTS.md "Fewer SFT steps at equal quality"); the arithmetic-weighted mix at 3500 SFT /
# 300 DPO steps (now the default) clears them by more, CPU seeds 0 / 1 / 2 at one thread as CI's workers train
# (bench/RESULTS.md "The SFT mix", "DPO steps again"): SFT 0.98 / 0.96 / 0.95, lowest family 0.90 / 0.85 / 0.85, DPO
# reward accuracy 0.93 / 0.935 / 0.905 (seeds 3-6: 0.87-0.94), DPO − SFT on fresh prompts −2.2 / −0.9 / −1.2 points
# (seeds 3-6: −1.1 to −2.3).
FLOORS = {
    "pretrain_perplexity_drop": 5.0,        # held-out perplexity at init / after pretraining
    "sft_val_loss_drop": 1.0,               # first → best SFT validation loss (nats per answer token)
    "sft_exact_match": 0.89,                # mean over the 10 families (CPU runs 0.905, 0.905, 0.93; GPU sweep median of
                                            # 15 seeds 0.93, range 0.915–0.96; the 4500-step recipe: 0.905–0.96)
    "sft_lowest_family": 0.65,              # the weakest family, add or sub (CPU runs 0.70, 0.70, 0.80; sweep 0.65–0.80)
    "sft_string_families": 0.90,            # copy/reverse, en + zh, 20 prompts each: 1.0 on the machines the recipe
                                            # was tuned on; copy_en 0.90 (18 of 20) on an Intel Xeon with AMX, whose bf16
                                            # kernels round otherwise (same adapters from edc5ce5's code and today's there)
    "dpo_implicit_reward_accuracy": 0.86,   # CPU runs 0.87, 0.92, 0.895; GPU sweep median 0.915 (0.875–0.95)
    "dpo_exact_match_loss": 0.025,          # DPO may cost at most this much exact match, on ~1,600 fresh prompts (the new
                                            # default's seeds 0-2 −1.3 / −1.1 / −1.0 points; on the stages' 200 prompts: CPU
                                            # runs of the even mix +0.5, 0, −2.5; GPU sweep −2.5…+1, mean −0.7)
    # dpo.loss ipo / simpo / kto, 100 steps on the default's SFT model, 200 held-out pairs (CPU, 2026-12-03: IPO 0.87,
    # SimPO 0.78, KTO 0.80 on an fp32-trained default; one s.e. ≈ 0.03); the likelihood ranking was 0.99 → 0.98–0.985
    # (one pair is 0.005). SimPO optimises a length-normalised likelihood margin, not this reference-relative reward:
    # on the bf16-trained default (SFT likelihood ranking already 1.0) its seeds 0 / 1 / 2 gave 0.67 / 0.76 / 0.695,
    # so its floor sits below the lowest seed, as the others do (the untouched adapter scores 0: all ties).
    "variant_implicit_reward_accuracy": 0.70,
    "simpo_implicit_reward_accuracy": 0.64,
    "variant_logprob_accuracy_loss": 0.03,
    # GRPO at lr 2e-4 on the four arithmetic families, ~170 fresh held-out prompts each (CPU): on the even-mix default
    # (2026-12-03) 200 steps raised their mean exact match +1.9 / +1.05 / +0.6 points over seeds 0-2, the largest
    # single-family drop −2.4 points. On the arithmetic-weighted default (2026-12-04; those families 86-97 % before RL)
    # 200 steps gained only +0.14 to +0.74 (a coin flip against this floor), 400 steps +0.6 to +1.5 on five DPO models
    # (worst family −3.25): RL_STEPS is 400. So: a gain, however small, and no family down by 4 points.
    "rl_weak_family_gain": 0.001,
    "rl_family_loss": 0.04,
}
RL_STEPS, RL_LR = 400, 2e-4
# Exact-match figures are sums of per-family fractions in floating point: a figure equal to its floor (e.g. DPO
# 0.905 against SFT 0.93 − 0.025, the 4000-step default's run of 2026-12-04 20:50) must pass, not hinge on rounding.
ULP = 1e-9


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    cfg = load_config("tiny", {"runs_dir": str(tmp_path_factory.mktemp("quality")), "serve.enabled": False})
    out = {}
    for stage in ("data", "tokenizer", "pretrain", "sft", "dpo"):
        out[stage] = run_one_stage(stage, cfg).manifest()["metrics"]
    return cfg, out


@pytest.fixture(scope="module")
def metrics(default_run):
    return default_run[1]


def test_pretraining_cuts_held_out_perplexity(metrics):
    e = metrics["pretrain"]["eval"]
    assert e["init_perplexity"] / e["perplexity"] >= FLOORS["pretrain_perplexity_drop"], e


def test_sft_validation_loss_falls_and_the_best_weights_are_kept(metrics):
    m = metrics["sft"]
    first = m["val_losses"][0][1]
    assert first - m["best_val_loss"] >= FLOORS["sft_val_loss_drop"], m["val_losses"]
    assert m["best_val_loss"] == min(v for _, v in m["val_losses"])


def test_sft_answers_held_out_prompts(metrics):
    e = metrics["sft"]["eval"]
    assert e["exact_match"] >= FLOORS["sft_exact_match"] - ULP, e["per_family"]
    assert min(e["per_family"].values()) >= FLOORS["sft_lowest_family"] - ULP, e["per_family"]
    strings = {f: v for f, v in e["per_family"].items() if f.startswith(("copy", "reverse"))}
    assert len(strings) == 4 and min(strings.values()) >= FLOORS["sft_string_families"] - ULP, strings


def test_dpo_prefers_chosen_answers_on_held_out_pairs(default_run, tmp_path):
    """On the 200 held-out pairs DPO's implicit reward prefers the chosen answer; and DPO costs at most
    dpo_exact_match_loss of the SFT model's exact match, measured on ~1,600 fresh held-out prompts: on the stage's own
    200 (20 a family) the difference of the two models moved ±2 points with bf16 rounding alone (seed 0 of the default:
    −1.5 points at one thread, −2.5 at two; fresh: −1.3 and −1.5), so that figure reached the floor by noise."""
    cfg, metrics = default_run
    e = metrics["dpo"]["eval"]
    assert e["implicit_reward_accuracy"] >= FLOORS["dpo_implicit_reward_accuracy"], e
    assert e["mean_margin"] > 0, e
    fresh = fresh_eval(cfg.run_dir, tmp_path)
    assert fresh["rows"] >= 1500, fresh["rows"]
    assert fresh["dpo"]["exact_match"] >= fresh["sft"]["exact_match"] - FLOORS["dpo_exact_match_loss"] - ULP, fresh


@pytest.mark.parametrize("loss, settings", [("ipo", {}), ("simpo", {"dpo.beta": 2.0, "dpo.nll_weight": 0.0}),
                                           ("kto", {})])
def test_each_preference_loss_raises_held_out_preference_accuracy(default_run, tmp_path, loss, settings):
    """dpo.loss on the default's SFT model (the DPO stage's own input), 100 steps each (KTO: the training pairs
    unpaired, each answer with its label and a mismatched twin for the KL estimate; dpo itself is checked above at
    its full 300 steps; ORPO in tests/test_dag.py): on the 200 held-out pairs the implicit reward
    β·(log π − log π_sft) ranks chosen above rejected for most pairs (it is 0 at the start, where the adapter is the
    identity), and the likelihood ranking gets no worse beyond noise. On the short CI DAG's weak SFT model (180 steps
    in all) this check was noise-bound (0.53–0.65 from machine to machine), so it runs here, on the model users get."""
    from glm_lora.engine import dpo
    from glm_lora.evaluation.metrics import preference_metrics
    from glm_lora.data import formats
    from glm_lora.data.prepare import split_path
    from glm_lora.data.tokenizer import load_tokenizer
    from glm_lora.model.adapters import load_policy

    base_cfg, _ = default_run
    run_dir = base_cfg.run_dir
    cfg = load_config("tiny", {"runs_dir": str(tmp_path / "runs"), "serve.enabled": False, "dpo.loss": loss,
                               "dpo.max_steps": 100, "dpo.eval_every": 0, "eval.enabled": False, **settings})
    base, sft = run_dir / "pretrain", run_dir / "sft"
    dpo.run(cfg, {"base": base, "sft": sft, "tokenizer": run_dir / "tokenizer", "data": run_dir / "data"}, tmp_path)
    tok, pairs = load_tokenizer(run_dir / "tokenizer"), list(formats.read_dpo(split_path(run_dir / "data", "dpo_eval")))
    assert len(pairs) == 200
    sft_model = load_policy(base, sft).eval()
    before = preference_metrics(sft_model, tok, pairs, seq_len=cfg.dpo.seq_len, beta=cfg.dpo.beta)
    after = preference_metrics(load_policy(base, sft, tmp_path).eval(), tok, pairs, seq_len=cfg.dpo.seq_len,
                               beta=cfg.dpo.beta, ref_model=sft_model)
    floor = FLOORS["simpo_implicit_reward_accuracy" if loss == "simpo" else "variant_implicit_reward_accuracy"]
    assert after["implicit_reward_accuracy"] >= floor, after
    assert after["logprob_accuracy"] >= before["logprob_accuracy"] - FLOORS["variant_logprob_accuracy_loss"], (after, before)


def test_grpo_raises_exact_match_on_the_weakest_families(default_run, tmp_path):
    """The RL stage (GRPO, exact-match reward, sampled answers) on the default's DPO model, RL_STEPS steps on the four
    arithmetic families: held-out exact match on fresh prompts of those families rises (mean over the four), and
    none falls beyond noise."""
    base_cfg, _ = default_run
    b, a = grpo_gain(base_cfg.run_dir, tmp_path, steps=RL_STEPS, lr=RL_LR)
    assert sum(a.values()) / 4 - sum(b.values()) / 4 >= FLOORS["rl_weak_family_gain"], (b, a)
    assert all(a[f] >= b[f] - FLOORS["rl_family_loss"] for f in WEAK_FAMILIES), (b, a)


def test_gguf_files_answer_in_llama_cpp_as_our_decoder_does(default_run):
    """The default's final model as GGUF (the gguf stage after export), run by llama.cpp's runtime the way a user's
    chat client does (its chat template from the file, its own tokenizer): f16 answers every fixed prompt as our
    decoder does greedily; q8_0 and q4_k_m (llama.cpp's own quantizer) most of them."""
    from pathlib import Path
    from tests.llama_runtime import llama_cpp
    from glm_lora.data.tokenizer import load_tokenizer, prompt_ids
    from glm_lora.evaluation.decode import greedy_answers
    from glm_lora.model.adapters import load_policy

    base_cfg, _ = default_run
    cfg = load_config("tiny", {"runs_dir": str(base_cfg.runs_dir), "serve.enabled": False,
                               "export.gguf": ["f16", "q8_0", "q4_k_m"]})
    run_dir = cfg.run_dir
    export_dir = Path(run_one_stage("export", cfg).path)
    gguf_dir = Path(run_one_stage("gguf", cfg).path)
    tok = load_tokenizer(run_dir / "tokenizer")
    chats = [[{"role": "user", "content": p}] for p in cfg.eval.compare_prompts]
    ours = greedy_answers(load_policy(run_dir / "pretrain", run_dir / "sft", run_dir / "dpo").eval(), tok, chats,
                          max_new_tokens=cfg.eval.max_new_tokens)
    Llama = llama_cpp().Llama
    got = {}
    for t in ("f16", "q8_0", "q4_k_m"):
        llm = Llama(str(gguf_dir / f"tiny-{t}.gguf"), n_ctx=512, n_threads=1, verbose=False)
        try:
            if t == "f16":       # llama.cpp tokenises the rendered chat as we do
                for chat in chats:
                    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                    assert llm.tokenize(text.encode(), add_bos=False, special=True) == prompt_ids(tok, chat), text
            got[t] = [llm.create_chat_completion(messages=c, temperature=0.0, max_tokens=cfg.eval.max_new_tokens)
                      ["choices"][0]["message"]["content"] for c in chats]
        finally:
            llm.close()
    agree = {t: sum(a == b for a, b in zip(v, ours)) for t, v in got.items()}
    print("gguf answers equal to ours:", agree, "of", len(ours))
    # f16: our greedy answers exactly; the quantised types: their agreement rate, measured 10/10 each on the
    # default (2026-12-03), floors below it for a weaker run's closer margins
    assert got["f16"] == ours, (ours, got["f16"])
    assert agree["q8_0"] >= 8 and agree["q4_k_m"] >= 6, (ours, got)
    assert (export_dir / "merged").is_dir() and (gguf_dir / "Modelfile").is_file()
