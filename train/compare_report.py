"""The comparison's summaries over seeds, its table and its plots (``train.compare`` runs them).

``summarize_variant`` turns one variant's runs into its entry of
``results["variants"]``; ``format_table``, ``plot_recall_vs_state`` and
``plot_curves`` draw from those entries; ``write_results`` writes them all.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from train.variants import (
    MILESTONES,
    VARIANTS,
    CompareConfig,
    cache_sizes,
    metric,
    param_count,
    run_config,
    softmax_layers,
    state_bytes,
)

__all__ = [
    "aggregate",
    "first_reached",
    "format_table",
    "plot_curves",
    "plot_recall_vs_state",
    "summarize_variant",
    "write_results",
]


def first_reached(steps, values, threshold: float) -> int | None:
    """The first step whose value is ``>= threshold``, or None if none is."""
    return next((int(s) for s, v in zip(steps, values, strict=True) if v >= threshold), None)


def aggregate(values) -> dict[str, Any]:
    """One quantity over seeds: ``dict(mean, min, max, seeds, count)``.

    ``seeds`` keeps every seed's value in seed order, None where a seed has
    none (a milestone not reached, a diverged run); ``mean``, ``min`` and
    ``max`` are over the others (None when no seed has a value) and ``count``
    says how many that is.
    """
    seeds = [None if v is None else float(v) for v in values]
    present = [v for v in seeds if v is not None]
    if not present:
        return {"mean": None, "min": None, "max": None, "seeds": seeds, "count": 0}
    return {
        "mean": float(np.mean(present)),
        "min": min(present),
        "max": max(present),
        "seeds": seeds,
        "count": len(present),
    }


def _run_numbers(run: dict[str, Any]) -> dict[str, Any]:
    """One run's final metrics, milestones and length (a diverged run: accuracy 0)."""
    s, c = run["summary"], run["curves"]
    loss = s.get("test_loss")
    diverged = run["diverged_at"] is not None
    return {
        "accuracy": 0.0 if diverged else (s["test_accuracy"] or 0.0),
        "test_loss": None if diverged else loss,
        "bits_per_byte": None if diverged or loss is None else loss / math.log(2),
        "steps_run": run["diverged_at"] if diverged else s["step"],
        "target_reached": bool(s.get("target_reached")),
        **{
            f"step_to_{m:g}": first_reached(c["eval_step"], c["test_accuracy"], m)
            for m in MILESTONES
        },
    }


def summarize_variant(config: CompareConfig, variant: str, per_lr: dict[float, list]) -> dict:
    """The variant's entry of ``results["variants"]``: its best learning rate's runs over seeds.

    Keys: ``description``, ``layers`` (preset names joined by ``+``),
    ``softmax_layers`` (1-based), ``lr`` (the best), ``params``,
    ``state_bytes`` (decode state of one test-length sequence),
    ``cache_bytes_per_token`` and ``cache_bytes_fixed``; over the seeds of the
    best learning rate, ``aggregate`` dicts ``accuracy`` (final test accuracy:
    ``accuracy["mean"]`` is the headline), ``test_loss``, ``bits_per_byte``,
    ``steps_run``, ``step_to_0.5`` and ``step_to_0.9``; ``target_reached`` and
    ``diverged`` (seeds counted), ``metric_per_lr`` (the sweep's means),
    ``tokens_per_s`` and ``wall_s`` (means).
    """
    headline = metric(config.train.task)
    numbers = {lr: [_run_numbers(r) for r in runs] for lr, runs in per_lr.items()}

    def score(lr):  # higher is better
        if headline == "bits_per_byte":
            return (-np.mean([n["bits_per_byte"] or math.inf for n in numbers[lr]]),)
        # Ties (every seed at the target) go to the learning rate that got there first.
        accs = np.mean([n["accuracy"] for n in numbers[lr]])
        return (round(float(accs), 3), -np.mean([n["steps_run"] for n in numbers[lr]]))

    lr = max(per_lr, key=score)
    runs, nums = per_lr[lr], numbers[lr]
    model_config = run_config(config, variant, lr, config.seeds[0]).model
    model_config = dataclasses.replace(model_config, vocab_size=config.train.task.vocab)
    per_token, fixed = cache_sizes(model_config)
    fine = [r["summary"] for r in runs if r["diverged_at"] is None]
    mean = lambda key: float(np.mean([s[key] for s in fine])) if fine else None  # noqa: E731
    keys = ("accuracy", "test_loss", "bits_per_byte", "steps_run")
    keys += tuple(f"step_to_{m:g}" for m in MILESTONES)
    return {
        "description": VARIANTS[variant][0],
        "layers": "+".join(VARIANTS[variant][1](config.num_layers)),
        "softmax_layers": softmax_layers(config, variant),
        "lr": lr,
        "params": param_count(model_config),
        "state_bytes": state_bytes(model_config, config.train.task.seq_len),
        "cache_bytes_per_token": per_token,
        "cache_bytes_fixed": fixed,
        **{k: aggregate([n[k] for n in nums]) for k in keys},
        "target_reached": sum(n["target_reached"] for n in nums),
        "diverged": sum(r["diverged_at"] is not None for r in runs),
        "metric_per_lr": {
            f"{k:g}": aggregate([n[headline] for n in numbers[k]])["mean"] for k in per_lr
        },
        "tokens_per_s": mean("tokens_per_s"),
        "wall_s": mean("wall_s"),
    }


