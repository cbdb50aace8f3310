"""The comparison's summaries over seeds and its table (``train.compare`` runs them).

``summarize_variant`` turns one variant's runs into its entry of
``results["variants"]``; ``format_table`` and the plots of ``train.compare_plots``
draw from those entries; ``write_results`` writes them all.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from train.compare_plots import plot_curves, plot_lengths, plot_recall_vs_state, scatter_name
from train.config import to_json
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
    variant_pattern,
)
from train.workdir import check_writable, write_atomic

__all__ = [
    "aggregate",
    "best_lr",
    "first_reached",
    "format_table",
    "summarize_variant",
    "which_layers",
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


def _run_numbers(run: dict[str, Any], headline: str) -> dict[str, Any]:
    """One run's final metrics, milestones and length (a diverged run: accuracy 0).

    Bits per byte only where the task is a byte corpus (``headline``), where
    it means something.
    """
    s, c = run["summary"], run["curves"]
    loss = s.get("test_loss")
    diverged = run["diverged_at"] is not None
    bpb = {}
    if headline == "bits_per_byte":
        se = s.get("test_loss_se")
        bpb["bits_per_byte"] = None if diverged or loss is None else loss / math.log(2)
        bpb["bits_per_byte_se"] = None if diverged or se is None else se / math.log(2)
    return {
        "accuracy": 0.0 if diverged else (s["test_accuracy"] or 0.0),
        "test_loss": None if diverged else loss,
        **bpb,
        "steps_run": run["diverged_at"] if diverged else s["step"],
        "target_reached": bool(s.get("target_reached")),
        **{
            f"step_to_{m:g}": first_reached(c["eval_step"], c["test_accuracy"], m)
            for m in MILESTONES
        },
    }


def best_lr(config: CompareConfig, per_lr: dict[float, list[dict]]) -> float:
    """The learning rate whose runs on the sweep's seeds (``config.seeds``) score best: the
    lowest mean bits per byte (a diverged run counts as infinite), or the highest mean
    accuracy to 3 digits, ties going to the rate that got there first.

    Args:
      per_lr: each rate's run records (``train.compare``'s), any seeds.
    """
    headline = metric(config.train.task)
    numbers = {
        lr: [_run_numbers(r, headline) for r in runs if r["seed"] in config.seeds]
        for lr, runs in per_lr.items()
    }

    def score(lr):  # higher is better
        if headline == "bits_per_byte":
            return (-np.mean([n["bits_per_byte"] or math.inf for n in numbers[lr]]),)
        accs = np.mean([n["accuracy"] for n in numbers[lr]])
        return (round(float(accs), 3), -np.mean([n["steps_run"] for n in numbers[lr]]))

    return max(numbers, key=score)


def summarize_variant(config: CompareConfig, variant: str, per_lr: dict[float, list]) -> dict:
    """The variant's entry of ``results["variants"]``: its best learning rate's runs over seeds.

    Keys: ``description``, ``layers`` (preset names joined by ``+``; the same
    names, joined by commas, are a ``--model.pattern``), ``model`` (the
    ``ModelConfig`` the variant trained, every layer's fields as it ran),
    ``softmax_layers`` (1-based), ``lr`` (the best), ``params``,
    ``state_bytes`` (decode state of one test-length sequence),
    ``cache_bytes_per_token`` and ``cache_bytes_fixed``; over the seeds of the
    best learning rate, ``aggregate`` dicts ``accuracy`` (final test accuracy:
    ``accuracy["mean"]`` is the headline), ``test_loss``, ``bits_per_byte`` and
    ``bits_per_byte_se`` (its test-sample standard error; on the bytes task only),
    ``steps_run``, ``step_to_0.5`` and ``step_to_0.9``;
    ``target_reached`` and ``diverged`` (seeds counted), ``metric_per_lr``
    (the sweep's means, over ``config.seeds``), ``seeds`` (those of the best rate's
    runs, ``best_lr_seeds`` included), ``tokens_per_s`` and ``wall_s`` (means);
    with ``config.test_lengths``, ``at_length[str(k)]``: the headline metric at k x
    the training length, aggregated over the seeds.
    """
    headline = metric(config.train.task)
    numbers = {lr: [_run_numbers(r, headline) for r in runs] for lr, runs in per_lr.items()}
    swept = {  # the sweep's seeds: the rates are compared on these only
        lr: [n for n, r in zip(numbers[lr], runs, strict=True) if r["seed"] in config.seeds]
        for lr, runs in per_lr.items()
    }
    lr = best_lr(config, per_lr)
    runs, nums = per_lr[lr], numbers[lr]
    model_config = run_config(config, variant, lr, config.seeds[0]).model
    model_config = dataclasses.replace(model_config, vocab_size=config.train.task.vocab)
    per_token, fixed = cache_sizes(model_config)
    fine = [r["summary"] for r in runs if r["diverged_at"] is None]
    mean = lambda key: float(np.mean([s[key] for s in fine])) if fine else None  # noqa: E731
    bpb = ("bits_per_byte", "bits_per_byte_se") if headline == "bits_per_byte" else ()
    keys = ("accuracy", "test_loss", *bpb, "steps_run")
    keys += tuple(f"step_to_{m:g}" for m in MILESTONES)
    lengths = {}
    if config.test_lengths:
        lengths["at_length"] = {
            f"{k}": aggregate([_at_length(r, k, headline) for r in runs])
            for k in config.test_lengths
        }
    return {
        "description": VARIANTS[variant].description,
        "layers": "+".join(variant_pattern(config, variant)),
        "model": to_json(model_config),
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
            f"{k:g}": aggregate([n[headline] for n in swept[k]])["mean"] for k in per_lr
        },
        "seeds": [r["seed"] for r in runs],
        "tokens_per_s": mean("tokens_per_s"),
        "wall_s": mean("wall_s"),
        **lengths,
    }


def _at_length(run: dict[str, Any], multiple: int, headline: str) -> float | None:
    """A run's headline metric at ``multiple`` x its training length (None: diverged)."""
    at = run.get("lengths", {}).get(f"{multiple}")
    if at is None:
        return None
    return at["test_loss"] / math.log(2) if headline == "bits_per_byte" else at["test_accuracy"]


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
        f"lr sweep {', '.join(f'{x:g}' for x in config.lrs)}"
        + (f" (and up to {config.edge_lrs} beyond its edge)" if config.edge_lrs else "")
        + "; "
        f"seeds {', '.join(map(str, config.seeds))}"
        + (
            f" (the sweep), {', '.join(map(str, config.best_lr_seeds))} (at the best rate)"
            if config.best_lr_seeds
            else ""
        )
        + (
            f"; each variant's MLP width matched to {config.match_params}'s parameters"
            if config.match_params
            else ""
        )
    )


