"""The device run's training phase: one training step of the language-model comparison's models.

Each item is one variant of ``configs/compare_lm.py`` at its GPU scale
(``compare_lm.GPU``, what ``--scale gpu`` trains: width 512, 8 heads of 64, 8
layers, T = 1024 bytes, batch 32 sequences: 32,768 tokens a step; the step
times measured here are what that scale's predicted time should be checked
against), computing in bfloat16 with float32 parameters
(``ModelConfig(dtype="bfloat16")``), trained by the comparison's own optimizer
(AdamW with clipping, ``train.optimizer``). The comparison's other sizes scale
with the width: the window stays T/4, MLA's latent rank width/2 and its RoPE
key half a head; the kv heads of GQA (2), the initial tokens (4), the chunk (64)
and every preset's own sizes stay the config's. The SwiGLU width is matched to
MHA's parameter count at MLP width 4 D (``match_params="mha"``, as the
comparison does it; every variant within 0.1%: about 33.7M parameters).

What is timed is the project's own step, ``train.steps.make_train_step`` (the
jitted update ``train.loop.train`` runs), traced, compiled ahead of time, then
run on its own output state (as the loop runs it) after a warm-up: the best of
``ctx.repeats`` steps (fewer once a second was spent). The batch is random bytes
(the step's cost does not depend on them).

Model FLOPs per step (``model_flops``, the MFU's numerator; PaLM's definition
with causal attention): ``6 x matmul parameters x tokens`` (every parameter but
the embedding lookup, plus the output head's ``D x V``: with tied embeddings the
parameter count itself) plus the softmax-family layers' own score and value
products, ``3 x 2 N (H + E)`` per (query, key) pair the mask lets a query see
(causal: T(T+1)/2 per sequence; windows, initial tokens and MoBA's ``top_k``
blocks counted as read), plus MoBA's gate (its block scores, forward only). The
fixed-state layers' own chunkwise products (linear attention, the delta rule,
SSD) are not counted: at C = 64 and these head dims they are 1-7% of the traced
step's matmul FLOPs (Mamba-2 1%, linear 3%, Based 4%, Gated DeltaNet 7%).
XLA's cost analysis of the compiled step is recorded beside it (``xla_flops``:
it counts what runs, the optimizer's elementwise work and masked-out scores
included, a while loop's body once, a fused kernel's work as the backend knows
it).

The traced step also tells what computes in what dtype: ``dot_flops`` sums the
matmuls of the step's jaxpr (``dot_general``; a scan's body times its length, a
while loop's once) by their operands' dtypes, and ``kernels`` lists the fused
kernels (``pallas_call``, cuDNN's attention; their products are not in
``dot_flops``) with their operands' dtypes. Under ``dtype="bfloat16"`` the
projections and MLPs are bf16; float32 by design are the output head (float32
logits) and the fixed-state kinds' forms (``attn.linear``: float32 inputs and
states), and on XLA's blockwise path (CPU) the queries when the logit scale is
no power of two (MLA's 1/sqrt(96): ``attn.softmax.tiles``).
"""

from __future__ import annotations

import dataclasses
import math
import time

from bench._device_common import best_seconds, program_bytes
from configs import compare_lm
from train.budget import attention_flops, model_flops, visible_keys  # noqa: F401 (the tests')

TITLE = "Training steps of the language-model comparison's models"
WEIGHT = 0.18  # about 80 s of the 450 s budget

# The most informative first (a budget cut drops the tail): the baseline, the two best
# in the committed run (both fixed states with their own kernels' work), FoX (softmax
# with a score modifier: Pallas on a GPU), MLA (H != E: Pallas), MoBA (sparse), the
# plain linear state, then the rest, the 2025 families last.
VARIANTS = (
    "mha",
    "gated_deltanet",
    "mamba2",
    "fox",
    "mla",
    "moba",
    "linear",
    "gqa",
    "streaming",
    "alibi",
    "based",
    "hybrid",
    "rwkv7",
    "path",
    "log_linear_mamba2",
    "log_linear_gated_deltanet",
)

# The sizes: the comparison's model at a GPU size, and a tiny one for the dry run.
GPU = compare_lm.GPU  # the comparison's own GPU scale (--scale gpu)
DRY = dict(width=32, num_heads=4, num_layers=2, seq_len=32, batch=2, window=8,
           kv_rank=16, rope_head_dim=4, chunk_size=16)  # fmt: skip
