"""Benchmark: the 2025 families against their nearest relatives' chunkwise forms.

Issue 56's rows. At B=1, N=8 heads, H=E=64, float32, chunks of 64, causal, T from
1K to 16K, forward and forward + backward (gradients of ``sum(out^2)`` with
respect to every input), each family beside its relative:

- RWKV-7's DPLR delta rule (``attn.dplr_delta_rule``, chunkwise; RWKV-7's
  ``a = -kappa_hat``, ``b = kappa_hat * a_in``, a decay per key channel) against
  KDA (``attn.delta_rule`` chunkwise with a gate per key channel, the closest
  relative): within 1.5x. Gated DeltaNet (a gate per head) is shown beside it.
- Log-linear Gated DeltaNet (``attn.log_linear_delta_rule``, chunkwise) against
  Gated DeltaNet's chunkwise form: within 1.5x.
- Log-linear Mamba-2 (``attn.log_linear_attention``, chunkwise) beside Mamba-2's
  SSD (``attn.ssd`` chunkwise, no ``D`` skip): no target, the ratio is shown.
- The trained memories against Gated DeltaNet's chunkwise form:
  TTT-Linear (``attn.ttt_linear``, dual form, mini-batches of 16) and MesaNet
  (``attn.mesa_net`` chunkwise, 8 CG steps) within 3x; TTT-MLP (dual, F = 4H)
  and Titans (``attn.titans``, an MLP memory, dual, mini-batches of 16) shown.
  ``--methods`` picks them (``bench/results/memories-cpu.md`` is that run).
- PaTH (``attn.path_attention(form="blockwise")``) against causal blockwise
  softmax (``attn.blockwise_attention``, its default tiles, no RoPE counted):
  within 3x. PaTH's block size is the fastest forward + backward among
  ``path_blocks`` at ``path_block_at`` (4K), measured first
  (``--no-path-fwd-bwd``: the fastest forward, and no forward + backward row).

The log-linear forms get ``T.bit_length()`` levels (every Fenwick level of T
tokens has a weight of its own). A target is met when the family's ratio to its
relative is within the bound at every measured length, for that kind (forward,
forward + backward).

Timing follows ``bench/linear.py``: compiled ahead of time, one warm-up run, then
the best of at least ``repeats`` interleaved runs (more for short ones); a
method whose run is projected from the previous length to exceed
``max_seconds`` is skipped (with every longer length). The load average is
recorded.

Writes ``<out_dir>/<name>.json``, ``.md`` (tables) and ``.png`` (log-log plots).

    python bench/families2025.py            # the full run (about 8 minutes on 2 cores)
    python bench/families2025.py --quick    # smoke test: 1K and 2K, "-quick" files
    python bench/families2025.py --methods "gated_deltanet chunkwise" "ttt_linear dual" \
        "mesanet cg8 chunkwise" "ttt_mlp dual" "titans mlp dual" --name memories-cpu
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from attn import masks  # noqa: E402
from attn.linear import delta_rule, ssd  # noqa: E402
from attn.linear.dplr import dplr_delta_rule  # noqa: E402
from attn.linear.log_linear import log_linear_attention, log_linear_delta_rule  # noqa: E402
from attn.linear.mesa import mesa_net  # noqa: E402
from attn.linear.titans import titans  # noqa: E402
from attn.linear.ttt import ttt_linear, ttt_mlp  # noqa: E402
from attn.softmax.blockwise import blockwise_attention  # noqa: E402
from attn.softmax.path import path_attention  # noqa: E402
from bench._delta import plot_lengths, projected_skip  # noqa: E402
from bench._report import write_report  # noqa: E402
from bench.linear import best_times, environment  # noqa: E402

LENGTHS = (1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (1024, 2048)

# name -> (family's method, relative's method, bound on the ratio or None: shown only)
PAIRS = {
    "rwkv7 / kda": ("rwkv7 dplr chunkwise", "kda chunkwise", 1.5),
    "rwkv7 / gated_deltanet": ("rwkv7 dplr chunkwise", "gated_deltanet chunkwise", None),
    "log_linear_gdn / gated_deltanet": (
        "log_linear_gdn chunkwise",
        "gated_deltanet chunkwise",
        1.5,
    ),
    "log_linear_mamba2 / ssd": ("log_linear_mamba2 chunkwise", "ssd chunkwise", None),
    "path / softmax": ("path blockwise", "softmax blockwise", 3.0),
    "ttt_linear / gated_deltanet": ("ttt_linear dual", "gated_deltanet chunkwise", 3.0),
    "mesanet_cg8 / gated_deltanet": ("mesanet cg8 chunkwise", "gated_deltanet chunkwise", 3.0),
    "ttt_mlp / gated_deltanet": ("ttt_mlp dual", "gated_deltanet chunkwise", None),
    "titans_mlp / gated_deltanet": ("titans mlp dual", "gated_deltanet chunkwise", None),
}
MEMORIES = ("gated_deltanet chunkwise", "ttt_linear dual", "mesanet cg8 chunkwise",
            "ttt_mlp dual", "titans mlp dual")  # fmt: skip
EXPONENT = {"path blockwise": 2, "softmax blockwise": 2}  # others: linear in T (near enough)


@dataclass(frozen=True)
class Config:
    """Benchmark settings (flags: --quick, --max-len, ...)."""

    max_len: int = 16384
    quick: bool = False  # smoke test: 1K and 2K, repeats=1
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    chunk_size: int = 64  # the linear forms' chunks (a power of 2: the log-linear forms)
    path_blocks: tuple[int, ...] = (32, 64, 128)  # PaTH block sizes tried at path_block_at
    path_block_at: int = 4096  # (at most the longest length measured)
    repeats: int = 3
    path_fwd_bwd: bool = True  # PaTH's forward + backward (False: its forward only)
    max_seconds: float = 12.0  # skip a method whose one run is projected to take longer
    out_dir: str = "bench/results"
    name: str = "families2025-cpu"
    lengths: tuple[int, ...] = ()  # the lengths to measure; () means the default table
    methods: tuple[str, ...] = ()  # names of method_fns' methods to measure; (): all


# ----------------------------------------------------------------------------
# Inputs and methods


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def method_inputs(cfg: Config, T: int, seed: int = 0) -> dict:
    """Each method's argument tuple at length T (float32 arrays)."""
    rng = np.random.default_rng(seed)
    B, N, H = cfg.batch, cfg.heads, cfg.head_dim
    shape = (B, T, N, H)

    def normal(*s):
        return rng.standard_normal(s).astype(np.float32)

    q, k = unit(normal(*shape)), unit(normal(*shape))
    v = normal(*shape)
    beta = rng.uniform(0.0, 1.0, (B, T, N)).astype(np.float32)
    g_head = -rng.uniform(0.0, 0.1, (B, T, N)).astype(np.float32)
    g_channel = -rng.uniform(0.0, 0.1, shape).astype(np.float32)
    kappa = unit(normal(*shape))  # RWKV-7's removal key, normalized
    a_in = rng.uniform(0.0, 1.0, shape).astype(np.float32)  # its in-context learning rate
    levels = rng.uniform(0.5, 1.5, (B, T, N, T.bit_length())).astype(np.float32)
    # Mamba-2: x, dt (softplus), A, and one group of B and C.
    x = normal(*shape)
    dt = np.log1p(np.exp(normal(B, T, N) - 3)).astype(np.float32)
    A = -rng.uniform(1.0, 16.0, (N,)).astype(np.float32)
    b_ssm, c_ssm = (normal(B, T, 1, H) / np.sqrt(H) for _ in range(2))
    # PaTH: unit directions, strengths in [0, 2].
    w = unit(normal(*shape))
    beta_path = rng.uniform(0.0, 2.0, (B, T, N)).astype(np.float32)
    qs, ks = normal(*shape), normal(*shape)
    # The trained memories: TTT's eta (the layer's base_lr sigmoid / H), Titans' gates,
    # MesaNet's input gates and regularizer.
    eta = (rng.uniform(0.0, 1.0, (B, T, N)) / H).astype(np.float32)
    momentum = np.log(rng.uniform(0.5, 0.95, (B, T, N))).astype(np.float32)
    decay = np.log1p(-rng.uniform(0.0, 0.1, (B, T, N))).astype(np.float32)
    lam = rng.uniform(0.5, 1.5, (N, H)).astype(np.float32)
    args = {
        "rwkv7 dplr chunkwise": (q, k, v, -kappa, kappa * a_in, g_channel),
        "kda chunkwise": (q, k, v, beta, g_channel),
        "gated_deltanet chunkwise": (q, k, v, beta, g_head),
        "log_linear_gdn chunkwise": (q, k, v, beta, levels, g_head),
        "ssd chunkwise": (x, dt, A, b_ssm, c_ssm),
        "log_linear_mamba2 chunkwise": (x, dt, A, b_ssm, c_ssm, levels),
        "path blockwise": (qs, ks, v, w, beta_path),
        "softmax blockwise": (qs, ks, v),
        "ttt_linear dual": (qs, ks, v, eta),
        "ttt_mlp dual": (qs, ks, v, 0.1 * eta),
        "titans mlp dual": (q, k, v, 0.1 * eta, momentum, decay),
        "mesanet cg8 chunkwise": (q, k, v, beta, g_head, lam),
    }
    return {name: tuple(jnp.asarray(a) for a in xs) for name, xs in args.items()}


