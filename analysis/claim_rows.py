"""The rows of ``python -m analysis.claims``: one per claim, measured or read from a results file.

``CLAIMS`` (the claims, numbered), ``Row`` (one line of the table), and a row
per source: ``check_row`` (claims 1-9, the fast checks of
``analysis.claim_checks``), ``compare_row`` (claim 10, the main comparison's
results.json) and ``experiment_row`` (claims 11-19, the experiments'). Reading
a row trains nothing; ``analysis.claims`` runs what ``--run`` asks for and
makes the table.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis import claim_checks

__all__ = [
    "CLAIMS",
    "CLAIM_KEYS",
    "COMPARE",
    "COMPARE_QUICK",
    "DELTA_VARIANTS",
    "EXPERIMENTS",
    "EXPERIMENT_MODULES",
    "NOT_RUN",
    "RECALL_GAP",
    "REPO",
    "Row",
    "check_row",
    "compare_accuracies",
    "compare_row",
    "error_row",
    "experiment_row",
    "shown_path",
]

REPO = Path(__file__).resolve().parent.parent

CLAIMS: dict[int, str] = {
    1: "The 3-token worked example (d_k = 2) has weights [[.40,.20,.40],[.20,.40,.40],"
    "[.25,.25,.50]] and outputs [[.6,.4],[.4,.6],[.5,.5]]",
    2: "q.k of random unit-variance 64-dim vectors has std ~8, ~1 after dividing by sqrt(64)",
    3: "softmax([1,2,3]) = [.09,.24,.67], softmax([8,16,24]) ~ [0,.0003,.9997], and the "
    "gradient through the saturated softmax is near zero",
    4: "Attention without positions is permutation-equivariant",
    5: "With a causal mask one forward pass gives the per-position losses of T separate "
    "prefix passes",
    6: "With RoPE the score of q at m and k at n depends only on m - n",
    7: "Llama 3 8B's KV cache is 128 KiB/token, 1 GiB at 8K, 16 GiB for 16 requests, 4x with "
    "MHA; GQA/MQA shrink it by N/K; MLA caches a latent",
    8: "Blockwise (FlashAttention) attention is exact and its memory is linear in T",
    9: "Causal linear attention is an RNN with a fixed-size state (parallel = recurrent = "
    "chunkwise)",
    10: "Linear attention is weaker than softmax attention at exact recall (MQAR, equal width)",
    11: "Induction heads form with a jump in in-context learning",
    12: "Heads put mass on the first token; a window plus sinks keeps streaming perplexity "
    "stable past the training length, a plain window does not",
    13: "Many heads can be pruned with little loss",
    14: "Window layers interleaved with global layers keep long-range paths",
    15: "What a fixed state buys in recall: the delta rule reaches attention's MQAR accuracy "
    "at a state where linear attention stays near chance (Zoology's recall-memory frontier)",
    16: "State tracking needs negative eigenvalues: a linear RNN with transitions in (0, 1] "
    "does not learn parity at every length, one with transitions reaching -1 does "
    "(Grazzi et al. 2025)",
    17: "S5's word problem (not solvable) separates the families: products of Householders "
    "(DeltaProduct) can track it, fixed-depth attention and diagonal SSMs cannot "
    "(Merrill et al. 2024, Siems et al. 2025)",
    18: "Trainable sparse attention (MoBA, NSA, DSA) keeps exact long-range lookups where a "
    "window reading as many keys per query does not",
    19: "Gated attention (a sigmoid gate on each head's output) removes the attention sink "
    "(Qiu et al. 2025)",
}

# Claims 11-19: the experiment (config configs/<name>.py, results <name>/, module
# analysis.experiments.<name> unless EXPERIMENT_MODULES names another) whose
# results.json holds the row, in its entry "claim" unless CLAIM_KEYS names another
# (one experiment may hold two rows).
EXPERIMENTS: dict[int, str] = {
    11: "induction_heads",
    12: "sinks_streaming",
    13: "head_pruning",
    14: "windows_global",
    15: "recall_frontier",
    16: "state_tracking",
    17: "state_tracking_groups",
    18: "sparse",
    19: "sinks_gated",
}
# Experiments run by another's module with a config of their own.
EXPERIMENT_MODULES: dict[str, str] = {"state_tracking_groups": "state_tracking"}
CLAIM_KEYS: dict[int, str] = {17: "claim_s5"}
COMPARE = "compare_mqar"  # the main job's results folder (python -m train.compare)
COMPARE_QUICK = "compare_mqar_quick"  # what --run trains (python -m train.compare --quick)
# Claim 10's criterion, fixed before reading any result: softmax MHA recalls at
# least 10 accuracy points more than linear attention at the same width.
RECALL_GAP = 0.10
# The delta-rule variants claim 10's row places between softmax and linear attention.
DELTA_VARIANTS = ("deltanet", "gated_deltanet", "kda")

NOT_RUN = "not run (use --run)"


@dataclass(frozen=True)
class Row:
    """One claim's line of the table.

    Attributes:
      number: the claim's number, 1 to 19.
      claim: the claim in a short sentence.
      measured: what was measured (or why nothing was).
      criterion: what the measurement is judged by.
      holds: True, False, or None when not run or not measurable.
      status: ``"holds"``, ``"does not hold"``, ``"not run"`` or ``"error"``.
      source: where the value comes from (a fast check, or a results file).
      seconds: how long this row took here (a check's run, or reading a file);
        for a file, its own ``runtime_s`` is in ``runtime_s``.
      runtime_s: the experiment's or comparison's recorded runtime, if any.
      values: the numbers behind ``measured`` (a fast check's, or claim 10's accuracies).
    """

    number: int
    claim: str
    measured: str
    criterion: str
    holds: bool | None
    status: str
    source: str
    seconds: float = 0.0
    runtime_s: float | None = None
    values: dict[str, Any] = dataclasses.field(default_factory=dict)


def shown_path(path: Path) -> str:
    """``path`` relative to the repository when inside it (committed tables name no machine)."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _status(holds: bool | None) -> str:
    return {True: "holds", False: "does not hold", None: "not run"}[holds]


def _row(number, measured, criterion, holds, source, **kw) -> Row:
    return Row(number, CLAIMS[number], measured, criterion, holds, _status(holds), source, **kw)


def error_row(number: int, source: str, error: BaseException, criterion: str = "") -> Row:
    traceback.print_exception(error, file=sys.stderr)
    return Row(
        number,
        CLAIMS[number],
        f"error: {type(error).__name__}: {error}",
        criterion,
        None,
        "error",
        source,
    )


# ----------------------------------------------------------------------------
# Claims 1-9: the fast checks


def check_row(number: int) -> Row:
    """Runs fast check ``number`` (1-9) of ``analysis.claim_checks``."""
    fn = claim_checks.CHECKS[number]
    source = f"analysis.claim_checks.{fn.__name__}"
    t0 = time.perf_counter()
    try:
        check = fn()
    except Exception as e:
        return error_row(number, source, e)
    seconds = time.perf_counter() - t0
    return _row(
        number,
        check.measured,
        check.criterion,
        bool(check.holds),
        source,
        seconds=seconds,
        values=dict(check.values),
    )


# ----------------------------------------------------------------------------
# Claim 10: the main comparison


def compare_accuracies(results: dict[str, Any]) -> dict[str, float]:
    """``{variant: mean final test accuracy over seeds}`` from a ``train.compare`` results.json.

    The one place that knows the comparison's format:
    ``results["variants"][name]["accuracy"]["mean"]`` (``train.compare_report``).

    Raises:
      ValueError: another layout, or an accuracy that is not a number.
    """
    try:
        return {
            name: float(entry["accuracy"]["mean"]) for name, entry in results["variants"].items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(
            f"results.json: expected variants.<name>.accuracy.mean numbers, got {e!r}"
        ) from None


def _width(results: dict[str, Any]) -> int | None:
    try:
        return int(results["config"]["train"]["model"]["width"])
    except (KeyError, TypeError, ValueError):
        return None


def compare_row(path: Path) -> Row:
    """Claim 10 from a comparison's ``results.json``: MHA's recall against linear attention's."""
    criterion = f"mha - linear >= {RECALL_GAP:g} test accuracy (same task, width and budget)"
    source = shown_path(path)
    if not path.is_file():
        return _row(10, NOT_RUN, criterion, None, source)
    t0 = time.perf_counter()
    try:
        results = json.loads(path.read_text())
        acc = compare_accuracies(results)
        missing = [v for v in ("mha", "linear") if v not in acc]
        if missing:
            raise ValueError(f"{path}: expected variants mha and linear, missing {missing}")
    except Exception as e:
        return error_row(10, source, e, criterion)
    gap = acc["mha"] - acc["linear"]
    shown = [v for v in ("mha", "linear", "hybrid", *DELTA_VARIANTS) if v in acc]
    measured = ", ".join(f"{v} {acc[v]:.2f}" for v in shown) + f"; gap {gap:.2f}"
    delta = [v for v in DELTA_VARIANTS if v in acc]
    closed = {v: (acc[v] - acc["linear"]) / gap for v in delta} if gap > 0 else {}
    if closed:  # where the delta rule's fixed state sits between the two
        measured += "; the delta rule closes " + ", ".join(
            f"{share:.0%} of it ({v})" for v, share in closed.items()
        )
    width, chance = _width(results), results.get("chance_accuracy")
    extra = [s for s in (f"width {width}" if width else "", _chance(chance)) if s]
    if extra:
        measured += f" ({', '.join(extra)})"
    runtime = results.get("wall_s")
    return _row(
        10,
        measured,
        criterion,
        bool(gap >= RECALL_GAP),
        source,
        seconds=time.perf_counter() - t0,
        runtime_s=float(runtime) if isinstance(runtime, int | float) else None,
        values={"accuracy": acc, "gap": gap, "width": width, "delta_rule_closes": closed},
    )


def _chance(chance) -> str:
    return f"chance {chance:.2f}" if isinstance(chance, int | float) else ""


# ----------------------------------------------------------------------------
# Claims 11-19: the experiments


def experiment_row(number: int, path: Path) -> Row:
    """Claim ``number`` (11-19) from its experiment's ``results.json``.

    The file holds ``"claim": {"measured": str, "criterion": str, "holds":
    bool}`` (or the entry ``CLAIM_KEYS`` names) and ``"runtime_s"``; the row
    shows them as they are.
    """
    name = EXPERIMENTS[number]
    key = CLAIM_KEYS.get(number, "claim")
    source = shown_path(path)
    if not path.is_file():
        module = EXPERIMENT_MODULES.get(name, name)
        return _row(number, NOT_RUN, f"set by analysis.experiments.{module}", None, source)
    t0 = time.perf_counter()
    try:
        results = json.loads(path.read_text())
        claim = results.get(key) if isinstance(results, dict) else None
        if not isinstance(claim, dict):
            raise ValueError(f"{path}: expected a {key!r} object, got {type(claim).__name__}")
        for field, kind in (("measured", str), ("criterion", str), ("holds", bool)):
            if not isinstance(claim.get(field), kind):
                raise ValueError(
                    f"{path}: expected {key}.{field} to be a {kind.__name__}, "
                    f"got {claim.get(field)!r}"
                )
        runtime = results.get("runtime_s")
        if runtime is not None and not isinstance(runtime, int | float):
            raise ValueError(f"{path}: expected runtime_s to be a number, got {runtime!r}")
    except Exception as e:
        return error_row(number, source, e)
    return _row(
        number,
        claim["measured"],
        claim["criterion"],
        claim["holds"],
        source,
        seconds=time.perf_counter() - t0,
        runtime_s=None if runtime is None else float(runtime),
    )