DTYPE = "bfloat16"
# Primitives that are one fused kernel in the jaxpr (their operand dtypes are listed).
KERNELS = ("pallas_call", "cudnn", "dot_product_attention", "custom_call", "custom_partitioning")
# The dry run checks the script, not the speed: XLA:CPU's cheaper compile (about 40% less).
DRY_COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


def sizes(dry_run: bool) -> dict:
    return DRY if dry_run else GPU


def items(dry_run: bool) -> list[dict]:
    """One item per variant, most informative first."""
    return [{"name": v, "variant": v} for v in VARIANTS]


# ----------------------------------------------------------------------------
# The run config and its FLOPs.


def run_config(variant: str, size: dict):
    """The ``TrainConfig`` of ``variant`` at ``size``: ``configs/compare_lm.py``'s comparison
    (its optimizer, matched parameters and presets) with the sizes replaced, in bf16."""
    from train import variants

    compare = dataclasses.replace(
        compare_lm.at_size(compare_lm.get_config(), size, DTYPE),
        variants=(variant,),  # only this variant is matched (each match traces 3 models)
        test_lengths=(),
    )
    config = variants.run_config(compare, variant, compare.lrs[0], 0)
    return config.with_task_vocab()


# ----------------------------------------------------------------------------
# What the traced step computes in which dtype.


def _sub_jaxprs(eqn):
    """``(jaxpr, times)`` of each jaxpr inside ``eqn`` (a scan's body: its length; a cond's
    every branch). Duck-typed: a ``Jaxpr`` has ``eqns``, a ``ClosedJaxpr`` a ``jaxpr``."""
    times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if hasattr(v, "eqns"):
                yield v, times
            elif hasattr(getattr(v, "jaxpr", None), "eqns"):
                yield v.jaxpr, times


def dtype_census(jaxpr, times: int = 1, dots=None, kernels=None) -> tuple[dict, dict]:
    """``(dot_flops, kernels)``: matmul FLOPs by operand dtypes (``"bfloat16 x bfloat16"``)
    and the fused kernels' operand dtypes, over ``jaxpr`` and the jaxprs inside it."""
    dots = {} if dots is None else dots
    kernels = {} if kernels is None else kernels
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            lhs, rhs = (v.aval for v in eqn.invars)
            (contract, _), _ = eqn.params["dimension_numbers"]
            k = math.prod(lhs.shape[d] for d in contract)
            out = math.prod(eqn.outvars[0].aval.shape)
            key = f"{lhs.dtype} x {rhs.dtype}"
            dots[key] = dots.get(key, 0) + 2 * out * k * times
            continue
        if any(k in name for k in KERNELS):
            floats = sorted({str(v.aval.dtype) for v in eqn.invars if "float" in str(v.aval.dtype)})
            kernels.setdefault(name, set()).update(floats)
            continue
        for sub, n in _sub_jaxprs(eqn):
            dtype_census(sub, times * n, dots, kernels)
    return dots, kernels


# ----------------------------------------------------------------------------
# One item.