def method_fns(chunk_size: int, path_block: int) -> dict:
    """``name -> fn(*method_inputs[name]) -> out``."""
    C = chunk_size

    def dplr(q, k, v, a, b, log_w):
        return dplr_delta_rule(q, k, v, a, b, log_w, chunk_size=C)

    def delta(q, k, v, beta, gates):
        return delta_rule(q, k, v, beta, log_gates=gates, chunk_size=C)

    def log_linear_gdn(q, k, v, beta, levels, gates):
        return log_linear_delta_rule(q, k, v, beta, levels, log_gates=gates, chunk_size=C)

    def mamba2(x, dt, A, b, c):
        return ssd(x, dt, A, b, c, chunk_size=C)

    def log_linear_mamba2(x, dt, A, b, c, levels):  # as ssd: C queries, B keys, dt x values
        N = x.shape[2]
        q, k = (jnp.broadcast_to(m, (*m.shape[:2], N, m.shape[-1])) for m in (c, b))
        return log_linear_attention(
            q, k, x * dt[..., None], dt * A, levels, chunk_size=C, scale=1.0
        )

    def path(q, k, v, w, beta):
        return path_attention(q, k, v, w, beta, form="blockwise", block_size=path_block)

    def trained(fn, **kw):  # a layer's inner model: LayerNorm, initial weights of 0.02
        def run(q, k, v, *gates):
            N, H = q.shape[2:]
            mlp = fn is ttt_mlp or kw.get("memory") == "mlp"
            shapes = [(N, H, 4 * H), (N, 4 * H), (N, 4 * H, H), (N, H)] if mlp else [
                (N, H, H), (N, H)]  # fmt: skip
            model = tuple(0.02 * jnp.ones(s) if len(s) == 3 else jnp.zeros(s) for s in shapes)
            norm = dict(norm_scale=jnp.ones((N, H)), norm_bias=jnp.zeros((N, H)))
            return fn(q, k, v, *gates, model=model, **norm, **kw)

        return run

    def mesa(q, k, v, beta, gates, lam):
        return mesa_net(q, k, v, beta, lam, log_gates=gates, cg_steps=8, chunk_size=C)

    return {
        "rwkv7 dplr chunkwise": dplr,
        "kda chunkwise": delta,
        "gated_deltanet chunkwise": delta,
        "log_linear_gdn chunkwise": log_linear_gdn,
        "ssd chunkwise": mamba2,
        "log_linear_mamba2 chunkwise": log_linear_mamba2,
        "path blockwise": path,
        "softmax blockwise": partial(blockwise_attention, mask=masks.causal()),
        "ttt_linear dual": trained(ttt_linear),
        "ttt_mlp dual": trained(ttt_mlp),
        "titans mlp dual": trained(titans, memory="mlp"),
        "mesanet cg8 chunkwise": mesa,
    }


