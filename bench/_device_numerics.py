"""The numerics phase of ``bench/device.py``: every family's forms against a float64 reference.

Each item runs one form of one family (``attn.attention``'s implementations, the
linear, delta-rule, DeltaProduct and SSD forms, MoBA, NSA, DSA, split-K and
paged decoding, and the newer DPLR delta rule (RWKV-7), PaTH and log-linear
forms) in one dtype on the device, as users run it, and compares its output,
final state and the gradients of its differentiable inputs with a reference
computed on the same inputs.

The reference. The library's forms compute in float32 internally whatever the
input dtype (``preferred_element_type=float32`` and ``astype(float32)`` in every
family), so its simplest form fed float64 arrays returns float64 arrays holding
a float32 computation (``attn.dot_product_attention`` under ``jax.enable_x64``:
1.8e-7 from a float64 oracle on a 16-token causal call). The references here
are therefore small jnp functions written from each family's equations (their
modules' docstrings) and run in float64 under ``jax.enable_x64`` (float32 at
``"highest"`` matmul precision on a device without float64, a TPU): masked
softmax attention (softmax, decoding, and the sparse methods over the keys
their selection reads), gated linear attention (elu+1 features), Mamba-2's SSD,
the delta rule and DeltaProduct as scans over tokens, the DPLR delta rule as a scan
of ``S <- (diag(w) + b a^T) S + k v^T``, log-linear attention as the masked quadratic
sum with the Fenwick levels ``bit_length(t XOR s)`` (clamped to L - 1), and PaTH and
log-linear Gated DeltaNet as scans applying each token's transform to every earlier key
(the explicit products), then a causal softmax or the level-weighted sum. What they
share with the library: the mask algebra (``Mask.allowed``, tested on its own) and, for
MoBA, NSA and DSA, the selection, computed by the library's selection functions on the
item's own inputs and then read as a boolean mask (a discrete choice has no float64
version; the attention over it does). NSA's selection ranks float32
probabilities, so a near tie could go the other way in the form's own program:
a rare difference, which the table would show as that item's error. Every input
is a bfloat16 number held in float32, so the bfloat16 and float32 items of a
case share one reference, computed once per case in the phase's process.

Precision. float32 items run under ``jax.default_matmul_precision("highest")``:
a GPU's default float32 matmul is TF32 (10 mantissa bits), which would break the
float32 tolerances the CPU tests prove, and "highest" is what a user asks for
when they want float32. bfloat16 items run at the default precision, as a model
runs them (their float32 internals then use TF32 on a GPU): the process's
setting, which a row records (``matmul_precision``, None for jax's own). A few
items (the last, the first a budget cut drops) run float32 at the default
precision too, judged by the reduced-precision rule: what TF32 costs. The
references always run at "highest".

Errors and tolerances. Each error is norm-wise relative, ``||got - ref|| /
||ref||`` in float64 over the whole array (the measure of ``tests/``; the max
absolute error is kept beside it in the row). float32 at "highest": 1e-5 for
outputs and final states, 1e-4 for gradients (the float32 tolerances of
``tests/``' families). bfloat16, and float32 at the default precision: 1e-2 for
everything, about four times the norm-wise error of rounding a result to
bfloat16 once (a uniform relative error of at most 2**-8 has an rms of
2**-8 / sqrt(3) = 2.3e-3), which leaves room for the roundings inside (the
probabilities of a FlashAttention backward, a bf16 gradient). A non-finite value
fails. An item over its tolerance is a FAIL row in the table, not an exception.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time

import numpy as np

from bench import _device_cases as cases
from bench import _device_cases_softmax as soft

TITLE = "Numerics: every family's forms against a float64 reference"
# About 35 s of the run's 450 s (tune 0.38, families 0.38, train 0.18): the first ~20 items
# on an H200 at ~1.5 s each (compiles included); all 60 would take ~95 s (WEIGHT ~0.2).
WEIGHT = 0.16

F32_TOL = 1e-5  # float32 outputs and final states at "highest", norm-wise relative
F32_GRAD_TOL = 1e-4  # float32 gradients at "highest"
LOW_TOL = 1e-2  # bfloat16, and float32 at the default precision (TF32 on a GPU)

F32, BF16 = "float32", "bfloat16"

# The fixed-state families' cases, from their records (``bench/_device_cases.py``): every
# (family, variant), and each family's first variant.
FIXED = cases.fixed_state_cases()
FIRSTS = [(n, v) for i, (n, v) in enumerate(FIXED) if n not in {m for m, _ in FIXED[:i]}]


def _fixed(pairs, forms, dtype: str, precision: str) -> list[tuple]:
    """Items of the fixed-state ``pairs`` in ``forms(family) -> forms``."""
    from attn.linear import FAMILIES

    return [(f"{n}/{v}", form, dtype, precision) for n, v in pairs
            for form in forms(FAMILIES[n])]  # fmt: skip


def _training(family):
    """The form a family trains with: chunkwise, or its first (TTT's dual form)."""
    return ("chunkwise",) if "chunkwise" in family.forms else family.forms[:1]


def _others(family):
    return tuple(form for form in family.forms if form not in _training(family))


# (case, form, dtype, precision), most important first: a budget cut drops the tail, so the
# first pass covers every family once (every fixed-state case's training form, from the
# records, right after softmax's kernels), the second the kernels of their own and the other
# dtype, the third the remaining forms, the last float32 at the default precision (TF32).
PLAN = [
    ("softmax/causal-gqa", "pallas", BF16, "default"),
    ("softmax/causal-gqa", "cudnn", BF16, "default"),
    ("softmax/causal-gqa", "xla", BF16, "default"),
    ("softmax/causal-gqa", "blockwise", BF16, "default"),
    ("softmax/causal-gqa", "mosaic", BF16, "default"),
    *_fixed(FIXED, _training, F32, "highest"),
    ("moba/causal", "gather", F32, "highest"),
    ("nsa/causal", "gather", F32, "highest"),
    ("dsa/causal", "gather", F32, "highest"),
    ("decode/causal", "dense", F32, "highest"),
    ("decode/causal", "paged", F32, "highest"),
    ("path/fox", "blockwise", F32, "highest"),
    # second pass: the kernels of their own, then the other dtype
    ("softmax/causal-gqa", "pallas", F32, "highest"),
    ("moba/causal", "pallas", BF16, "default"),
    ("nsa/causal", "pallas", BF16, "default"),
    ("softmax/segments", "cudnn", BF16, "default"),
    ("softmax/segments", "pallas", BF16, "default"),
    ("softmax/sinks-softcap", "pallas", BF16, "default"),
    ("softmax/streaming", "pallas", BF16, "default"),
    ("softmax/segments", "mosaic", BF16, "default"),
    ("softmax/sinks-softcap", "mosaic", BF16, "default"),
    ("softmax/streaming", "mosaic", BF16, "default"),
    *_fixed(FIRSTS, _training, BF16, "default"),
    ("decode/causal", "pallas", BF16, "default"),
    ("decode/causal", "paged", BF16, "default"),
    ("softmax/causal-gqa", "blockwise", F32, "highest"),
    ("softmax/causal-gqa", "xla", F32, "highest"),
    # third pass: the other forms, then the other cases
    *_fixed(FIRSTS, _others, F32, "highest"),
    ("dsa/causal", "gather", BF16, "default"),
    ("softmax/streaming", "blockwise", BF16, "default"),
    ("softmax/sinks-softcap", "blockwise", F32, "highest"),
    ("softmax/segments", "xla", BF16, "default"),
    ("softmax/segments", "blockwise", F32, "highest"),
    ("softmax/causal-gqa", "dense", F32, "highest"),
    ("path/fox", "blockwise", BF16, "default"),
    ("path/fox", "naive", F32, "highest"),
    # float32 as a GPU runs it by default: TF32 matmuls
    ("softmax/causal-gqa", "pallas", F32, "default"),
    *_fixed(FIRSTS[:2], _training, F32, "default"),
]

# Forms a CPU (a dry run) cannot run: cuDNN; the Mosaic GPU kernels take head dims 64 and 128
# only, not the dry run's 8 (their interpreted twins are checked in tests/attn/pallas).
GPU_ONLY = {"cudnn", "mosaic"}


# ----------------------------------------------------------------------------
# The phase protocol


def items(dry_run: bool) -> list[dict]:
    """One item per (case, form, dtype, precision) of ``PLAN``. A dry run (a CPU) leaves out
    cuDNN and float32 at the default precision (no TF32 there: the float32 items again)."""
    out = []
    for case, form, dtype, precision in PLAN:
        if dry_run and (form in GPU_ONLY or (dtype == F32 and precision == "default")):
            continue
        family = CASES[case][0]
        name = f"{case}/{form}/{dtype}" + ("@default" if dtype == F32 and precision == "default"
                                            else "")  # fmt: skip
        out.append(dict(name=name, case=case, family=family, form=form, dtype=dtype,
                        precision=precision))  # fmt: skip
    return out


def run_item(item: dict, ctx) -> dict:
    """Runs the item's form and its case's reference; returns the errors and the verdict."""
    import jax

    if item["form"] in GPU_ONLY and ctx.platform != "gpu":
        return {"status": f"not measured: {item['form']} needs a GPU"}
    start = time.perf_counter()
    case = build_case(item["case"], ctx.dry_run)
    run = functools.partial(case.run, item["form"])
    with _precision(item["precision"]):
        precision = getattr(jax.config, "jax_default_matmul_precision", None)  # as it ran
        arrays = _cast(case, item["dtype"])
        cts = _cotangents(case, ctx, run, arrays)
        extra = case.select(item["form"], arrays) if case.select else {}
        got = _evaluate(run, arrays, case.diff, cts)
    want = reference(item["case"], case, extra, cts, ctx)
    result = compare(got, want, tolerance(item["dtype"], item["precision"]))
    result.update(status=verdict(result), seconds=time.perf_counter() - start,
                  matmul_precision=precision, reference=reference_kind(ctx.platform))  # fmt: skip
    return result


def verdict(result: dict) -> str:
    """``"ok"``, or ``"FAIL: ..."`` naming what is over its tolerance (the run's summary
    counts FAIL apart from ok, failed and not measured)."""
    if result["passed"]:
        return "ok"
    tol = result["tolerance"]
    over = []
    if not result["out_error"] <= tol["out"]:
        over.append(f"output {result['out_error']:.1e} > {tol['out']:.0e}")
    over += [f"d{name} {e:.1e} > {tol['grad']:.0e}" for name, e in result["grad_errors"].items()
             if not e <= tol["grad"]]  # fmt: skip
    return "FAIL: " + ", ".join(over)


def markdown(rows: list[dict], info: dict) -> str:
    """The section: how the references and tolerances are made, one table, one summary line."""
    kinds = {row["reference"] for row in rows if "passed" in row}
    kind = " / ".join(sorted(kinds)) or "float64"
    lines = [
        f"Each form against a reference written from its family's equations, run in {kind} "
        "on the same inputs (bfloat16 numbers, so both dtypes of a case share it). Errors are "
        "norm-wise relative, `||got - ref|| / ||ref||`, output and final state (the worse) and "
        "the worst gradient (named). Tolerances: float32 at `highest` matmul precision "
        f"{F32_TOL:.0e} for outputs, {F32_GRAD_TOL:.0e} for gradients; bfloat16, and float32 "
        f"at the default precision (TF32 on a GPU), {LOW_TOL:.0e}.",
        "",
        "| family | form | dtype | output error | worst gradient error | tolerance | pass |",
        "|---|---|---|---|---|---|---|",
    ]
    order = {case: i for i, case in enumerate(CASES)}
    judged = passed = 0
    for row in sorted(rows, key=lambda r: order.get(r.get("case"), len(order))):
        dtype = row["dtype"] + (", default precision" if row["dtype"] == F32
                                and row["precision"] == "default" else "")  # fmt: skip
        form = f"{row['form']} ({CASES[row['case']][1]})" if row.get("case") in CASES else "?"
        if "passed" not in row:
            lines.append(f"| {row.get('family', '?')} | {form} | {dtype} | | | | "
                         f"{row.get('status', 'not run')} |")  # fmt: skip
            continue
        judged += 1
        passed += bool(row["passed"])
        grad = "-" if row["grad_error"] is None else (
            f"{_fmt(row['grad_error'])} (d{row['worst_grad']})")  # fmt: skip
        tol = row["tolerance"]
        tol_text = f"{tol['out']:.0e}" + ("" if tol["grad"] == tol["out"] else
                                          f" / {tol['grad']:.0e}")  # fmt: skip
        verdict = "pass" if row["passed"] else "**FAIL**"
        lines.append(f"| {row['family']} | {form} | {dtype} | {_fmt(row['out_error'])} | "
                     f"{grad} | {tol_text} | {verdict} |")  # fmt: skip
    not_run = len(rows) - judged
    summary = f"**{passed} of {judged} pass**" + (f"; {not_run} not run" if not_run else "")
    if info.get("dry_run"):
        summary += " (dry run: CPU, tiny shapes, Pallas in interpret mode)"
    return "\n".join([*lines, "", summary + "."])


def _fmt(x) -> str:
    return f"{x:.1e}" if isinstance(x, float) else str(x)


# ----------------------------------------------------------------------------
# Comparison


def tolerance(dtype: str, precision: str) -> dict:
    """``{"out": ..., "grad": ...}``: float32 at "highest" gets the float32 tolerances of
    ``tests/``; anything rounded to fewer bits (bfloat16, TF32) gets ``LOW_TOL``."""
    if dtype == F32 and precision == "highest":
        return {"out": F32_TOL, "grad": F32_GRAD_TOL}
    return {"out": LOW_TOL, "grad": LOW_TOL}


def errors(got, want) -> tuple[float, float]:
    """``(norm-wise relative error, max abs error)`` of ``got`` against ``want`` in float64;
    ``(inf, inf)`` where ``got`` is not finite."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not np.isfinite(got).all():
        return float("inf"), float("inf")
    diff = got - want
    scale = max(float(np.linalg.norm(want)), 1e-300)
    return float(np.linalg.norm(diff)) / scale, float(np.abs(diff).max(initial=0.0))


def compare(got: dict, want: dict, tol: dict) -> dict:
    """The errors of ``got`` (``{"out": [leaves], "grads": {name: array}}``) against ``want``
    and the verdict: outputs (the first leaf and any final states) within ``tol["out"]``,
    every gradient within ``tol["grad"]``."""
    outs = [errors(g, w) for g, w in zip(got["out"], want["out"], strict=True)]
    grads = {name: errors(got["grads"][name], w) for name, w in want["grads"].items()}
    result = {
        "out_error": max(e for e, _ in outs),
        "out_max_abs": max(a for _, a in outs),
        "state_error": max((e for e, _ in outs[1:]), default=None),
        "grad_errors": {name: e for name, (e, _) in grads.items()},
        "grad_max_abs": {name: a for name, (_, a) in grads.items()},
        "grad_error": max((e for e, _ in grads.values()), default=None),
        "worst_grad": max(grads, key=lambda n: grads[n][0]) if grads else None,
        "tolerance": tol,
    }
    ok = result["out_error"] <= tol["out"]
    ok &= all(e <= tol["grad"] for e, _ in grads.values())
    result["passed"] = bool(ok)
    return result


# ----------------------------------------------------------------------------
# Running a form and a reference


def reference_kind(platform: str) -> str:
    return "float32 at highest precision" if platform == "tpu" else "float64"


def _precision(name: str):
    """``"highest"``: every float32 matmul in full precision; ``"default"``: as configured."""
    import jax

    return (
        jax.default_matmul_precision("highest") if name == "highest" else contextlib.nullcontext()
    )


def _x64():
    """A context in which arrays may be float64 (``jax.enable_x64``, jax >= 0.8; else the
    older ``jax.experimental`` one)."""
    import jax

    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # pragma: no cover - older jax

    return enable_x64()


def _cast(case, dtype: str) -> dict:
    """The case's arrays for a form: the ``data`` ones in ``dtype``, other floats float32."""
    import jax.numpy as jnp

    out = {}
    for name, x in case.arrays.items():
        if name in case.reference_only:
            continue
        if np.issubdtype(x.dtype, np.floating):
            x = jnp.asarray(x, jnp.dtype(dtype) if name in case.data else jnp.float32)
        out[name] = jnp.asarray(x)
    return out


def _evaluate(fn, arrays: dict, diff: tuple, cotangents: list) -> dict:
    """``fn(arrays)``'s leaves and the gradients of ``sum(leaf * cotangent)`` w.r.t. ``diff``,
    jitted, as float64 NumPy arrays."""
    import jax
    import jax.numpy as jnp

    if not diff:
        leaves = jax.jit(lambda a: jax.tree.leaves(fn(a)))(arrays)
        return {"out": [np.asarray(x).astype(np.float64) for x in leaves], "grads": {}}

    def loss(d, fixed, cts):
        leaves = jax.tree.leaves(fn({**fixed, **d}))
        total = sum(jnp.sum(x.astype(c.dtype) * c) for x, c in zip(leaves, cts, strict=True))
        return total, leaves

    fixed = {n: x for n, x in arrays.items() if n not in diff}
    cts = [jnp.asarray(c, _float_dtype()) for c in cotangents]
    grads, leaves = jax.jit(jax.grad(loss, has_aux=True))({n: arrays[n] for n in diff}, fixed, cts)
    return {
        "out": [np.asarray(x).astype(np.float64) for x in leaves],
        "grads": {n: np.asarray(g).astype(np.float64) for n, g in grads.items()},
    }


def _float_dtype():
    """float64 inside ``_x64()``, float32 outside."""
    import jax.numpy as jnp

    return jnp.result_type(float)


_REFERENCES: dict = {}
_COTANGENTS: dict = {}


def _cotangents(case, ctx, run, arrays) -> list:
    """One float32 cotangent per output leaf of ``run(arrays)`` (random, fixed per case: its
    first item's form gives the shapes, which every form shares)."""
    import jax

    key = (case.name, ctx.dry_run)
    if key not in _COTANGENTS:
        shapes = jax.eval_shape(lambda a: jax.tree.leaves(run(a)), arrays)
        rng = cases.rng_for(case.name + "/cotangents")
        _COTANGENTS[key] = [cases.normal(rng, s.shape) for s in shapes]
    return _COTANGENTS[key]


def reference(name: str, case, extra: dict, cts: list, ctx) -> dict:
    """The case's reference (outputs and gradients), float64 where the platform has it,
    cached per case and per selection (``extra``) in this process."""
    import jax
    import jax.numpy as jnp

    digest = hashlib.sha256()
    for key in sorted(extra):
        digest.update(key.encode() + np.ascontiguousarray(extra[key]).tobytes())
    key = (name, ctx.dry_run, ctx.platform, digest.hexdigest())
    if key in _REFERENCES:
        return _REFERENCES[key]
    arrays = {**case.arrays, **extra}
    context = contextlib.nullcontext() if ctx.platform == "tpu" else _x64()
    with context, jax.default_matmul_precision("highest"):
        wide = _float_dtype()
        arrays = {
            n: jnp.asarray(x, wide) if np.issubdtype(x.dtype, np.floating) else jnp.asarray(x)
            for n, x in arrays.items()
        }
        _REFERENCES[key] = _evaluate(case.oracle, arrays, case.diff, cts)
    return _REFERENCES[key]


# name -> (family, what the case holds, builder(dry_run))
P = functools.partial
CASES = {
    "softmax/causal-gqa": ("softmax", "causal, GQA", P(soft.softmax_case, "causal-gqa")),
    "softmax/streaming": ("softmax", "causal, sliding window or initial tokens, GQA",
                          P(soft.softmax_case, "streaming")),
    "softmax/sinks-softcap": ("softmax", "causal, GQA, sinks, soft-cap",
                              P(soft.softmax_case, "sinks-softcap")),
    "softmax/segments": ("softmax", "causal, GQA, packed segments and padding",
                         P(soft.softmax_case, "segments")),
    "moba/causal": ("MoBA", "causal, GQA", soft.moba_case),
    "nsa/causal": ("NSA", "causal, GQA", soft.nsa_case),
    "dsa/causal": ("DSA", "causal, GQA", soft.dsa_case),
    "decode/causal": ("decode", "2 queries, causal, rows of their own lengths", soft.decode_case),
    "path/fox": ("PaTH", "FoX gates, causal, GQA", soft.path_case),
    # every fixed-state family's variants, from its record
    **{f"{n}/{v}": (n, f"its {v!r} example (attn.linear.FAMILIES)", P(cases.family_case, n, v))
       for n, v in FIXED},
}  # fmt: skip


@functools.cache
def build_case(name: str, dry_run: bool) -> cases.Case:
    """The case ``name`` at the dry run's or the device's shapes (built once per process)."""
    return CASES[name][2](dry_run)
