"""The delta-rule family in ``bench/linear.py --family delta``.

At B=1, N=8 heads, H=E=64, float32, chunks of 64, unit-norm q and k:

1. Forward and forward + backward time against T (1K to 16K) of
   ``attn.delta_rule``'s chunkwise form for DeltaNet (no gate), Gated DeltaNet
   (a gate per head) and KDA (a gate per key channel), its recurrent form for
   Gated DeltaNet, and gated linear attention's chunkwise form at the same
   shapes (``attn.linear_attention``, identity features, no normalizer, the
   same per-head gates): the peer with the same state and the same matmuls
   minus the delta rule's triangular inverse.
2. Forward + backward temporary memory (XLA's buffer assignment of the
   compiled program, ``memory_analysis().temp_size_in_bytes``) at each T.
3. Decode: ``delta_rule_step`` tokens per second (64 steps per call).
4. Float32 errors against a float64 recurrence (``lax.scan`` of the
   equations, ``jax.grad`` of it for the gradients) at T = 1000.
5. Achieved FLOP/s (XLA's cost analysis of each program over its time)
   beside the machine's jitted float32 matmul rate.
"""

from __future__ import annotations

import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from attn.linear import delta_rule, delta_rule_step, linear_attention
from attn.linear.reference import delta_rule as delta_reference

LENGTHS = (1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (1024, 2048)
ORACLE_T = 1000  # a multiple of no chunk size
MATMUL_N = 1024

METHODS = {  # name -> (delta gate or "gla", form)
    "gated_deltanet chunkwise": ("head", "chunkwise"),
    "gated_deltanet recurrent": ("head", "recurrent"),
    "deltanet chunkwise": ("none", "chunkwise"),
    "kda chunkwise": ("channel", "chunkwise"),
    "gla chunkwise": ("gla", "chunkwise"),
}


def delta_inputs(B, T, N, H, seed=0):
    """q, k (unit norm), v, beta, per-head and per-channel log gates."""
    rng = np.random.default_rng(seed)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q, k = (unit(rng.standard_normal((B, T, N, H))).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, T, N, H)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (B, T, N)).astype(np.float32)
    g_head = -rng.uniform(0.0, 0.1, (B, T, N)).astype(np.float32)
    g_channel = -rng.uniform(0.0, 0.1, (B, T, N, H)).astype(np.float32)
    return tuple(jnp.asarray(x) for x in (q, k, v, beta, g_head, g_channel))


def method_fn(name: str, chunk_size: int):
    """``fn(q, k, v, beta, g_head, g_channel) -> out`` for one method."""
    gate, form = METHODS[name]
    if gate == "gla":
        gla = partial(linear_attention, feature_map="identity", normalize=False)

        def fn(q, k, v, beta, g_head, g_channel):
            return gla(q, k, v, log_gates=g_head, form=form, chunk_size=chunk_size)

        return fn

    def fn(q, k, v, beta, g_head, g_channel):
        g = {"none": None, "head": g_head, "channel": g_channel}[gate]
        return delta_rule(q, k, v, beta, log_gates=g, form=form, chunk_size=chunk_size)

    return fn


def fwd_bwd(fn):
    """Gradients of ``sum(out^2)`` with respect to q, k, v, beta and both gates."""
    return jax.grad(lambda *xs: jnp.sum(fn(*xs) ** 2), argnums=tuple(range(6)))


def compiled_stats(compiled) -> dict:
    """Temporary memory and XLA's FLOP count of a compiled program."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "flops": float(cost.get("flops", 0.0)) if cost else None,
    }


def matmul_rate(best_times) -> float:
    """FLOP/s of a jitted float32 ``[n, n] @ [n, n]`` matmul (every core)."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((MATMUL_N, MATMUL_N), np.float32))
    seconds = best_times({"matmul": (jnp.matmul, (a, a))}, 5)["matmul"]
    return 2 * MATMUL_N**3 / seconds


def vs_length(cfg, lengths, best_times, skip_reason) -> dict:
    """Forward and forward + backward seconds and memory per method and T."""
    methods = cfg.delta_methods or tuple(METHODS)
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"--delta-methods: expected names from {list(METHODS)}, got {unknown}")
    args_at = partial(delta_inputs, cfg.batch, N=cfg.heads, H=cfg.head_dim)
    fns = {name: method_fn(name, cfg.chunk_size) for name in methods}
    return time_methods(cfg, lengths, best_times, skip_reason, fns, args_at, fwd_bwd)


