"""A measurement hook for the quality sweeps: a stage's held-out metrics plus its model's greedy answers to the
fixed prompts (`eval.compare_prompts`) and how many are right (against data.synthetic.solve)."""
from glm_lora.data.synthetic import solve
from glm_lora.evaluation.decode import greedy_answers


def with_fixed(metric_fn):
    def wrapped(cfg, model, tok, data_dir):
        m = metric_fn(cfg, model, tok, data_dir)
        prompts = cfg.eval.compare_prompts
        got = greedy_answers(model, tok, [[{"role": "user", "content": p}] for p in prompts],
                                      max_new_tokens=cfg.eval.max_new_tokens)
        m["fixed"] = dict(zip(prompts, got))
        m["fixed_right"] = sum(g.strip() == solve(p) for p, g in zip(prompts, got))
        return m
    return wrapped
