"""What a stage shows in the Prefect UI, made from its published manifest: tables people read (one row
per metric with its unit, the held-out metrics per family and where their rows came from, sample
answers, the data-cleaning counts by reason, lm-evaluation-harness scores) and, for training stages,
the loss curves drawn with matplotlib (saved with the run in runs/<run>/reports/ and embedded in a
markdown artifact).
Keyed artifacts, so the UI keeps their history across runs.
"""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path

from prefect.artifacts import create_markdown_artifact, create_table_artifact

METRICS_FILE = "metrics.jsonl"     # engine/fit.py: one JSON line per logging window
UNITS = (("acceptance", "fraction"), ("tokens_per_s", "tokens/s"), ("_s", "s"), ("loss", "nats/token"), ("perplexity", ""),
         ("bits_per_byte", "bits/byte"), ("accuracy", "fraction"), ("exact_match", "fraction"), ("chrf", "0–1"),
         ("rate", "fraction"), ("efficiency", "fraction"), ("positions", "tokens"),
         ("params", "parameters"), ("tokens", "tokens"),
         ("lr", ""), ("step", "steps"))


def artifact_key(run_name: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]", "-", f"{run_name}-{what}".lower())


def unit(name: str) -> str:
    return next((u for suffix, u in UNITS if name.endswith(suffix) or suffix in name), "")


def _scalar(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def metric_rows(metrics: dict) -> list[dict]:
    return [{"metric": k, "value": _fmt(v), "unit": unit(k)} for k, v in metrics.items() if _scalar(v)]


def eval_rows(ev: dict) -> list[dict]:
    sources = "; ".join(f"{s}: {d['source']} ({d['rows']} rows)" for s, d in ev.get("data", {}).items())
    return [{"metric": k, "value": _fmt(v), "unit": unit(k), "held-out data": sources}
            for k, v in ev.items() if _scalar(v)]


def family_rows(ev: dict) -> list[dict]:
    chrf, n = ev.get("chrf_per_family", {}), ev.get("n_per_family", {})
    return [{"family": f, "exact_match": _fmt(v), "chrf": _fmt(chrf.get(f, "")), "rows": n.get(f, "")}
            for f, v in ev.get("per_family", {}).items()]


MTP_BEFORE = {"mtp_acceptance_base": "before SFT (the pretrained or imported model)",
              "mtp_acceptance_sft": "before DPO (the SFT model)", "mtp_acceptance_dpo": "before RL (the DPO model)"}


def mtp_rows(stage: str, ev: dict) -> list[dict]:
    """The MTP layer's draft acceptance before and after the stage (evaluation/mtp.py), a row each; none without."""
    if "mtp_acceptance" not in ev:
        return []
    rows = [{"model": what, "mtp_acceptance": _fmt(ev[k])} for k, what in MTP_BEFORE.items() if k in ev]
    return [{**r, "held-out positions": ev.get("mtp_positions", "")}
            for r in rows + [{"model": f"after {stage}", "mtp_acceptance": _fmt(ev["mtp_acceptance"])}]]


def harness_rows(metrics: dict) -> list[dict]:
    """The harness stage's scores: one row per lm-evaluation-harness task (evaluation/harness.py), the base's beside."""
    base = metrics.get("base") or {}
    return [{"task": task, "metric": s["metric"], "score": _fmt(s["score"]),
             "stderr": _fmt(s.get("stderr") or ""), "base": _fmt(base.get(task, {}).get("score", "")),
             "samples": s["n"]} for task, s in metrics["harness"].items()]


def cleaning_rows(clean: dict) -> list[dict]:
    rows = [{"reason": r, "rows": c, "example": (clean.get("examples", {}).get(r) or [""])[0]}
            for r, c in clean.get("dropped", {}).items()]
    return rows + [{"reason": k, "rows": clean[k], "example": ""} for k in ("truncated", "prompt_truncated", "kept")
                   if clean.get(k)]


def windows(stage_dir: Path) -> list[dict]:
    """The stage's logging windows: a dict per line of its metrics.jsonl (none without one)."""
    log = Path(stage_dir) / METRICS_FILE
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []


def _logged(stage_dir: Path, key: str) -> list[dict]:
    """The stage's logging windows that carry `key` and a step."""
    return [p for p in windows(stage_dir) if key in p and "step" in p]


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def loss_curve(stage: str, stage_dir: Path, metrics: dict, out_png: Path) -> Path | None:
    """Training and validation loss by step, the best step marked; None if the stage logged no steps."""
    points = _logged(stage_dir, "loss")
    if not points:
        return None
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=100)
    ax.plot([p["step"] for p in points], [p["loss"] for p in points], label="training (per logging window)")
    val = metrics.get("val_losses") or []
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", label="validation (held-out split)")
        if metrics.get("best_step") is not None:
            ax.axvline(metrics["best_step"], color="gray", linestyle="--",
                       label=f"best step {metrics['best_step']} (kept)")
    ax.set(xlabel="optimizer step", ylabel="loss (nats/token)", title=f"{stage}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def reward_curves(stage: str, stage_dir: Path, out_png: Path) -> Path | None:
    """The RL stage's rollouts by step: reward mean ± std, KL to the reference and answer length; None if the stage
    logged no rewards."""
    points = _logged(stage_dir, "reward_mean")
    if not points:
        return None
    plt = _pyplot()

    steps = [p["step"] for p in points]
    mean, std = [p["reward_mean"] for p in points], [p.get("reward_std", 0.0) for p in points]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100)
    ax.plot(steps, mean, label="reward mean")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2,
                    label="± std over sampled answers")
    ax.set(xlabel="optimizer step", ylabel="reward", title=f"{stage}: reward per step")
    ax.legend()
    ax2.plot(steps, [p.get("completion_length", 0.0) for p in points], label="answer length (tokens)")
    twin = ax2.twinx()
    twin.plot(steps, [p.get("kl", 0.0) for p in points], color="tab:red", label="KL to the reference")
    ax2.set(xlabel="optimizer step", ylabel="tokens", title=f"{stage}: answer length and KL")
    twin.set_ylabel("KL (k3 estimate, per token)")
    fig.legend(loc="lower right")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def router_rows(router: dict) -> list[dict]:
    """One row per MoE layer: its experts' token shares over the stage (1/E each when balanced)."""
    return [{"layer": layer, "max_share": _fmt(max(share)), "min_share": _fmt(min(share)),
             "idle_experts": sum(v == 0 for v in share), "balanced_share": _fmt(1 / len(share)),
             "shares": " ".join(f"{v:.3f}" for v in share)}
            for layer, share in zip(router["layers"], router["token_share"])]