def time_methods(cfg, lengths, best_times, skip_reason, fns: dict, args_at, fwd_bwd) -> dict:
    """Forward and forward + backward seconds, temporary memory and XLA's flops of each
    method ``fns[name]`` at each T of ``lengths`` on ``args_at(T=T)``; ``skip_reason(name,
    kind, T, done)`` says where not (a row of ``"skipped"``)."""
    out = {"forward": {}, "forward_backward": {}, "temp_bytes": {}, "flops": {}, "skipped": {}}
    for kind in out:
        for name in fns:
            out[kind][name] = {}
    width = max(len(name) for name in fns)
    for T in lengths:
        args = args_at(T=T)
        for kind, wrap in (("forward", lambda f: f), ("forward_backward", fwd_bwd)):
            jobs = {}
            for name, fn in fns.items():
                why = skip_reason(name, kind, T, out[kind][name])
                if why:
                    out["skipped"][name][f"{kind} {T}"] = why
                    out[kind][name][T] = None
                    print(f"  {name:>{width}} {kind:>16} T={T:>6}: skipped ({why})", flush=True)
                    continue
                compiled = jax.jit(wrap(fn)).lower(*args).compile()
                jobs[name] = (compiled, args)  # compiled once: timed and analyzed
                if kind == "forward_backward":
                    stats = compiled_stats(compiled)
                    out["temp_bytes"][name][T] = stats["temp_bytes"]
                    out["flops"][name][T] = stats["flops"]
            for name, seconds in best_times(jobs, cfg.repeats).items():
                out[kind][name][T] = seconds
                print(f"  {name:>{width}} {kind:>16} T={T:>6}: {seconds * 1e3:9.2f} ms", flush=True)
    return out


def decode_rate(cfg, best_times) -> dict:
    """``delta_rule_step`` tokens per second, per gate kind (64 steps per call)."""
    B, N, H, steps = cfg.batch, cfg.heads, cfg.head_dim, cfg.decode_steps
    q, k, v, beta, g_head, g_channel = delta_inputs(steps, B, N, H, seed=3)  # [steps, B, ...]
    state = jnp.zeros((B, N, H, H), jnp.float32)

    def run(gates):
        def decode(state, q, k, v, beta, gates):
            def one(S, x):
                out, S = delta_rule_step(*x[:4], S, log_gates=x[4])
                return S, out

            return jax.lax.scan(one, state, (q, k, v, beta, gates))

        return decode, (state, q, k, v, beta, gates)

    jobs = {"gated_deltanet": run(g_head), "kda": run(g_channel)}
    best = best_times(jobs, cfg.repeats)
    return {name: steps / seconds for name, seconds in best.items()}


