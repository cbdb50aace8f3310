"""Benchmark: linear attention's three forms against softmax attention, and decoding.

Measures, at B=1, N=8, H=E=64, causal, float32, feature map elu1 (by default;
``--feature-map taylor --head-dim 16`` measures Based's second-order features):

1. Forward time against T for the parallel, recurrent and chunkwise forms of
   ``attn.linear.linear_attention`` and for softmax attention at the same
   shapes (``attn.blockwise_attention`` when it exists, else a causal
   ``jax.nn.dot_product_attention`` up to T = 8K).
2. Decode time per token against context length: one ``linear_attention_step``
   (a constant-size state) against one softmax query over a KV cache of that
   length.
3. Peak RSS of forward + backward of the recurrent form at T = 65536 (in a
   subprocess, so nothing else counts).

Timing: compiled ahead of time, one warm-up run, then the best of at least
``repeats`` runs, more for short runs (``jax.block_until_ready``), the methods
of one length measured in interleaved rounds; a configuration whose run is
projected from the previous length to exceed ``max_seconds`` is skipped. The
load average is recorded: other processes on a shared machine slow some runs,
and the best of many interleaved runs is the least affected.

Writes ``<out_dir>/<name>.json``, ``.md`` (tables) and ``.png`` (log-log plots).

    python bench/linear.py                  # the full run (a few minutes on 2 cores)
    python bench/linear.py --quick          # smoke test: short lengths, "-quick" files
    python bench/linear.py --max-len 16384
    python bench/linear.py --feature-map taylor --head-dim 16 --max-len 8192 --no-rss \
        --name linear-taylor-cpu
    python bench/linear.py --family delta   # the delta rule (bench/_delta.py): delta-cpu.*
    python bench/linear.py --family mamba2  # Mamba-2's SSD (bench/_mamba.py): mamba2-cpu.*
"""

from __future__ import annotations

import dataclasses
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: `python bench/linear.py`
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from attn.linear import (  # noqa: E402
    init_linear_state,
    linear_attention,
    linear_attention_step,
    linear_feature_dim,
)
from bench._linear_report import GiB, markdown, plot, targets  # noqa: E402
from bench._report import write_report  # noqa: E402

try:
    from attn import masks
    from attn.softmax.blockwise import blockwise_attention
except ImportError:  # written concurrently; fall back to XLA's dense attention
    blockwise_attention = None

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
QUICK_LENGTHS = (1024, 2048, 4096)
DENSE_MAX_LEN = 8192  # jax.nn.dot_product_attention materializes [N, T, T]
PARALLEL_MAX_BYTES = 6 * 2**30  # the parallel form holds ~2 [N, T, T] float32 arrays
SINGLE_RUN_SECONDS = 5.0  # a run this long is timed once
# Short runs are repeated until this much was measured (at most MAX_REPEATS
# runs): the best of many resists other processes sharing the CPU.
MIN_MEASURED_SECONDS = 1.0
MAX_REPEATS = 50
RSS_LEN = 65536

# Scaling exponents in T, used to project a run's time from the previous length.
EXPONENT = {"parallel": 2, "recurrent": 1, "chunkwise": 1, "softmax": 2}


@dataclass(frozen=True)
class Config:
    """Benchmark settings (flags: --max-len, --quick, ...)."""

    max_len: int = 65536
    quick: bool = False  # smoke test: lengths up to 4K, repeats=1, no RSS child
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    feature_map: str = "elu1"  # a name in attn.linear.FEATURE_MAPS (not "favor")
    chunk_size: int = 64
    repeats: int = 3
    max_seconds: float = 60.0  # skip a configuration projected to take longer
    decode_steps: int = 64  # decode steps timed per call (per-token time = call / steps)
    train_len: int = 16384  # length of the forward+backward comparison
    rss: bool = True  # measure peak RSS of recurrent forward+backward at T=65536
    out_dir: str = "bench/results"
    name: str | None = None  # default: "<family>-cpu"
    family: str = "linear"  # "linear" (feature maps), "delta" (bench/_delta.py), "mamba2"
    lengths: tuple[int, ...] = ()  # the lengths to measure; () means the default table
    delta_methods: tuple[str, ...] = ()  # --family delta: names of _delta.METHODS; (): all
    oracle: bool = True  # delta, mamba2: float32 against a float64 recurrence, at T <= 1000