def router_heatmap(stage: str, router: dict, out_png: Path) -> Path:
    """Each MoE layer's token share per expert over the stage, as a heat map (1/E is balanced)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = router["token_share"]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.35 * len(shares)), dpi=100)
    image = ax.imshow(shares, aspect="auto", cmap="viridis", vmin=0)
    ax.set(xlabel="routed expert", ylabel="MoE layer", title=f"{stage}: share of routed tokens per expert "
           f"(balanced: {1 / max(len(shares[0]), 1):.3g})")
    ax.set_yticks(range(len(shares)), [layer.rsplit(".", 1)[-1] for layer in router["layers"]])
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def plots(stage: str, stage_dir: Path, metrics: dict, out_dir: Path) -> dict[str, Path]:
    """A stage's figures, drawn from its published files as out_dir/<stage>-<what>.png: {what: png} for those its
    logs hold — loss (training stages), rewards (RL), experts (a MoE model's router). The UI and MLflow show these."""
    drawn = {"loss": loss_curve(stage, stage_dir, metrics, out_dir / f"{stage}-loss.png"),
             "rewards": reward_curves(stage, stage_dir, out_dir / f"{stage}-rewards.png")}
    if metrics.get("router", {}).get("layers"):
        drawn["experts"] = router_heatmap(stage, metrics["router"], out_dir / f"{stage}-experts.png")
    return {what: png for what, png in drawn.items() if png is not None}


def _image_artifact(png: Path, title: str, key: str, description: str) -> None:
    data = base64.b64encode(png.read_bytes()).decode()
    create_markdown_artifact(f"### {title}\n\n![{title}](data:image/png;base64,{data})\n\n`{png}`\n", key=key,
                             description=description)


def publish(run_name: str, run_dir: Path, stage: str, stage_dir: Path, metrics: dict) -> None:
    """Every artifact of one built stage."""
    key = lambda what: artifact_key(run_name, f"{stage}-{what}")   # noqa: E731
    create_table_artifact(metric_rows(metrics), key=key("metrics"), description=f"{stage}: metrics of {stage_dir}")
    ev = metrics.get("eval") or {}
    if ev:
        create_table_artifact(eval_rows(ev), key=key("eval"), description=f"{stage}: held-out metrics")
        if ev.get("per_family"):
            create_table_artifact(family_rows(ev), key=key("families"), description=f"{stage}: per task family")
        if ev.get("mtp_acceptance") is not None:
            create_table_artifact(mtp_rows(stage, ev), key=key("mtp"), description=f"{stage}: MTP draft acceptance "
                                  "(share of held-out drafts equal to the model's greedy token), before and after")
        if ev.get("samples"):
            create_table_artifact([{k: s.get(k, "") for k in ("task", "prompt", "reference", "answer", "correct")}
                                   for s in ev["samples"]], key=key("samples"), description=f"{stage}: sample answers")
    if metrics.get("harness"):
        create_table_artifact(harness_rows(metrics), key=key("benchmarks"),
                              description=f"{stage}: lm-evaluation-harness scores of the export (and its base)")
    if metrics.get("clean"):
        create_table_artifact(cleaning_rows(metrics["clean"]), key=key("cleaning"),
                              description=f"{stage}: rows dropped or cut, by reason")
    pngs = plots(stage, stage_dir, metrics, Path(run_dir) / "reports")
    if "loss" in pngs:
        _image_artifact(pngs["loss"], f"{stage}: loss", key("loss-curve"), f"{stage}: training and validation loss")
    if metrics.get("samples"):          # the RL stage's sampled answers with their rewards
        create_table_artifact(metrics["samples"], key=key("rollouts"),
                              description=f"{stage}: sampled answers of the last steps and their rewards")
    if "rewards" in pngs:
        _image_artifact(pngs["rewards"], f"{stage}: rewards", key("rewards"),
                        f"{stage}: reward, KL and answer length by step")
    if "experts" in pngs:
        create_table_artifact(router_rows(metrics["router"]), key=key("router"),
                              description=f"{stage}: routed tokens per expert, per MoE layer")
        _image_artifact(pngs["experts"], f"{stage}: router", key("experts"),
                        f"{stage}: share of routed tokens per expert")
