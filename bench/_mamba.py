"""Mamba-2's SSD in ``bench/linear.py --family mamba2``.

At B=1, N=8 heads of dim E=64, state dim H=64, one group of B and C, float32,
chunks of 64:

1. Forward and forward + backward time against T (1K to 16K) of ``attn.ssd``'s
   chunkwise, recurrent and quadratic forms (the quadratic one while its
   ``[T, T]`` matrices fit), beside gated linear attention's chunkwise form at
   the same shapes (``attn.linear_attention``: identity features, no
   normalizer, one gate per head): SSD is that form (the state-space duality),
   plus the ``dt`` scaling and the ``D`` skip, so the two should be close.
2. Forward + backward temporary memory of the compiled programs.
3. Decode: ``ssd_step`` tokens per second (64 steps per call).
4. Float32 against the library's float64 recurrence of the paper's equations
   (``attn.linear.reference.ssd``) at T = 1000, decays in (0, 1] and in (-1, 1].
5. Achieved FLOP/s beside the machine's jitted float32 matmul rate.
"""

from __future__ import annotations

import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from attn.linear import linear_attention, reference, ssd, ssd_step
from bench import _delta
from bench._delta import oracle_and_target_lines, plot_lengths, rel, with_grads

LENGTHS = (1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (1024, 2048)
ORACLE_T = 1000
QUADRATIC_MAX_T = 4096  # [N, T, T] float32 matrices, forward and backward: 512 MiB at 4K
STATE_DIM = 64

METHODS = ("ssd chunkwise", "ssd recurrent", "ssd quadratic", "gla chunkwise")


def ssd_inputs(B, T, N, E, H, seed=0):
    """x ``[B,T,N,E]``, dt ``[B,T,N]``, A ``[N]``, B and C ``[B,T,1,H]``, D ``[N]``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, N, E)).astype(np.float32)
    dt = np.log1p(np.exp(rng.standard_normal((B, T, N)) - 3)).astype(np.float32)  # softplus
    A = -rng.uniform(1.0, 16.0, (N,)).astype(np.float32)
    b, c = (rng.standard_normal((B, T, 1, H)).astype(np.float32) / np.sqrt(H) for _ in range(2))
    D = np.ones((N,), np.float32)
    return tuple(jnp.asarray(a) for a in (x, dt, A, b, c, D))


def method_fn(name: str, chunk_size: int):
    """``fn(x, dt, A, B, C, D) -> y`` for one method."""
    family, form = name.split()
    if family == "ssd":
        return partial(_ssd, form=form, chunk_size=chunk_size)

    def gla(x, dt, A, b, c, D):  # the same state and matmuls, per-head q and k
        N = x.shape[2]
        q, k = (jnp.broadcast_to(m, (*m.shape[:2], N, m.shape[-1])) for m in (c, b))
        return linear_attention(
            q, k, x, feature_map="identity", normalize=False, log_gates=dt * A,
            form=form, chunk_size=chunk_size, scale=1.0,
        )  # fmt: skip

    return gla


def _ssd(x, dt, A, b, c, D, form, chunk_size):
    return ssd(x, dt, A, b, c, D=D, form=form, chunk_size=chunk_size)


def fwd_bwd(fn):
    """Gradients of ``sum(y^2)`` with respect to x, dt, A, B, C and D."""
    return jax.grad(lambda *xs: jnp.sum(fn(*xs) ** 2), argnums=tuple(range(6)))


def vs_length(cfg, lengths, best_times, skip_reason) -> dict:
    """Every method's times and memory against T (``bench/_delta.time_methods``)."""

    def skip(name, kind, T, done):
        if "quadratic" in name and T > QUADRATIC_MAX_T:
            return f"T > {QUADRATIC_MAX_T}: [N, T, T] matrices"
        return skip_reason(name, kind, T, done)

    args_at = partial(ssd_inputs, cfg.batch, N=cfg.heads, E=cfg.head_dim, H=STATE_DIM)
    fns = {name: method_fn(name, cfg.chunk_size) for name in METHODS}
    return _delta.time_methods(cfg, lengths, best_times, skip, fns, args_at, fwd_bwd)


def decode_rate(cfg, best_times) -> float:
    """``ssd_step`` tokens per second (``decode_steps`` steps per call)."""
    B, N, E, steps = cfg.batch, cfg.heads, cfg.head_dim, cfg.decode_steps
    x, dt, A, b, c, D = ssd_inputs(steps, B, N, E, STATE_DIM, seed=3)  # [steps, B, ...]
    state = jnp.zeros((B, N, STATE_DIM, E), jnp.float32)

    def decode(state, x, dt, b, c):
        def one(h, xs):
            y, h = ssd_step(h, xs[0], xs[1], A, xs[2], xs[3], D=D)
            return h, y

        return jax.lax.scan(one, state, (x, dt, b, c))

    seconds = best_times({"ssd": (decode, (state, x, dt, b, c))}, cfg.repeats)["ssd"]
    return steps / seconds


def _reference(x, dt, A, b, c, D, h, negative):
    """The library's float64 reference (``attn.linear.reference.ssd``) from the state h."""
    return reference.ssd(x, dt, A, b, c, D, initial_state=h, negative_eigenvalues=negative)


def oracle_errors(T: int = ORACLE_T) -> dict:
    """Relative errors of every form against a float64 recurrence at T, both decay ranges."""
    B, N, E, H = 1, 4, 16, 16
    args = ssd_inputs(B, T, N, E, H, seed=5)
    h0 = jnp.asarray(np.random.default_rng(6).standard_normal((B, N, H, E)), jnp.float32)

    errors = {}
    for negative in (False, True):
        with jax.enable_x64(True):
            x64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in (*args, h0)]
            ref = partial(_reference, negative=negative)
            want, want_grads = jax.tree.map(np.asarray, with_grads(ref, 7)(*x64))
        for form in ("chunkwise", "recurrent", "quadratic"):

            def ours(x, dt, A, b, c, D, h, form=form, negative=negative):
                return ssd(
                    x, dt, A, b, c, D=D, form=form, initial_state=h, return_state=True,
                    negative_eigenvalues=negative,
                )  # fmt: skip

            got, grads = with_grads(ours, 7)(*args, h0)
            errors[f"{'(-1, 1]' if negative else '(0, 1]'} {form}"] = {
                "output": rel(got[0], want[0]),
                "state": rel(got[1], want[1]),
                "gradients_max": max(rel(a, b) for a, b in zip(grads, want_grads, strict=True)),
            }
    return errors