# ----------------------------------------------------------------------------
# Timing


def best_times(jobs: dict, repeats: int, no_warmup=()) -> dict:
    """Best wall time in seconds of each job ``name -> (fn, args)``, measured interleaved.

    Each job is compiled ahead of time (unless ``fn`` is a compiled program
    already) and run once to warm up (except those in
    ``no_warmup``, too slow for it). Then rounds run every unfinished job once,
    so a burst of load from other processes hits all jobs alike rather than
    whichever was being measured. A job is finished after ``repeats`` runs and
    MIN_MEASURED_SECONDS of measured time (at most MAX_REPEATS runs), or after
    one run longer than SINGLE_RUN_SECONDS.
    """
    compiled = {
        name: fn if isinstance(fn, jax.stages.Compiled) else jax.jit(fn).lower(*args).compile()
        for name, (fn, args) in jobs.items()
    }
    for name, (_, args) in jobs.items():
        if name not in no_warmup:
            jax.block_until_ready(compiled[name](*args))
    times = {name: [] for name in jobs}
    active = list(jobs)
    while active:
        for name in list(active):
            args = jobs[name][1]
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](*args))
            times[name].append(time.perf_counter() - start)
            runs = times[name]
            enough = len(runs) >= repeats and (
                sum(runs) >= MIN_MEASURED_SECONDS or len(runs) >= MAX_REPEATS
            )
            if enough or runs[-1] > SINGLE_RUN_SECONDS:
                active.remove(name)
    return {name: min(runs) for name, runs in times.items()}


def inputs(cfg: Config, T: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (cfg.batch, T, cfg.heads, cfg.head_dim)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(3))


def softmax_fn():
    if blockwise_attention is not None:
        return "blockwise", partial(blockwise_attention, mask=masks.causal())
    return "xla-dense", partial(jax.nn.dot_product_attention, is_causal=True)


def forms_vs_length(cfg: Config, lengths) -> dict:
    """Forward seconds per method and length (None: skipped), and why skipped."""
    softmax_name, softmax = softmax_fn()
    linear = partial(linear_attention, feature_map=cfg.feature_map)
    methods = {
        "parallel": partial(linear, form="parallel"),
        "recurrent": partial(linear, form="recurrent"),
        "chunkwise": partial(linear, form="chunkwise", chunk_size=cfg.chunk_size),
        "softmax": softmax,
    }
    times = {name: {} for name in methods}
    skipped = {name: {} for name in methods}
    for T in lengths:
        args = inputs(cfg, T)
        jobs, slow = {}, set()
        for name, fn in methods.items():
            reason = skip_reason(cfg, name, T, times[name], softmax_name)
            if reason:
                times[name][T] = None
                skipped[name][T] = reason
                print(f"  {name:>9} T={T:>6}: skipped ({reason})", flush=True)
                continue
            jobs[name] = (fn, args)
            projected = projected_seconds(name, T, times[name])
            if projected is not None and projected > SINGLE_RUN_SECONDS:
                slow.add(name)
        for name, seconds in best_times(jobs, cfg.repeats, no_warmup=slow).items():
            times[name][T] = seconds
            print(f"  {name:>9} T={T:>6}: {seconds * 1e3:10.2f} ms", flush=True)
    return {"softmax_impl": softmax_name, "seconds": times, "skipped": skipped}


def projected_seconds(name: str, T: int, done: dict) -> float | None:
    measured = [(t, s) for t, s in done.items() if s is not None]
    if not measured:
        return None
    last_t, last_s = max(measured)
    return last_s * (T / last_t) ** EXPONENT[name]


