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
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

TITLE = "Numerics: every family's forms against a float64 reference"
# About 35 s of the run's 450 s (tune 0.38, families 0.38, train 0.18): the first ~20 items
# on an H200 at ~1.5 s each (compiles included); all 60 would take ~95 s (WEIGHT ~0.2).
WEIGHT = 0.16

F32_TOL = 1e-5  # float32 outputs and final states at "highest", norm-wise relative
F32_GRAD_TOL = 1e-4  # float32 gradients at "highest"
LOW_TOL = 1e-2  # bfloat16, and float32 at the default precision (TF32 on a GPU)

# Shapes: on the device T is not a multiple of any chunk or block; a dry run is tiny.
SIZES = {
    False: dict(
        B=2, T=1000, N=4, K=2, H=64, chunk=64, window=128, sinks=4, softcap=2.0,
        blockwise_block=256, pallas_block=None, moba_block=64, moba_top_k=4,
        nsa=dict(compress_block=32, compress_stride=16, select_block=64, num_selected=6,
                 window=128, initial_blocks=1, local_blocks=2),
        dsa_top_k=128, index_heads=2, index_dim=32, decode_T=2, lengths=(1000, 613),
        splits=4, page=8, steps=2, levels=8,
    ),
    True: dict(
        B=2, T=40, N=4, K=2, H=8, chunk=16, window=12, sinks=4, softcap=2.0,
        blockwise_block=16, pallas_block=16, moba_block=8, moba_top_k=2,
        nsa=dict(compress_block=8, compress_stride=4, select_block=8, num_selected=3,
                 window=12, initial_blocks=1, local_blocks=1),
        dsa_top_k=12, index_heads=2, index_dim=8, decode_T=2, lengths=(40, 23),
        splits=3, page=4, steps=2, levels=5,
    ),
}  # fmt: skip

F32, BF16 = "float32", "bfloat16"