def fwd_bwd(fn, num_args: int):
    """Gradients of ``sum(out^2)`` with respect to every input."""
    return jax.grad(lambda *xs: jnp.sum(fn(*xs) ** 2), argnums=tuple(range(num_args)))


KINDS = (("forward", lambda fn, n: fn), ("forward_backward", fwd_bwd))


# ----------------------------------------------------------------------------
# Measurements


def choose_path_block(cfg: Config, T: int) -> dict:
    """PaTH's forward and forward + backward seconds per block size at T; the block size
    of the fastest forward + backward (of the fastest forward without ``path_fwd_bwd``)."""
    args = method_inputs(cfg, T)["path blockwise"]
    times = {}
    for kind, wrap in KINDS[: 2 if cfg.path_fwd_bwd else 1]:
        jobs = {}
        for block in cfg.path_blocks:
            fn = method_fns(cfg.chunk_size, block)["path blockwise"]
            jobs[block] = (wrap(fn, len(args)), args)
        times[kind] = best_times(jobs, cfg.repeats)
        for block, seconds in times[kind].items():
            print(f"  PaTH block {block:>4} {kind:>16} T={T}: {seconds * 1e3:9.2f} ms", flush=True)
    by = times["forward_backward" if cfg.path_fwd_bwd else "forward"]
    best = min(cfg.path_blocks, key=lambda b: by[b])
    print(f"  PaTH block size: {best}", flush=True)
    return {"T": T, "block_size": best, "seconds": times}