def skip_reason(cfg: Config, name: str, T: int, done: dict, softmax_name: str) -> str | None:
    if any(s is None for s in done.values()):
        return "a shorter length was skipped"
    if name == "parallel" and 2 * 4 * cfg.batch * cfg.heads * T * T > PARALLEL_MAX_BYTES:
        return f"T^2 memory: {2 * 4 * cfg.batch * cfg.heads * T * T / GiB:.0f} GiB"
    if name == "softmax" and softmax_name == "xla-dense" and T > DENSE_MAX_LEN:
        return "dense softmax beyond 8K"
    projected = projected_seconds(name, T, done)
    if projected is not None and projected > cfg.max_seconds:
        return f"projected {projected:.0f} s > {cfg.max_seconds:.0f} s"
    return None


def training_step(cfg: Config, T: int) -> dict:
    """Forward + backward seconds at length T for the recurrent and chunkwise forms."""
    args = inputs(cfg, T)
    jobs = {}
    for form in ("recurrent", "chunkwise"):
        attend = partial(
            linear_attention, form=form, chunk_size=cfg.chunk_size, feature_map=cfg.feature_map
        )
        grads = jax.grad(lambda q, k, v, f=attend: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))
        jobs[form] = (grads, args)
    out = best_times(jobs, cfg.repeats)
    for form, seconds in out.items():
        print(f"  {form:>9} T={T:>6} forward+backward: {seconds * 1e3:10.2f} ms", flush=True)
    return {"T": T, "seconds": out}


# ----------------------------------------------------------------------------
# Decoding


def decode_vs_context(cfg: Config, contexts) -> dict:
    """Seconds per decoded token: linear step (state) vs softmax over a KV cache."""
    B, N, H = cfg.batch, cfg.heads, cfg.head_dim
    steps = cfg.decode_steps
    rng = np.random.default_rng(1)
    q_t, k_t, v_t = (
        jnp.asarray(rng.standard_normal((steps, B, N, H), np.float32)) for _ in range(3)
    )

    def linear_decode(state, q_t, k_t, v_t):
        def one(state, x):
            out, state = linear_attention_step(state, *x, feature_map=cfg.feature_map)
            return state, out

        return jax.lax.scan(one, state, (q_t, k_t, v_t))

    def softmax_decode(k_cache, v_cache, q_t):
        # One query per step over the whole cache: B x N x L scores, then the values.
        # The cache is head-major [B,N,S,H] (S cached positions), so a step reads it
        # without a transpose.
        def one(_, q):
            scores = jnp.einsum("BNH,BNSH->BNS", q, k_cache) * H**-0.5
            weights = jax.nn.softmax(scores, axis=-1)
            return None, jnp.einsum("BNS,BNSH->BNH", weights, v_cache)

        return jax.lax.scan(one, None, q_t)[1]

    prefill = jax.jit(
        partial(linear_attention, form="chunkwise", return_state=True, feature_map=cfg.feature_map)
    )
    linear, softmax = {}, {}
    for L in contexts:
        q, k, v = inputs(cfg, L, seed=2)
        # The state after a real prefill of L tokens (its size does not depend on L).
        F = linear_feature_dim(cfg.feature_map, H)
        state = prefill(q, k, v)[1] if L else init_linear_state(B, N, F, H)
        k_cache, v_cache = (jnp.asarray(x.transpose(0, 2, 1, 3)) for x in (k, v))
        jobs = {
            "linear": (linear_decode, (state, q_t, k_t, v_t)),
            "softmax": (softmax_decode, (k_cache, v_cache, q_t)),
        }
        best = best_times(jobs, cfg.repeats)
        linear[L], softmax[L] = best["linear"] / steps, best["softmax"] / steps
        print(
            f"  decode L={L:>6}: linear {linear[L] * 1e6:8.1f} us/token, "
            f"softmax {softmax[L] * 1e6:9.1f} us/token",
            flush=True,
        )
    return {"linear_step": linear, "softmax_step": softmax, "steps_per_call": steps}