def rel(a, b) -> float:
    """Relative norm-wise error ``||a - b|| / ||b||`` in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def with_grads(f, num_args: int):
    """``(f(*xs), d sum(sin(f(*xs))) / d xs)``, jitted: one program, one compile."""

    def loss(*xs):
        out = f(*xs)
        return sum(jnp.sum(jnp.sin(y)) for y in out), out

    grad = jax.grad(loss, argnums=range(num_args), has_aux=True)
    return jax.jit(lambda *xs: grad(*xs)[::-1])


def oracle_errors(T: int = ORACLE_T) -> dict:
    """Relative errors of float32 chunkwise and recurrent against a float64 recurrence at T."""
    B, N, H = 1, 4, 32
    q, k, v, beta, g_head, g_channel = delta_inputs(B, T, N, H, seed=5)
    state = jnp.asarray(np.random.default_rng(6).standard_normal((B, N, H, H), np.float32))

    def reference(q, k, v, beta, g, state):
        return delta_reference(q, k, v, beta, g, initial_state=state)

    errors = {}
    for gate, g in (("head", g_head), ("channel", g_channel)):
        args = (q, k, v, beta, g, state)
        with jax.enable_x64(True):
            x64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in args]
            want, want_grads = jax.tree.map(np.asarray, with_grads(reference, 6)(*x64))
        for form in ("chunkwise", "recurrent"):

            def ours(q, k, v, beta, g, state, form=form):
                return delta_rule(
                    q, k, v, beta, log_gates=g, form=form, initial_state=state, return_state=True
                )

            got, grads = with_grads(ours, 6)(*args)
            errors[f"{gate} {form}"] = {
                "output": rel(got[0], want[0]),
                "state": rel(got[1], want[1]),
                "gradients_max": max(rel(a, b) for a, b in zip(grads, want_grads, strict=True)),
            }
    return errors


def projected_skip(done: dict, T: int, max_seconds: float, exponent: int = 1) -> str | None:
    """Why a method is not timed at T (None: it is), from its times at shorter lengths
    ``done {T: seconds or None}``: a shorter length was skipped, or the time projected
    as ``T ** exponent`` exceeds ``max_seconds``."""
    measured = [(t, s) for t, s in done.items() if s is not None]
    if any(s is None for s in done.values()):
        return "a shorter length was skipped"
    if measured:
        last_t, last_s = max(measured)
        projected = last_s * (T / last_t) ** exponent
        if projected > max_seconds:
            return f"projected {projected:.0f} s > {max_seconds:.0f} s"
    return None


def run(cfg, best_times, quick: bool, family=None) -> dict:
    """The family's measurements in one order: matmul rate, times against T, decode, oracle.

    ``family`` is the module holding the family's ``LENGTHS``, ``QUICK_LENGTHS``,
    ``ORACLE_T``, ``vs_length``, ``decode_rate``, ``oracle_errors``, ``targets``
    and ``skip_exponent(name)``; None: this one (the delta rule).
    """
    f = sys.modules[__name__] if family is None else family
    started = time.perf_counter()
    table = cfg.lengths or (f.QUICK_LENGTHS if quick else f.LENGTHS)
    lengths = tuple(T for T in table if cfg.max_len >= T)

    def skip_reason(name, kind, T, done):
        return projected_skip(done, T, cfg.max_seconds, f.skip_exponent(name))

    print("matmul rate:", flush=True)
    rate = matmul_rate(best_times)
    print(f"  {rate / 1e9:.1f} GFLOP/s", flush=True)
    print("times against T:", flush=True)
    result = {
        "matmul_flops_per_s": rate,
        "lengths": f.vs_length(cfg, lengths, best_times, skip_reason),
    }
    print("decode:", flush=True)
    result["decode_tokens_per_s"] = f.decode_rate(cfg, best_times)
    print("float64 oracle:", flush=True)
    # At most ORACLE_T; one past the longest length for a short sweep.
    result["oracle_T"] = min(f.ORACLE_T, max(lengths) + 1)
    result["oracle"] = f.oracle_errors(result["oracle_T"]) if cfg.oracle else {}
    result["targets"] = f.targets(result)
    result["wall_seconds"] = time.perf_counter() - started
    return result


def skip_exponent(name: str) -> int:
    """How a method's time grows with T (every delta-rule form is linear)."""
    del name
    return 1


def targets(result: dict) -> dict:
    L = result["lengths"]
    fb = L["forward_backward"]
    mem = L["temp_bytes"]

    def get(table, name, T):  # None where the method or the length was not measured
        return table.get(name, {}).get(T)

    def ratio(a, b):
        return None if a is None or b is None else a / b

    at = 4096
    gdn = "gated_deltanet chunkwise"
    checks = {
        "chunkwise_vs_recurrent_fwd_bwd_at_4k": (
            ratio(get(fb, "gated_deltanet recurrent", at), get(fb, gdn, at)),
            ">=",
            10.0,
        ),
        "chunkwise_over_gla_fwd_bwd_at_4k": (
            ratio(get(fb, gdn, at), get(fb, "gla chunkwise", at)),
            "<=",
            3.0,
        ),
        "fwd_bwd_memory_16k_over_4k": (ratio(get(mem, gdn, 16384), get(mem, gdn, at)), "<=", 4.5),
        "kda_fwd_bwd_memory_16k_over_4k": (
            ratio(get(mem, "kda chunkwise", 16384), get(mem, "kda chunkwise", at)),
            "<=",
            4.5,
        ),
        "oracle_output_and_state_error": (
            max((max(e["output"], e["state"]) for e in result["oracle"].values()), default=None),
            "<=",
            1e-5,
        ),
        "oracle_gradient_error": (
            max((e["gradients_max"] for e in result["oracle"].values()), default=None),
            "<=",
            1e-4,
        ),
    }
    out = {}
    for name, (value, op, bound) in checks.items():
        met = None if value is None else (value >= bound if op == ">=" else value <= bound)
        out[name] = {"value": value, "target": f"{op} {bound:g}", "met": met}
    return out