def _cost_flops(compiled) -> float | None:
    """XLA's FLOP count of a compiled program (a dict, or a list of one in older jax)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # a backend without a cost model
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    return None if not cost or "flops" not in cost else float(cost["flops"])


def _compile(lowered, dry_run: bool):
    if dry_run:
        try:
            return lowered.compile(compiler_options=DRY_COMPILER_OPTIONS)
        except Exception:  # options this XLA does not take: its full compile
            pass
    return lowered.compile()


def run_item(item: dict, ctx) -> dict:
    import jax
    import numpy as np

    from train.steps import count_params, init_state, make_train_step

    if ctx.left() <= 0:
        return {"status": "not measured: time budget"}
    size = sizes(ctx.dry_run)
    T, B = size["seq_len"], size["batch"]
    config = run_config(item["variant"], size)
    model, optimizer = init_state(config, config.model.vocab_size)
    params = count_params(model)
    if ctx.left() <= 0:  # the step's compile is the long part: not started past the deadline
        return {"status": "not measured: time budget"}
    step, leaves = make_train_step(None, model, optimizer)
    rng = np.random.default_rng(0)
    data = rng.integers(0, config.model.vocab_size, size=(B, T + 1))
    batch = {
        "tokens": jax.numpy.asarray(data[:, :-1], np.int32),
        "labels": jax.numpy.asarray(data[:, 1:], np.int32),
        "weights": jax.numpy.ones((B, T), np.float32),
    }

    start = time.perf_counter()
    traced = step.update.trace(leaves, batch)
    compiled = _compile(traced.lower(), ctx.dry_run)
    compile_seconds = time.perf_counter() - start
    dots, kernels = dtype_census(traced.jaxpr.jaxpr)

    state = {"leaves": leaves}

    def run():
        state["leaves"], out = compiled(state["leaves"], batch)
        jax.block_until_ready((state["leaves"], out))
        state["out"] = out

    # Past the deadline (a long compile): one timed step, so the compile is not wasted.
    repeats = ctx.repeats if ctx.left() > 0 else 1
    seconds = best_seconds(run, repeats, max_seconds=1.0)
    flops = model_flops(config.model, params, T, B)
    tflops = flops["flops"] / seconds / 1e12
    dot_total = sum(dots.values())
    bf16 = sum(v for k, v in dots.items() if k == "bfloat16 x bfloat16")
    return {
        "status": "ok",
        "params": params,
        "mlp_width": config.model.mlp_width,
        "layers": [layer.kind for layer in config.model.layers],
        "tokens": B * T,
        "ms": seconds * 1e3,
        "tokens_per_s": B * T / seconds,
        "model_flops": flops["flops"],
        "attention_flops": flops["attention_flops"],
        "xla_flops": _cost_flops(compiled),
        "tflops": tflops,
        "mfu_peak": tflops / ctx.peak_tflops if ctx.peak_tflops else None,
        "mfu_matmul": tflops / ctx.matmul_tflops if ctx.matmul_tflops else None,
        "program_bytes": program_bytes(compiled),
        "compile_seconds": compile_seconds,
        "loss": float(state["out"]["loss"]),
        "grad_norm": float(state["out"]["grad_norm"]),
        "dot_flops": dots,
        "bf16_dot_share": bf16 / dot_total if dot_total else None,
        "kernels": {k: sorted(v) for k, v in kernels.items()},
    }


# ----------------------------------------------------------------------------
# The report.


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(rows: list[dict], info: dict) -> str:
    size = sizes(info.get("dry_run", False))
    ok = [r for r in rows if r.get("status") == "ok"]
    peak = info.get("peak_tflops")
    lines = [
        f"One jitted training step (`train.steps.make_train_step`, the comparison's AdamW) of "
        f"each `configs/compare_lm.py` variant at width {size['width']}, "
        f"{size['num_layers']} layers, {size['num_heads']} heads of "
        f"{size['width'] // size['num_heads']}, T = {size['seq_len']}, batch {size['batch']} "
        f"({size['seq_len'] * size['batch']:,} tokens a step), bf16 compute with float32 "
        "parameters; SwiGLU widths matched to MHA's parameters. Best step after a warm-up. "
        "Model FLOPs: 6 x (parameters, the tied head's matmul included) x tokens + the "
        "softmax layers' causal score and value products (fixed-state layers' own not "
        "counted); MFU against the data sheet's bf16 peak"
        + (f" ({peak:.0f} TFLOP/s)" if peak else "")
        + f" and the measured bf16 matmul rate ({info.get('matmul_tflops', 0):.3g} TFLOP/s). "
        "Memory: the compiled step's buffers (arguments, outputs, temporaries).",
        "",
        "| variant | params | tokens/s | TFLOP/s | MFU vs peak | MFU vs matmul | ms/step | "
        "memory (MiB) | bf16 matmuls |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in ok:
        mem = r.get("program_bytes")
        lines.append(
            f"| {r['name']} | {r['params'] / 1e6:.2f}M | {r['tokens_per_s']:,.0f} | "
            f"{r['tflops']:.3g} | {_pct(r.get('mfu_peak'))} | {_pct(r.get('mfu_matmul'))} | "
            f"{r['ms']:.2f} | {'-' if mem is None else f'{mem / 2**20:,.0f}'} | "
            f"{_pct(r.get('bf16_dot_share'))} |"
        )
    kernels = sorted({f"{k} ({', '.join(v)})" for r in ok for k, v in r.get("kernels", {}).items()})
    lines += [
        "",
        "bf16 matmuls: the share of the traced step's matmul FLOPs (`dot_general`, fused "
        "kernels apart) with bf16 operands; the rest is float32 by design: the output head "
        "(float32 logits) and the fixed-state kinds' chunkwise forms (float32 states). "
        "Memory counts the state twice (the step donates nothing: inputs and outputs)."
        + (f" Fused kernels: {', '.join(kernels)}." if kernels else ""),
    ]
    return "\n".join(lines) + "\n"