def vs_length(cfg: Config, lengths, path_block: int) -> dict:
    """Forward and forward + backward seconds per method and T (None: skipped)."""
    fns = method_fns(cfg.chunk_size, path_block)
    fns = {n: fn for n, fn in fns.items() if n in (cfg.methods or fns)}
    out = {"forward": {n: {} for n in fns}, "forward_backward": {n: {} for n in fns}}
    out["skipped"] = {n: {} for n in fns}
    width = max(len(n) for n in fns)
    for T in lengths:
        inputs = method_inputs(cfg, T)
        for kind, wrap in KINDS:
            jobs = {}
            for name, fn in fns.items():
                done = out[kind][name]
                why = projected_skip(done, T, cfg.max_seconds, EXPONENT.get(name, 1))
                if name == "path blockwise" and kind != "forward" and not cfg.path_fwd_bwd:
                    why = "not run: --no-path-fwd-bwd"
                if why:
                    out["skipped"][name][f"{kind} {T}"] = why
                    done[T] = None
                    print(f"  {name:>{width}} {kind:>16} T={T:>6}: skipped ({why})", flush=True)
                    continue
                jobs[name] = (wrap(fn, len(inputs[name])), inputs[name])
            for name, seconds in best_times(jobs, cfg.repeats).items():
                out[kind][name][T] = seconds
                print(f"  {name:>{width}} {kind:>16} T={T:>6}: {seconds * 1e3:9.2f} ms", flush=True)
    return out


def ratios(L: dict) -> dict:
    """Per pair and kind: the family's time over its relative's at each T, and the target."""
    out = {}
    for pair, (family, relative, bound) in PAIRS.items():
        if family not in L["forward"] or relative not in L["forward"]:
            continue  # not both measured
        out[pair] = {"family": family, "relative": relative, "bound": bound}
        for kind, _ in KINDS:
            by_t = {}
            for T, s in L[kind][family].items():
                r = L[kind][relative].get(T)
                by_t[T] = None if s is None or r is None else s / r
            measured = [x for x in by_t.values() if x is not None]
            worst = max(measured) if measured else None
            met = None if bound is None or worst is None else worst <= bound
            out[pair][kind] = {"ratio": by_t, "worst": worst, "met": met}
    return out


def main(cfg: Config) -> dict:
    table = cfg.lengths or (QUICK_LENGTHS if cfg.quick else LENGTHS)
    lengths = tuple(T for T in table if cfg.max_len >= T)
    if cfg.quick:
        cfg = dataclasses.replace(cfg, repeats=1, name=cfg.name + "-quick")
    started = time.perf_counter()
    result = {"config": dataclasses.asdict(cfg), "env": environment()}
    unknown = sorted(set(cfg.methods) - set(method_fns(1, 1)))
    if unknown:
        raise ValueError(f"--methods: expected names from {list(method_fns(1, 1))}, got {unknown}")
    at = min(cfg.path_block_at, max(lengths))
    if len(cfg.path_blocks) > 1 and "path blockwise" in (cfg.methods or ("path blockwise",)):
        print(f"PaTH's block size at T={at}:", flush=True)
        result["path_block"] = choose_path_block(cfg, at)
    else:  # nothing to choose from, or PaTH not measured
        result["path_block"] = {"T": None, "block_size": cfg.path_blocks[0], "seconds": {}}
    print("times against T:", flush=True)
    L = vs_length(cfg, lengths, result["path_block"]["block_size"])
    result["lengths"] = L
    result["ratios"] = ratios(L)
    result["wall_seconds"] = time.perf_counter() - started
    result["env"]["load_average_at_end"] = os.getloadavg()
    write_report(result, cfg.out_dir, cfg.name, markdown, plot)
    return result