# ----------------------------------------------------------------------------
# Peak memory of the recurrent form's backward pass

RSS_CHILD = """
import sys, time
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
from attn.linear import linear_attention
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((1, {T}, {N}, {H}), np.float32)) for _ in range(3))
loss = lambda q, k, v: jnp.sum(linear_attention(q, k, v, form="recurrent") ** 2)
grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
start = time.perf_counter()
jax.block_until_ready(grads(q, k, v))
print(time.perf_counter() - start)
"""


def recurrent_backward_rss(cfg: Config) -> dict:
    """Peak RSS of a child that runs forward + backward of the recurrent form at T=65536."""
    code = RSS_CHILD.format(root=str(ROOT), T=RSS_LEN, N=cfg.heads, H=cfg.head_dim)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    return {
        "T": RSS_LEN,
        "heads": cfg.heads,
        "feature_dim": cfg.head_dim,
        "value_dim": cfg.head_dim,
        "peak_rss_bytes": peak_kib * 1024,
        "seconds_with_compile": float(run.stdout.strip().splitlines()[-1]),
    }


def environment() -> dict:
    return {
        "jax": jax.__version__,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "load_average_at_start": os.getloadavg(),
    }


def main_family(cfg: Config) -> dict:
    """The delta-rule family (``bench/_delta.py``) or Mamba-2's (``bench/_mamba.py``)."""
    from bench import _delta, _mamba

    module = {"delta": _delta, "mamba2": _mamba}[cfg.family]
    if cfg.quick:
        cfg = dataclasses.replace(cfg, repeats=1, name=cfg.name + "-quick")
    result = {"config": dataclasses.asdict(cfg), "env": environment()}
    result[cfg.family] = module.run(cfg, best_times, cfg.quick)
    result["wall_seconds"] = result[cfg.family]["wall_seconds"]
    result["env"]["load_average_at_end"] = os.getloadavg()
    write_report(result, cfg.out_dir, cfg.name, module.markdown, module.plot)
    return result


FAMILIES = ("linear", "delta", "mamba2")


def main(cfg: Config) -> dict:
    if cfg.family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {cfg.family!r}")
    if cfg.name is None:
        cfg = dataclasses.replace(cfg, name=f"{cfg.family}-cpu")
    if cfg.family != "linear":
        return main_family(cfg)
    table = cfg.lengths or (QUICK_LENGTHS if cfg.quick else LENGTHS)
    lengths = tuple(T for T in table if cfg.max_len >= T)
    if cfg.quick:
        cfg = dataclasses.replace(cfg, repeats=1, rss=False, name=cfg.name + "-quick")
    started = time.perf_counter()
    result = {"config": dataclasses.asdict(cfg), "env": environment()}
    if cfg.rss:  # first, while this process has started no other child
        print("peak RSS of the recurrent form's forward+backward (child process)...", flush=True)
        result["recurrent_backward_rss"] = recurrent_backward_rss(cfg)
    print("forward time vs T:", flush=True)
    result["forms"] = forms_vs_length(cfg, lengths)
    print("forward+backward (a training step's attention):", flush=True)
    result["train"] = training_step(cfg, min(cfg.train_len, max(lengths)))
    print("decode time per token vs context:", flush=True)
    result["decode"] = decode_vs_context(cfg, lengths)
    result["targets"] = targets(result)
    result["wall_seconds"] = time.perf_counter() - started
    result["env"]["load_average_at_end"] = os.getloadavg()

    write_report(result, cfg.out_dir, cfg.name, markdown, plot)
    return result


if __name__ == "__main__":
    import tyro  # here: a GPU image without tyro can still import and call main()

    main(tyro.cli(Config))