# ----------------------------------------------------------------------------
# The table


def _bytes(n: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _cell(agg: dict[str, Any], fmt: str, missing: str = "not reached") -> str:
    """``mean (min-max)`` over the seeds; with seeds lacking a value, how many have one."""
    n = len(agg["seeds"])
    if agg["count"] == 0:
        return missing
    text = format(agg["mean"], fmt)
    if agg["count"] > 1 and agg["min"] != agg["max"]:
        text += f" ({format(agg['min'], fmt)}-{format(agg['max'], fmt)})"
    if agg["count"] < n:
        text += f" ({agg['count']} of {n} seeds)"
    return text


def _task_line(config: CompareConfig) -> str:
    t, tr = config.train.task, config.train
    what = {
        "mqar": f"MQAR, {t.num_pairs} key-value pairs, T={t.seq_len}, V={t.vocab_size}"
        + (f" (training examples: {t.min_pairs} to {t.num_pairs} pairs)" if t.min_pairs else ""),
        "induction": f"induction, T={t.seq_len}, V={t.vocab_size}",
        "selective_copy": f"selective copying, {t.num_copy} tokens, T={t.seq_len}",
        "bytes": f"bytes, T={t.seq_len}",
    }[t.name]
    stop = (
        f" (stopping at test accuracy >= {tr.target_accuracy:g}, checked every "
        f"{tr.eval_every} steps)"
        if tr.target_accuracy is not None
        else ""
    )
    return (
        f"{what}; width {tr.model.width}, {config.num_layers} layers, {config.num_heads} heads; "
        f"at most {tr.steps} steps of batch {tr.batch_size}{stop}; "
        f"lr sweep {', '.join(f'{x:g}' for x in config.lrs)}; "
        f"seeds {', '.join(map(str, config.seeds))}"
    )


def format_table(results: dict[str, Any], config: CompareConfig) -> str:
    """The markdown table of ``results``: one row per variant, at its best learning rate."""
    bpb = results["metric"] == "bits_per_byte"
    later = ("final test accuracy",) if bpb else tuple(f"step to {m:g}" for m in MILESTONES)
    head = ("variant", "layers", "softmax layers", "params", "state bytes/seq")
    head += ("final bits/byte" if bpb else "final test accuracy", *later)
    head += ("steps run", "best lr")
    lines = [
        f"# {config.name}",
        "",
        _task_line(config),
        "",
        "| " + " | ".join(head) + " |",
        "|---|---|---|" + "---:|" * (len(head) - 3),
    ]
    for name, v in results["variants"].items():
        at = ", ".join(map(str, v["softmax_layers"])) or "none"
        row = [
            f"{name} ({v['description']})",
            v["layers"],
            f"{at} of {config.num_layers}",
            f"{v['params']:,}",
            _bytes(v["state_bytes"]),
        ]
        if bpb:
            row += [_cell(v["bits_per_byte"], ".3f", "diverged"), _cell(v["accuracy"], ".3f")]
        else:
            row += [_cell(v["accuracy"], ".3f")]
            row += [_cell(v[f"step_to_{m:g}"], ".0f") for m in MILESTONES]
        steps = _cell(v["steps_run"], ".0f")
        if v["diverged"]:
            steps += f", {v['diverged']} diverged"
        row += [steps, f"{v['lr']:g}"]
        lines.append("| " + " | ".join(row) + " |")
    n_seeds = len(config.seeds)
    over = f"the mean over {n_seeds} seeds (range in brackets)" if n_seeds > 1 else "one seed's"
    notes = [
        f"Each cell is {over} at the variant's best learning rate of the sweep. "
        + (
            "Bits per byte: the test loss / ln 2 on "
            if bpb
            else "Final test accuracy: the fraction of labelled positions predicted exactly on "
        )
        + f"{config.train.eval_batches} fixed test batches at the run's last evaluation"
        + ("" if bpb else "; step to x: the first evaluation at or above x")
        + ". State bytes/seq: the decode state of one test-length sequence in float32 (full "
        "caches hold every token; windows, recurrent states and short-convolution states are "
        "fixed)."
    ]
    chance = results.get("chance_accuracy")
    if chance is not None:
        notes.append(
            f"Chance is {chance:.3f}: a random one of the {config.train.task.num_pairs} values "
            "in the sequence (the format learned, no association recalled)."
        )
    walls = [r["summary"].get("wall_s", 0.0) for r in results["runs"]]
    jobs = f", {config.jobs} at once, one core each" if config.jobs > 1 else ""
    notes.append(
        f"Total wall time of the comparison: {results['wall_s']:.0f} s for "
        f"{len(results['runs'])} runs{jobs} (one run: {min(walls):.0f} to {max(walls):.0f} s, "
        "compilation included)."
    )
    return "\n".join([*lines, "", " ".join(notes), ""])


# ----------------------------------------------------------------------------
# The plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _best_runs(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    lr = results["variants"][name]["lr"]
    return [r for r in results["runs"] if r["variant"] == name and r["lr"] == lr]


def plot_recall_vs_state(results: dict[str, Any], path: Path) -> Path:
    """Final test metric against decode-state bytes per sequence (log x), every seed shown.

    One marker per variant at its seeds' mean and a small dot per seed, as in
    Zoology's and Based's recall-against-state plots.
    """
    plt = _pyplot()
    bpb = results["metric"] == "bits_per_byte"
    key = "bits_per_byte" if bpb else "accuracy"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab10")
    for i, (name, v) in enumerate(results["variants"].items()):
        color = colors(i % 10)
        x = max(v["state_bytes"], 1)
        seeds = [y for y in v[key]["seeds"] if y is not None]
        ax.scatter([x] * len(seeds), seeds, color=color, s=12, alpha=0.6, zorder=3)
        if v[key]["mean"] is not None:
            ax.scatter([x], [v[key]["mean"]], color=color, s=60, marker="D", label=name, zorder=4)
            ax.annotate(name, (x, v[key]["mean"]), textcoords="offset points", xytext=(5, 4))
    chance = results.get("chance_accuracy")
    if chance is not None:
        ax.axhline(chance, color="gray", ls="--", lw=1, label=f"chance ({chance:.2f})")
    ax.scatter([], [], color="black", s=12, alpha=0.6, label="each seed")
    ax.set_xscale("log")
    ax.set_xlabel("decode-state bytes per sequence (log scale)")
    ax.set_ylabel("final test bits per byte" if bpb else "final test accuracy")
    if not bpb:
        ax.set_ylim(0, 1.05)
    ax.set_title(f"{results['config']['name']}: {key.replace('_', ' ')} against state size")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_curves(results: dict[str, Any], path: Path) -> Path:
    """Train loss and the test metric against step: every seed of each best learning rate."""
    plt = _pyplot()
    bpb = results["metric"] == "bits_per_byte"
    fig, (ax_loss, ax_test) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("tab10")
    for i, name in enumerate(results["variants"]):
        for j, run in enumerate(_best_runs(results, name)):
            c, style = run["curves"], dict(color=colors(i % 10), ls="-" if j == 0 else "--")
            label = name if j == 0 else None
            ax_loss.plot(c["train_step"], c["train_loss"], label=label, lw=1, **style)
            test = [x / math.log(2) for x in c["test_loss"]] if bpb else c["test_accuracy"]
            ax_test.plot(c["eval_step"], test, marker=".", label=label, **style)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("train loss")
    ax_loss.set_yscale("log")
    ax_test.set_xlabel("step")
    ax_test.set_ylabel("test bits per byte" if bpb else "test accuracy")
    chance = results.get("chance_accuracy")
    if chance is not None:
        ax_test.axhline(chance, color="gray", ls="--", lw=1, label="chance")
    if not bpb:
        ax_test.set_ylim(0, 1.05)
    ax_test.legend(fontsize=7)
    fig.suptitle(
        f"{results['config']['name']}: best learning rate per variant; "
        "seed 0 solid, other seeds dashed"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _finite(tree):
    """``tree`` with NaN and infinities as None (strict JSON has neither)."""
    if isinstance(tree, dict):
        return {k: _finite(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_finite(v) for v in tree]
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    return tree


def write_results(results: dict[str, Any], config: CompareConfig) -> tuple[Path, list[Path]]:
    """Writes ``table.md``, ``results.json`` and the plots; returns the folder and the files."""
    out = Path(config.results_dir) / config.name
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "table.md", out / "results.json"]
    paths[0].write_text(format_table(results, config))
    paths[1].write_text(json.dumps(_finite(results), indent=1, allow_nan=False) + "\n")
    paths.append(plot_recall_vs_state(results, out / "recall_vs_state.png"))
    paths.append(plot_curves(results, out / "curves.png"))
    return out, paths