# (case, form, dtype, precision), most important first: a budget cut drops the tail, so the
# first pass covers every family once (the newer families' training forms right after it),
# the second the other dtype, the third the remaining forms (then the newer families'), the
# last float32 at the default precision (TF32 on a GPU).
PLAN = [
    ("softmax/causal-gqa", "pallas", BF16, "default"),
    ("softmax/causal-gqa", "cudnn", BF16, "default"),
    ("softmax/causal-gqa", "xla", BF16, "default"),
    ("softmax/causal-gqa", "blockwise", BF16, "default"),
    ("softmax/causal-gqa", "mosaic", BF16, "default"),
    ("linear/gated", "chunkwise", F32, "highest"),
    ("delta/gated", "chunkwise", F32, "highest"),
    ("delta/kda", "chunkwise", F32, "highest"),
    ("ssd/mamba2", "chunkwise", F32, "highest"),
    ("product/gated", "chunkwise", F32, "highest"),
    ("moba/causal", "gather", F32, "highest"),
    ("nsa/causal", "gather", F32, "highest"),
    ("dsa/causal", "gather", F32, "highest"),
    ("decode/causal", "dense", F32, "highest"),
    ("decode/causal", "paged", F32, "highest"),
    # the newer families' training forms (after the first pass: the older families' kernels
    # matter more), their other forms and bfloat16 after the third pass
    ("dplr/rwkv7", "chunkwise", F32, "highest"),
    ("path/fox", "blockwise", F32, "highest"),
    ("log-linear/mamba2", "chunkwise", F32, "highest"),
    ("log-linear/gdn", "chunkwise", F32, "highest"),
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
    ("linear/gated", "chunkwise", BF16, "default"),
    ("delta/gated", "chunkwise", BF16, "default"),
    ("ssd/mamba2", "chunkwise", BF16, "default"),
    ("decode/causal", "pallas", BF16, "default"),
    ("decode/causal", "paged", BF16, "default"),
    ("softmax/causal-gqa", "blockwise", F32, "highest"),
    ("softmax/causal-gqa", "xla", F32, "highest"),
    # third pass: the other forms, then the other cases
    ("linear/gated", "recurrent", F32, "highest"),
    ("delta/gated", "recurrent", F32, "highest"),
    ("ssd/mamba2", "recurrent", F32, "highest"),
    ("ssd/mamba2", "quadratic", F32, "highest"),
    ("linear/gated", "parallel", F32, "highest"),
    ("delta/plain", "chunkwise", F32, "highest"),
    ("dsa/causal", "gather", BF16, "default"),
    ("softmax/streaming", "blockwise", BF16, "default"),
    ("softmax/sinks-softcap", "blockwise", F32, "highest"),
    ("softmax/segments", "xla", BF16, "default"),
    ("softmax/segments", "blockwise", F32, "highest"),
    ("softmax/causal-gqa", "dense", F32, "highest"),
    ("dplr/rwkv7", "chunkwise", BF16, "default"),
    ("path/fox", "blockwise", BF16, "default"),
    ("log-linear/mamba2", "chunkwise", BF16, "default"),
    ("log-linear/gdn", "chunkwise", BF16, "default"),
    ("dplr/rwkv7", "recurrent", F32, "highest"),
    ("path/fox", "naive", F32, "highest"),
    ("log-linear/mamba2", "recurrent", F32, "highest"),
    ("log-linear/mamba2", "quadratic", F32, "highest"),
    ("log-linear/gdn", "recurrent", F32, "highest"),
    # float32 as a GPU runs it by default: TF32 matmuls
    ("softmax/causal-gqa", "pallas", F32, "default"),
    ("linear/gated", "chunkwise", F32, "default"),
    ("delta/gated", "chunkwise", F32, "default"),
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
        rng = _rng(case.name + "/cotangents")
        _COTANGENTS[key] = [_normal(rng, s.shape) for s in shapes]
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


# ----------------------------------------------------------------------------
# Cases: inputs, the library's call, the reference from the equations


@dataclass
class Case:
    """One family's inputs and functions, shared by the items of its forms and dtypes.

    ``arrays``: NumPy float32 (bfloat16 numbers), int and bool arrays; ``data``: the names a
    form gets in the item's dtype (the rest stay float32, as a model keeps its gates);
    ``diff``: the names differentiated (none: forward only); ``run(form, arrays)``: the
    library; ``oracle(arrays)``: the same outputs from the equations, in the arrays' dtype;
    ``reference_only``: arrays only the oracle reads; ``select(form, arrays)``: extra oracle
    arrays from the library's selection on the item's own inputs (sparse methods).
    """

    name: str
    arrays: dict
    data: tuple
    diff: tuple
    run: Callable
    oracle: Callable
    reference_only: tuple = ()
    select: Callable | None = field(default=None)


def _rng(name: str):
    return np.random.default_rng(
        int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    )


def _bf16(x):
    """``x`` rounded to bfloat16 numbers, held in float32."""
    import jax.numpy as jnp

    return np.asarray(x, np.float32).astype(jnp.bfloat16).astype(np.float32)


def _normal(rng, shape):
    return _bf16(rng.standard_normal(shape))


def _unit(rng, shape):
    x = rng.standard_normal(shape)
    return _bf16(x / np.linalg.norm(x, axis=-1, keepdims=True))


def _packed_ids(B: int, T: int):
    """Segment ids ``[B,T]``: row 0 packs three sequences and ends in padding (id 0), row 1
    is one sequence and padding."""
    ids = np.zeros((B, T), np.int32)
    cuts = np.round(np.array([0, 0.3, 0.75, 0.95]) * T).astype(int)
    for i in range(3):
        ids[0, cuts[i] : cuts[i + 1]] = i + 1
    ids[1:, : int(0.9 * T)] = 1
    return ids


def _visible(mask, q_pos, kv_pos, q_seg=None, kv_seg=None):
    """``[B,1,T,S]`` bool: the mask on positions (``Mask.allowed``), within segments, padding
    keys and queries seeing nothing."""
    ok = np.asarray(mask.allowed(np.asarray(q_pos), np.asarray(kv_pos)), bool)
    if q_seg is not None:
        ok = ok & (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
    return ok[:, None]


def _reads(start, stop, S: int):
    """Key ranges ``[start, stop)`` ``[B,T,X,n]`` as a boolean ``[B,X,T,S]`` (ranges of one
    selection are disjoint)."""
    start, stop = np.asarray(start), np.asarray(stop)
    B, T, X, _ = start.shape
    count = np.zeros((B, T, X, S + 1), np.int32)
    used = stop > start
    where = np.nonzero(used)[:3]
    np.add.at(count, (*where, start[used]), 1)
    np.add.at(count, (*where, stop[used]), -1)
    return (np.cumsum(count, axis=-1)[..., :S] > 0).transpose(0, 2, 1, 3)


# The oracles (jnp, in the arrays' dtype: float64 under _x64)


def ref_linear():
    """``attn.linear.reference`` (imported when a reference runs: JAX starts late here)."""
    from attn.linear import reference

    return reference


def ref_softmax():
    """``attn.softmax.reference``, likewise."""
    from attn.softmax import reference

    return reference


# The builders: one per family, its cases by name in CASES


def _softmax(variant: str, dry_run: bool) -> Case:
    import attn
    from attn import masks

    z = SIZES[dry_run]
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    rng = _rng(f"softmax/{variant}")
    mask = masks.causal()
    if variant == "streaming":
        mask = mask & (masks.sliding_window(z["window"]) | masks.initial_tokens(z["sinks"]))
    arrays = dict(q=_normal(rng, (B, T, N, H)), k=_normal(rng, (B, T, K, H)),
                  v=_normal(rng, (B, T, K, H)))  # fmt: skip
    pos = np.arange(T)[None]
    seg = _packed_ids(B, T) if variant == "segments" else None
    arrays["ok"] = _visible(mask, pos, pos, seg, seg)
    softcap = None
    if variant == "sinks-softcap":
        arrays["sinks"] = rng.standard_normal(N).astype(np.float32)
        softcap = z["softcap"]
    if seg is not None:
        arrays["seg"] = seg

    def run(form, a):
        kw = dict(mask=mask, impl=form, softcap=softcap, sink_logits=a.get("sinks"))
        block = z[f"{form}_block"] if form in ("blockwise", "pallas") else None
        if block is not None:
            kw.update(block_q=block, block_k=block)
        if "seg" in a:
            kw.update(q_segment_ids=a["seg"], kv_segment_ids=a["seg"])
        return attn.attention(a["q"], a["k"], a["v"], **kw)

    def oracle(a):
        return ref_softmax().softmax(a["q"], a["k"], a["v"], a["ok"], scale=H**-0.5,
                                     softcap=softcap, sinks=a.get("sinks"))  # fmt: skip

    return Case(f"softmax/{variant}", arrays, ("q", "k", "v"), ("q", "k", "v"),
                run, oracle, reference_only=("ok",))  # fmt: skip


def _linear(dry_run: bool) -> Case:
    import jax.numpy as jnp

    import attn

    z = SIZES[dry_run]
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    rng = _rng("linear/gated")
    arrays = dict(q=_normal(rng, (B, T, N, H)), k=_normal(rng, (B, T, K, H)),
                  v=_normal(rng, (B, T, K, H)),
                  log_gates=-rng.uniform(0.0, 0.2, (B, T, N)).astype(np.float32))  # fmt: skip

    def run(form, a):
        return attn.linear_attention(a["q"], a["k"], a["v"], form=form, log_gates=a["log_gates"],
                                     chunk_size=z["chunk"], return_state=True)  # fmt: skip

    def oracle(a):
        G = N // K
        qf, kf = (ref_linear().feature_map("elu1", a[x]) for x in ("q", "k"))
        kf, v = (jnp.repeat(x, G, axis=2) for x in (kf, a["v"]))
        out, kv, zs = ref_linear().gated_linear(qf, kf, v, a["log_gates"], normalize=True)
        return out, (kv, zs)

    return Case("linear/gated", arrays, ("q", "k", "v"),
                ("q", "k", "v", "log_gates"), run, oracle)  # fmt: skip


def _delta(variant: str, dry_run: bool) -> Case:
    import attn

    z = SIZES[dry_run]
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    product = variant == "product"
    n = (z["steps"],) if product else ()
    rng = _rng(f"delta/{variant}")
    arrays = dict(q=_unit(rng, (B, T, K, H)), k=_unit(rng, (B, T, *n, K, H)),
                  v=_normal(rng, (B, T, *n, N, H)),
                  beta=rng.uniform(0.05, 0.95, (B, T, *n, N)).astype(np.float32))  # fmt: skip
    gates = {"plain": None, "gated": (B, T, N), "kda": (B, T, N, H), "product": (B, T, N)}
    if gates[variant] is not None:
        arrays["log_gates"] = -rng.uniform(0.0, 0.2, gates[variant]).astype(np.float32)
    fn = attn.delta_product if product else attn.delta_rule

    def run(form, a):
        return fn(a["q"], a["k"], a["v"], a["beta"], log_gates=a.get("log_gates"), form=form,
                  chunk_size=z["chunk"], return_state=True)  # fmt: skip

    def oracle(a):
        return ref_linear().delta_rule(a["q"], a["k"], a["v"], a["beta"], a.get("log_gates"))

    diff = ("q", "k", "v", "beta") + (("log_gates",) if "log_gates" in arrays else ())
    name = "product/gated" if product else f"delta/{variant}"
    return Case(name, arrays, ("q", "k", "v"), diff, run, oracle)


def _ssd(dry_run: bool) -> Case:
    import attn

    z = SIZES[dry_run]
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    rng = _rng("ssd/mamba2")
    arrays = dict(
        x=_normal(rng, (B, T, N, H)),
        dt=rng.uniform(0.01, 0.3, (B, T, N)).astype(np.float32),
        A=-rng.uniform(0.5, 1.5, N).astype(np.float32),
        B=_normal(rng, (B, T, K, H)),
        C=_normal(rng, (B, T, K, H)),
        D=rng.standard_normal(N).astype(np.float32),
    )

    def run(form, a):
        return attn.ssd(a["x"], a["dt"], a["A"], a["B"], a["C"], D=a["D"], form=form,
                        chunk_size=z["chunk"], return_state=True)  # fmt: skip

    def oracle(a):
        return ref_linear().ssd(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"])

    return Case("ssd/mamba2", arrays, ("x", "B", "C"),
                ("x", "dt", "A", "B", "C", "D"), run, oracle)  # fmt: skip


def _sparse_inputs(name: str, z: dict):
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    rng = _rng(name)
    arrays = dict(q=_normal(rng, (B, T, N, H)), k=_normal(rng, (B, T, K, H)),
                  v=_normal(rng, (B, T, K, H)))  # fmt: skip
    return rng, arrays


def _moba(dry_run: bool) -> Case:
    import jax

    import attn
    from attn import masks
    from attn.softmax.call import check_call
    from attn.sparse import moba_select

    z = SIZES[dry_run]
    T, H, mask = z["T"], z["H"], masks.causal()
    _, arrays = _sparse_inputs("moba/causal", z)
    pos = np.arange(T)[None]
    vis = _visible(mask, pos, pos)
    sizes = dict(block_size=z["moba_block"], top_k=z["moba_top_k"])

    def run(form, a):
        return attn.moba_attention(a["q"], a["k"], a["v"], mask=mask, impl=form, **sizes)

    def select(form, a):
        c = check_call(a["q"], a["k"], a["v"], mask=mask)
        start, stop = jax.jit(functools.partial(moba_select, **sizes))(c, a["q"], a["k"])
        return {"reads": _reads(start, stop, T) & vis}

    def oracle(a):
        return ref_softmax().softmax(a["q"], a["k"], a["v"], a["reads"], scale=H**-0.5)

    return Case("moba/causal", arrays, ("q", "k", "v"), ("q", "k", "v"), run,
                oracle, select=select)  # fmt: skip


def _nsa(dry_run: bool) -> Case:
    import jax

    import attn
    from attn import masks
    from attn.softmax.call import check_call
    from attn.sparse.gather import DEFAULT_CHUNK
    from attn.sparse.nsa import compressed_branch

    z = SIZES[dry_run]
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    sizes, mask = z["nsa"], masks.causal()
    block, stride = sizes["compress_block"], sizes["compress_stride"]
    rng, arrays = _sparse_inputs("nsa/causal", z)
    M = -(-T // stride)
    arrays.update(
        gates=(1 / (1 + np.exp(-rng.standard_normal((B, T, N, 3))))).astype(np.float32),
        ck=_normal(rng, (B, M, K, H)),
        cv=_normal(rng, (B, M, K, H)),
    )
    pos = np.arange(T)[None]
    vis = np.broadcast_to(_visible(mask, pos, pos), (B, 1, T, T))
    # Compressed block m holds positions m*stride .. m*stride + block - 1 (where they exist):
    # a query reads it when it sees every key in it.
    first = np.arange(M) * stride
    seen = np.concatenate([np.zeros((B, 1, T, 1), int), np.cumsum(vis, -1)], -1)
    last = np.minimum(first + block, T)
    arrays["cmp_ok"] = (first + block <= T) & (seen[..., last] - seen[..., first] == block)
    arrays["win_ok"] = vis & (pos[:, None, None, :] > pos[:, None, :, None] - sizes["window"])

    def run(form, a):
        return attn.nsa_attention(a["q"], a["k"], a["v"], a["gates"], a["ck"], a["cv"],
                                  mask=mask, impl=form, **sizes)  # fmt: skip

    def select(form, a):
        c = check_call(a["q"], a["k"], a["v"], mask=mask)
        branch = functools.partial(compressed_branch, chunk=DEFAULT_CHUNK, **sizes)
        _, start, stop = jax.jit(branch)(c, a["q"], a["ck"], a["cv"])
        return {"slc_ok": np.repeat(_reads(start, stop, T), N // K, axis=1) & vis}

    def oracle(a):
        scale = H**-0.5
        o_cmp = ref_softmax().softmax(a["q"], a["ck"], a["cv"], a["cmp_ok"], scale=scale)
        o_slc = ref_softmax().softmax(a["q"], a["k"], a["v"], a["slc_ok"], scale=scale)
        o_win = ref_softmax().softmax(a["q"], a["k"], a["v"], a["win_ok"], scale=scale)
        g = a["gates"]
        return sum(g[..., i, None] * o for i, o in enumerate((o_cmp, o_slc, o_win)))

    return Case("nsa/causal", arrays, ("q", "k", "v", "ck", "cv"),
                ("q", "k", "v", "gates", "ck", "cv"), run, oracle,
                reference_only=("cmp_ok", "win_ok"), select=select)  # fmt: skip


def _dsa(dry_run: bool) -> Case:
    import jax

    import attn
    from attn import masks
    from attn.softmax.call import check_call
    from attn.sparse import indexer_topk

    z = SIZES[dry_run]
    B, T, H, mask = z["B"], z["T"], z["H"], masks.causal()
    rng, arrays = _sparse_inputs("dsa/causal", z)
    I, F = z["index_heads"], z["index_dim"]
    arrays.update(iq=_normal(rng, (B, T, I, F)), ik=_normal(rng, (B, T, F)),
                  iw=_normal(rng, (B, T, I)))  # fmt: skip
    pos = np.arange(T)[None]
    vis = _visible(mask, pos, pos)
    top_k = z["dsa_top_k"]

    def run(form, a):
        return attn.indexed_topk_attention(a["q"], a["k"], a["v"], a["iq"], a["ik"], a["iw"],
                                           top_k=top_k, mask=mask)  # fmt: skip

    def select(form, a):
        c = check_call(a["q"], a["k"], a["v"], mask=mask)
        topk = jax.jit(functools.partial(indexer_topk, top_k=top_k))
        start, stop = topk(c, a["iq"], a["ik"], a["iw"])
        return {"reads": _reads(start, stop, T) & vis}

    def oracle(a):
        return ref_softmax().softmax(a["q"], a["k"], a["v"], a["reads"], scale=H**-0.5)

    return Case("dsa/causal", arrays, ("q", "k", "v"), ("q", "k", "v"), run,
                oracle, select=select)  # fmt: skip


def _decode(dry_run: bool) -> Case:
    import jax.numpy as jnp

    import attn
    from attn import masks

    z = SIZES[dry_run]
    B, S, N, K, H, T = z["B"], z["T"], z["N"], z["K"], z["H"], z["decode_T"]
    rng = _rng("decode/causal")
    mask, page = masks.causal(), z["page"]
    lengths = np.asarray(z["lengths"], np.int32)
    arrays = dict(q=_normal(rng, (B, T, N, H)), k=_normal(rng, (B, S, K, H)),
                  v=_normal(rng, (B, S, K, H)), lengths=lengths)  # fmt: skip
    # Every row's own pages in a shuffled pool; -1 past a row's length; the last page is
    # scratch for the unused entries' writes.
    M = S // page
    tables = rng.permutation(B * M).reshape(B, M).astype(np.int32)
    tables[np.arange(M)[None] * page >= lengths[:, None]] = -1
    arrays["tables"] = tables
    q_pos = lengths[:, None] - T + np.arange(T)
    kv_pos = np.broadcast_to(np.arange(S), (B, S))
    arrays["ok"] = _visible(mask, q_pos, kv_pos) & (kv_pos < lengths[:, None])[:, None, None]

    def run(form, a):
        if form != "paged":
            return attn.decode_attention(a["q"], a["k"], a["v"], lengths=a["lengths"],
                                         num_splits=z["splits"], mask=mask, impl=form)  # fmt: skip
        index = jnp.where(a["tables"] >= 0, a["tables"], B * M)
        pools = [
            jnp.zeros((B * M + 1, page, *x.shape[2:]), x.dtype).at[index].set(
                x.reshape(B, M, page, *x.shape[2:]))
            for x in (a["k"], a["v"])
        ]  # fmt: skip
        return attn.paged_decode_attention(a["q"], *pools, a["tables"], a["lengths"],
                                           num_splits=z["splits"], mask=mask)  # fmt: skip

    def oracle(a):
        return ref_softmax().softmax(a["q"], a["k"], a["v"], a["ok"], scale=H**-0.5)

    return Case("decode/causal", arrays, ("q", "k", "v"), (), run, oracle,
                reference_only=("ok",))  # fmt: skip


def _dplr(dry_run: bool) -> Case:
    import attn

    z = SIZES[dry_run]
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    rng = _rng("dplr/rwkv7")
    # RWKV-7: a = -kappa (unit, per q/k head), b = kappa * a_in (per value head), log_w in
    # (-0.6, 0), r unscaled (scale 1).
    kappa = _unit(rng, (B, T, K, H))
    a_in = rng.uniform(0.0, 1.0, (B, T, N, H))
    arrays = dict(q=_normal(rng, (B, T, K, H)), k=_bf16(0.5 * rng.standard_normal((B, T, K, H))),
                  v=_normal(rng, (B, T, N, H)), a=-kappa,
                  b=_bf16(np.repeat(kappa, N // K, axis=2) * a_in),
                  log_w=-rng.uniform(0.0, 0.6, (B, T, N, H)).astype(np.float32))  # fmt: skip
    scale = H**-0.5

    def run(form, a):
        return attn.dplr_delta_rule(a["q"], a["k"], a["v"], a["a"], a["b"], a["log_w"],
                                    form=form, chunk_size=z["chunk"], scale=scale,
                                    return_state=True)  # fmt: skip

    def oracle(a):
        return ref_linear().dplr_delta_rule(
            a["q"], a["k"], a["v"], a["a"], a["b"], a["log_w"], scale=scale
        )

    return Case("dplr/rwkv7", arrays, ("q", "k", "v", "a", "b"),
                ("q", "k", "v", "a", "b", "log_w"), run, oracle)  # fmt: skip


def _log_linear(variant: str, dry_run: bool) -> Case:
    import attn

    z = SIZES[dry_run]
    B, T, N, K, H, L = z["B"], z["T"], z["N"], z["K"], z["H"], z["levels"]
    name = f"log-linear/{variant}"
    rng = _rng(name)
    delta = variant == "gdn"
    arrays = dict(q=(_unit if delta else _normal)(rng, (B, T, K, H)),
                  k=(_unit if delta else _normal)(rng, (B, T, K, H)),
                  v=_normal(rng, (B, T, N, H)),
                  log_a=-rng.uniform(0.0, 0.2, (B, T, N)).astype(np.float32),
                  lam=rng.uniform(0.1, 1.5, (B, T, N, L)).astype(np.float32))  # fmt: skip
    if delta:
        arrays["beta"] = rng.uniform(0.05, 0.95, (B, T, N)).astype(np.float32)
    scale = H**-0.5

    def run(form, a):
        common = dict(form=form, chunk_size=z["chunk"], scale=scale, return_state=True)
        if delta:
            out, state = attn.log_linear_delta_rule(a["q"], a["k"], a["v"], a["beta"], a["lam"],
                                                    log_gates=a["log_a"], **common)  # fmt: skip
        else:
            out, state = attn.log_linear_attention(a["q"], a["k"], a["v"], a["log_a"], a["lam"],
                                                   **common)  # fmt: skip
        return out, state.levels

    def oracle(a):
        if delta:
            args = (a["q"], a["k"], a["v"], a["beta"], a["lam"], a["log_a"])
            return ref_linear().log_linear_delta_rule(*args, scale=scale)
        return ref_linear().log_linear_attention(
            a["q"], a["k"], a["v"], a["log_a"], a["lam"], scale=scale
        )

    diff = ("q", "k", "v", "log_a", "lam") + (("beta",) if delta else ())
    return Case(name, arrays, ("q", "k", "v"), diff, run, oracle)


def _path(dry_run: bool) -> Case:
    import attn

    z = SIZES[dry_run]
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    rng = _rng("path/fox")
    arrays = dict(q=_normal(rng, (B, T, N, H)), k=_normal(rng, (B, T, K, H)),
                  v=_normal(rng, (B, T, K, H)), w=_unit(rng, (B, T, K, H)),
                  beta=rng.uniform(0.05, 1.9, (B, T, K)).astype(np.float32),
                  log_forget=-rng.uniform(0.0, 0.5, (B, T, N)).astype(np.float32))  # fmt: skip
    scale = H**-0.5

    def run(form, a):
        return attn.path_attention(a["q"], a["k"], a["v"], a["w"], a["beta"], form=form,
                                   block_size=z["chunk"], log_forget=a["log_forget"],
                                   scale=scale)  # fmt: skip

    def oracle(a):
        args = (a["q"], a["k"], a["v"], a["w"], a["beta"], a["log_forget"])
        return ref_softmax().path_attention(*args, scale=scale)

    return Case("path/fox", arrays, ("q", "k", "v", "w"),
                ("q", "k", "v", "w", "beta", "log_forget"), run, oracle)  # fmt: skip


# name -> (family, what the case holds, builder(dry_run))
CASES = {
    "softmax/causal-gqa": ("softmax", "causal, GQA", functools.partial(_softmax, "causal-gqa")),
    "softmax/streaming": ("softmax", "causal, sliding window or initial tokens, GQA",
                          functools.partial(_softmax, "streaming")),
    "softmax/sinks-softcap": ("softmax", "causal, GQA, sinks, soft-cap",
                              functools.partial(_softmax, "sinks-softcap")),
    "softmax/segments": ("softmax", "causal, GQA, packed segments and padding",
                         functools.partial(_softmax, "segments")),
    "linear/gated": ("linear attention", "elu+1, gates, GQA", _linear),
    "delta/gated": ("Gated DeltaNet", "head gates, grouped values", functools.partial(
        _delta, "gated")),
    "delta/kda": ("KDA", "channel gates, grouped values", functools.partial(_delta, "kda")),
    "delta/plain": ("DeltaNet", "no gates, grouped values", functools.partial(_delta, "plain")),
    "product/gated": ("DeltaProduct", "2 steps, head gates", functools.partial(
        _delta, "product")),
    "ssd/mamba2": ("Mamba-2 SSD", "2 groups, D skip", _ssd),
    "moba/causal": ("MoBA", "causal, GQA", _moba),
    "nsa/causal": ("NSA", "causal, GQA", _nsa),
    "dsa/causal": ("DSA", "causal, GQA", _dsa),
    "decode/causal": ("decode", "2 queries, causal, rows of their own lengths", _decode),
    "dplr/rwkv7": ("DPLR (RWKV-7)", "a = -kappa, b = kappa a_in, grouped values", _dplr),
    "path/fox": ("PaTH", "FoX gates, causal, GQA", _path),
    "log-linear/mamba2": ("log-linear Mamba-2", "clamped levels, grouped values",
                          functools.partial(_log_linear, "mamba2")),
    "log-linear/gdn": ("log-linear Gated DeltaNet", "clamped levels, head gates",
                       functools.partial(_log_linear, "gdn")),
}  # fmt: skip


@functools.cache
def build_case(name: str, dry_run: bool) -> Case:
    """The case ``name`` at the dry run's or the device's shapes (built once per process)."""
    return CASES[name][2](dry_run)