def which_layers(indices, num_layers: int) -> str:
    """``"layer 2 of 2"``, ``"layers 1, 2 of 2"`` or ``"none of 2"`` (1-based indices)."""
    if not indices:
        return f"none of {num_layers}"
    word = "layer" if len(indices) == 1 else "layers"
    return f"{word} {', '.join(map(str, indices))} of {num_layers}"


def format_table(results: dict[str, Any], config: CompareConfig) -> str:
    """The markdown table of ``results``: one row per variant, at its best learning rate."""
    bpb = results["metric"] == "bits_per_byte"
    later = ("final test accuracy",) if bpb else tuple(f"step to {m:g}" for m in MILESTONES)
    matched = config.match_params is not None
    head = ("variant", "layers", "softmax layers", "params", *("MLP width",) * matched)
    head += ("state bytes/seq",)
    head += ("final bits/byte", "test SE") if bpb else ("final test accuracy",)
    head += later
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
        row = [
            f"{name} ({v['description']})",
            v["layers"],
            which_layers(v["softmax_layers"], config.num_layers),
            f"{v['params']:,}",
            *(str(v["model"]["mlp_width"]),) * matched,
            _bytes(v["state_bytes"]),
        ]
        if bpb:
            se = v.get("bits_per_byte_se", {}).get("mean")
            row += [_cell(v["bits_per_byte"], ".3f", "diverged")]
            row += ["-" if se is None else f"{se:.4f}", _cell(v["accuracy"], ".3f")]
        else:
            row += [_cell(v["accuracy"], ".3f")]
            row += [_cell(v[f"step_to_{m:g}"], ".0f") for m in MILESTONES]
        steps = _cell(v["steps_run"], ".0f")
        if v["diverged"]:
            steps += f", {v['diverged']} diverged"
        row += [steps, f"{v['lr']:g}"]
        lines.append("| " + " | ".join(row) + " |")
    n_seeds = len(config.seeds) + len(config.best_lr_seeds)
    over = f"the mean over {n_seeds} seeds (range in brackets)" if n_seeds > 1 else "one seed's"
    picked = ""
    if config.best_lr_seeds and len(config.lrs) > 1:
        word = "seeds" if len(config.seeds) > 1 else "seed"
        picked = f" (picked on {word} {', '.join(map(str, config.seeds))})"
    notes = [
        f"Each cell is {over} at the variant's best learning rate of the sweep{picked}. "
        + (
            "Bits per byte: the test loss / ln 2 on "
            if bpb
            else "Final test accuracy: the fraction of labelled positions predicted exactly on "
        )
        + f"{config.train.final_eval_batches or config.train.eval_batches} fixed test "
        + "batches at the run's last evaluation"
        + (
            " (the same windows for every seed); test SE: the standard error of that "
            "estimate over its batches (the test sample's error; mean over seeds), beside "
            "the seeds' range in brackets"
            if bpb
            else ""
        )
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
    return "\n".join([*lines, "", " ".join(notes), "", *_lengths_table(results, config)])


def _lengths_table(results: dict[str, Any], config: CompareConfig) -> list[str]:
    """The train-short-test-long section: each variant's metric at each test length."""
    if not config.test_lengths:
        return []
    T, bpb = config.train.task.seq_len, results["metric"] == "bits_per_byte"
    head = ["variant", *(f"{k}x (T={k * T})" for k in config.test_lengths)]
    lines = [
        "## Train short, test long",
        "",
        f"{'Test bits per byte' if bpb else 'Test accuracy'} of each variant's final models "
        f"(best learning rate, every seed) on test windows of 1 to "
        f"{max(config.test_lengths)} times the training length T={T}, as many test "
        "tokens at every length (each length its own random windows, the same for every "
        "run); each layer runs as it decodes (RoPE past its trained positions, windows at "
        "their width, fixed states on).",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * len(config.test_lengths),
    ]
    for name, v in results["variants"].items():
        cells = [_cell(v["at_length"][f"{k}"], ".3f", "diverged") for k in config.test_lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _finite(tree):
    """``tree`` with NaN and infinities as None (strict JSON has neither)."""
    if isinstance(tree, dict):
        return {k: _finite(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_finite(v) for v in tree]
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    return tree


def _recorded(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` as ``results.json`` records it: the base config's placeholder layers
    (each variant replaces them) point to the layers each variant trained."""
    config = results["config"]
    model = {**config["train"]["model"], "layers": "per variant: variants.<name>.model.layers"}
    train = {**config["train"], "model": model}
    return {**results, "config": {**config, "train": train}}


def write_results(results: dict[str, Any], config: CompareConfig) -> tuple[Path, list[Path]]:
    """Writes ``table.md``, ``results.json`` and the plots; returns the folder and the files."""
    out = check_writable(Path(config.results_dir) / config.name, "results_dir")
    paths = [out / "table.md", out / "results.json"]
    write_atomic(paths[0], format_table(results, config))
    write_atomic(
        paths[1], json.dumps(_finite(_recorded(results)), indent=1, allow_nan=False) + "\n"
    )
    paths.append(plot_recall_vs_state(results, out / scatter_name(results)))
    paths.append(plot_curves(results, out / "curves.png"))
    if config.test_lengths:
        paths.append(plot_lengths(results, out / "lengths.png"))
    return out, paths