def markdown(result: dict) -> str:
    cfg, env, d = result["config"], result["env"], result["delta"]
    L = d["lengths"]
    rate = d["matmul_flops_per_s"]
    lines = [
        f"# The delta rule on CPU ({env['devices']}, jax {env['jax']})",
        "",
        f"B={cfg['batch']}, N={cfg['heads']}, H=E={cfg['head_dim']}, float32, chunk "
        f"{cfg['chunk_size']}; best of at least {cfg['repeats']} runs after warm-up. "
        f"{env['cpu_count']} CPU cores; 1-minute load average "
        f"{env['load_average_at_start'][0]:.1f} at start, {env['load_average_at_end'][0]:.1f} "
        f"at end. Jitted float32 matmul ({MATMUL_N}^3): {rate / 1e9:.1f} GFLOP/s.",
    ]
    for kind, title in (("forward", "Forward"), ("forward_backward", "Forward + backward")):
        names = list(L[kind])
        lines += [
            "",
            f"{title}, ms:",
            "",
            "| T | " + " | ".join(names) + " |",
            "|---:|" + "---:|" * len(names),
        ]
        for T in sorted({T for by in L[kind].values() for T in by}):
            cells = []
            for name in names:
                s = L[kind][name].get(T)
                cells.append("skipped" if s is None else f"{s * 1e3:.1f}")
            lines.append(f"| {T} | " + " | ".join(cells) + " |")
    names = [n for n in L["temp_bytes"] if L["temp_bytes"][n]]
    lines += [
        "",
        "Forward + backward: temporary memory of the compiled program (MiB), and "
        "achieved GFLOP/s (XLA's flop count over the time; XLA counts no flops inside a "
        "scan's body, so the recurrent form has none):",
        "",
        "| T | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for T in sorted({T for by in L["temp_bytes"].values() for T in by}):
        cells = []
        for name in names:
            b, f, s = (L[k][name].get(T) for k in ("temp_bytes", "flops", "forward_backward"))
            speed = "" if not f or not s or "recurrent" in name else f", {f / s / 1e9:.1f}"
            cells.append("-" if b is None else f"{b / 2**20:.0f}{speed}")
        lines.append(f"| {T} | " + " | ".join(cells) + " |")
    dec = d["decode_tokens_per_s"]
    lines += [
        "",
        "Decode (`delta_rule_step`, state [B,N,H,E] float32): "
        + ", ".join(f"{n} {r:,.0f} tokens/s" for n, r in dec.items())
        + ".",
    ]
    lines += [
        "",
        f"Float32 against a float64 recurrence at T={d.get('oracle_T', ORACLE_T)} (N=4, H=E=32, a "
        "non-zero initial state; relative norm-wise errors):",
        "",
        "| case | output | state | worst gradient |",
        "|---|---:|---:|---:|",
    ]
    return "\n".join(lines + oracle_and_target_lines(d)) + "\n"


def oracle_and_target_lines(d: dict) -> list[str]:
    """The rows of the oracle table (under its header) and the targets' table."""
    lines = [
        f"| {name} | {e['output']:.1e} | {e['state']:.1e} | {e['gradients_max']:.1e} |"
        for name, e in d["oracle"].items()
    ]
    lines += ["", "| target | value | wanted | met |", "|---|---:|---:|---|"]
    for name, t in d["targets"].items():
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        lines.append(f"| {name} | {value} | {t['target']} | {t['met']} |")
    return lines


def plot(result: dict, path) -> None:
    kinds = (
        ("forward", "forward time (s)"),
        ("forward_backward", "forward + backward time (s)"),
        ("temp_bytes", "forward + backward temp memory (bytes)"),
    )
    plot_lengths(result["delta"]["lengths"], kinds, path)


def plot_lengths(L: dict, kinds, path) -> None:
    """One log-log panel per ``(kind, ylabel)`` of ``L[kind][method][T]``, a line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(kinds), figsize=(5.4 * len(kinds), 4.5))
    for ax, (kind, ylabel) in zip(axes, kinds, strict=True):
        for name, by_len in L[kind].items():
            points = sorted((T, s) for T, s in by_len.items() if s is not None)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set(yscale="log", xlabel="T (tokens)", ylabel=ylabel)
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