# ----------------------------------------------------------------------------
# Report


def markdown(result: dict) -> str:
    cfg, env, L = result["config"], result["env"], result["lengths"]
    pb = result["path_block"]
    if pb["seconds"]:
        block_lines = [
            f"PaTH's block size: {pb['block_size']}, the fastest "
            f"{'forward + backward' if cfg['path_fwd_bwd'] else 'forward'} at "
            f"T={pb['T']} (ms):",
            "",
            "| block | forward | forward + backward |",
            "|---:|---:|---:|",
        ]
        for block in pb["seconds"]["forward"]:
            f = pb["seconds"]["forward"][block]
            fb = pb["seconds"].get("forward_backward", {}).get(block)
            block_lines.append(f"| {block} | {f * 1e3:.1f} | {fmt_ms(fb)} |")
    else:
        block_lines = [f"PaTH's block size: {pb['block_size']} (given)."]
    lines = [
        f"# The 2025 families beside their relatives on CPU ({env['devices']}, jax {env['jax']})",
        "",
        f"B={cfg['batch']}, N={cfg['heads']}, H=E={cfg['head_dim']}, float32, causal, chunk "
        f"{cfg['chunk_size']}; the log-linear forms with T.bit_length() levels; best of at least "
        f"{cfg['repeats']} interleaved runs after warm-up. {env['cpu_count']} CPU cores; "
        f"1-minute load average {env['load_average_at_start'][0]:.1f} at start, "
        f"{env['load_average_at_end'][0]:.1f} at end; {result['wall_seconds']:.0f} s in all.",
        "",
        *block_lines,
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
            cells = [fmt_ms(L[kind][n].get(T)) for n in names]
            lines.append(f"| {T} | " + " | ".join(cells) + " |")
    R = result["ratios"]
    Ts = sorted({T for p in R.values() for T in p["forward"]["ratio"]})
    lines += [
        "",
        "Ratio of the family's time to its relative's (forward / forward + backward); a "
        "target is met when every measured length is within it:",
        "",
        "| family / relative | " + " | ".join(str(T) for T in Ts) + " | target | met |",
        "|---|" + "---:|" * len(Ts) + "---:|---|",
    ]
    for pair, p in R.items():
        cells = []
        for T in Ts:
            f, fb = (p[kind]["ratio"].get(T) for kind in ("forward", "forward_backward"))
            cells.append(f"{fmt_ratio(f)} / {fmt_ratio(fb)}")
        bound = "-" if p["bound"] is None else f"<= {p['bound']:g}"
        met = (
            "-" if p["bound"] is None else f"{p['forward']['met']} / {p['forward_backward']['met']}"
        )
        lines.append(f"| {pair} | " + " | ".join(cells) + f" | {bound} | {met} |")
    skipped = {n: s for n, s in L["skipped"].items() if s}
    if skipped:
        lines += ["", "Skipped: " + "; ".join(
            f"{n} {where} ({why})" for n, s in skipped.items() for where, why in s.items()
        ) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


def fmt_ms(seconds):
    return "skipped" if seconds is None else f"{seconds * 1e3:.1f}"


def fmt_ratio(r):
    return "-" if r is None else f"{r:.2f}"


def plot(result: dict, path) -> None:
    kinds = (("forward", "forward time (s)"), ("forward_backward", "forward + backward time (s)"))
    plot_lengths(result["lengths"], kinds, path)


if __name__ == "__main__":
    import tyro  # here: an image without tyro can still import and call main()

    main(tyro.cli(Config))