def skip_exponent(name: str) -> int:
    """How a method's time grows with T: the quadratic form's as T^2, the others' as T."""
    return 2 if "quadratic" in name else 1


def run(cfg, best_times, quick: bool) -> dict:
    """``bench/_delta.py``'s measurements, of this family's methods."""
    return _delta.run(cfg, best_times, quick, family=sys.modules[__name__])


def targets(result: dict) -> dict:
    L = result["lengths"]

    def ratio(kind, a, b, T):
        x, y = L[kind][a].get(T), L[kind][b].get(T)
        return None if x is None or y is None else x / y

    at = 4096
    checks = {
        "ssd_over_gla_forward_at_4k": (ratio("forward", "ssd chunkwise", "gla chunkwise", at), 1.5),
        "ssd_over_gla_fwd_bwd_at_4k": (
            ratio("forward_backward", "ssd chunkwise", "gla chunkwise", at),
            1.5,
        ),
        "oracle_output_and_state_error": (
            max((max(e["output"], e["state"]) for e in result["oracle"].values()), default=None),
            1e-5,
        ),
        "oracle_gradient_error": (
            max((e["gradients_max"] for e in result["oracle"].values()), default=None),
            1e-4,
        ),
    }
    return {
        name: {"value": v, "target": f"<= {bound:g}", "met": None if v is None else v <= bound}
        for name, (v, bound) in checks.items()
    }


def markdown(result: dict) -> str:
    cfg, env, d = result["config"], result["env"], result["mamba2"]
    L = d["lengths"]
    rate = d["matmul_flops_per_s"]
    lines = [
        f"# Mamba-2's SSD ({env['devices']}, jax {env['jax']})",
        "",
        f"B={cfg['batch']}, N={cfg['heads']} heads of E={cfg['head_dim']}, state H={STATE_DIM}, "
        f"one group, float32, chunk {cfg['chunk_size']}; best of at least {cfg['repeats']} runs "
        f"after warm-up. {env['cpu_count']} CPU cores; load average "
        f"{env['load_average_at_start'][0]:.1f} at start, {env['load_average_at_end'][0]:.1f} at "
        f"end. Jitted float32 matmul: {rate / 1e9:.1f} GFLOP/s.",
    ]
    for kind, title in (("forward", "Forward"), ("forward_backward", "Forward + backward")):
        lines += ["", f"{title}, ms:", "", "| T | " + " | ".join(METHODS) + " | ssd / gla |"]
        lines.append("|---:|" + "---:|" * (len(METHODS) + 1))
        for T in sorted({T for by in L[kind].values() for T in by}):
            cells = [L[kind][n].get(T) for n in METHODS]
            shown = ["skipped" if s is None else f"{s * 1e3:.1f}" for s in cells]
            a, b = L[kind]["ssd chunkwise"].get(T), L[kind]["gla chunkwise"].get(T)
            ratio = "-" if a is None or b is None else f"{a / b:.2f}x"
            lines.append(f"| {T} | " + " | ".join(shown) + f" | {ratio} |")
    lines += [
        "",
        "Forward + backward temporary memory (MiB) and achieved GFLOP/s (XLA's flop count "
        "over the time; none counted inside a scan):",
        "",
        "| T | " + " | ".join(METHODS) + " |",
        "|---:|" + "---:|" * len(METHODS),
    ]
    for T in sorted({T for by in L["temp_bytes"].values() for T in by}):
        cells = []
        for name in METHODS:
            b, f, s = (L[k][name].get(T) for k in ("temp_bytes", "flops", "forward_backward"))
            speed = "" if not f or not s or "recurrent" in name else f", {f / s / 1e9:.1f}"
            cells.append("-" if b is None else f"{b / 2**20:.0f}{speed}")
        lines.append(f"| {T} | " + " | ".join(cells) + " |")
    lines += ["", f"Decode (`ssd_step`): {d['decode_tokens_per_s']:,.0f} tokens/s."]
    lines += [
        "",
        f"Float32 against a float64 recurrence at T={d['oracle_T']} (N=4, E=H=16, an initial "
        "state; relative norm-wise errors):",
        "",
        "| decay, form | output | state | worst gradient |",
        "|---|---:|---:|---:|",
    ]
    return "\n".join(lines + oracle_and_target_lines(d)) + "\n"


def plot(result: dict, path) -> None:
    kinds = (
        ("forward", "forward time (s), lower is better"),
        ("forward_backward", "forward + backward time (s)"),
    )
    plot_lengths(result["mamba2"]["lengths"], kinds, path)
