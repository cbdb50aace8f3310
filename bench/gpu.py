"""Benchmark on one GPU: our Pallas kernel against cuDNN, jax.nn's XLA path and our blockwise.

For bf16 inputs (MHA, B = 4 at T <= 4K, 2 at 8K, 1 beyond; N=16, H=128, and
N=32, H=64 at two lengths), T = S from 1K to 32K, and the masks causal, full
and window + initial tokens (StreamingLLM: ``causal() & (sliding_window(1024) |
initial_tokens(4))``), it times the forward pass and forward + backward (the
gradient of ``sum(out * ct)`` w.r.t. q, k, v) of:

* ``pallas``: ``attn.pallas.flash_attention`` (every mask; Triton);
* ``mosaic``: ``attn.pallas.mosaic.mosaic_attention`` (every mask; Mosaic GPU, Hopper only;
  the forward FlashAttention-3's: a TMA producer and two consumer warpgroups);
* ``mosaic_1wg``: the same with ``consumers=0`` (one warpgroup a block pipelining its copies;
  only with ``--impls``: the default sweep's budget goes to the others);
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, causal and full only
  (jax.nn has no initial tokens);
* ``xla``: ``jax.nn.dot_product_attention(implementation="xla")``, which materializes
  ``[B,N,T,S]`` (skipped where that would not fit), causal and full only;
* ``blockwise``: ``attn.blockwise_attention``, our XLA while-loop kernel.

Each implementation runs in its own child process (so a crash or an
out-of-memory in one leaves the others' numbers alone, and each child's peak
device memory is its own); the whole run keeps to ``budget_seconds`` (default
7 minutes, shared by the implementations in proportion to their points, shortest
lengths first; points past an
implementation's share are listed as not measured). Per point it reports the
best time of a few runs after a warm-up, the useful TFLOP/s (``4 B N H`` per
visible query-key pair, counted from the mask, so causal is halved; x3.5 for
forward + backward), their share of the GPU's dense bf16 peak
(``PEAK_TFLOPS``: ~989 for H100/H200), and the device memory XLA's buffer
assignment gives the compiled program (arguments + outputs + temporaries,
``Compiled.memory_analysis``); the JSON also records each child's
``peak_bytes_in_use``. Writes ``bench/results/gpu-<device>.{json,md,png}``.

On a fresh GPU machine, from the repository root (``.[cuda12]`` for a driver older than 580)::

    python3 -m venv .venv && . .venv/bin/activate
    pip install -c requirements/constraints.txt -e ".[cuda13]"
    python bench/gpu.py                # about 7 minutes
    python bench/gpu.py --dry-run      # CPU, Pallas interpret mode, tiny shapes (tested)

``--dry-run`` runs the same code on the CPU (the Pallas kernel in interpret
mode) at T = 64, B = 1, N = 2, H = 16, a window of 16, and writes
``gpu-dry-run.*``; cuDNN is listed as not measured there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: `python bench/gpu.py`
    sys.path.insert(0, str(ROOT))

from bench._device_common import interpreted  # noqa: E402
from bench._gpu_report import markdown, plot  # noqa: E402
from bench._report import write_report  # noqa: E402

IMPLS = ("pallas", "mosaic", "cudnn", "xla", "blockwise")  # the default sweep
KNOWN_IMPLS = (*IMPLS, "mosaic_1wg")
MASKS = ("causal", "full", "window_sinks")
JAX_NN_MASKS = ("causal", "full")  # what jax.nn can express
MODES = ("fwd", "fwd+bwd")
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
HEADS = ((16, 128),)  # (N, H) at every length
EXTRA_HEADS = ((32, 64),)  # and at EXTRA_LENGTHS
EXTRA_LENGTHS = (4096, 16384)
WINDOW, INITIAL_TOKENS = 1024, 4
BACKWARD_FLOPS = 2.5  # the backward pass does 5 matmuls to the forward pass's 2
# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity), from the vendor's data sheets.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0}
GiB = 2**30


@dataclass(frozen=True)
class Config:
    """Benchmark settings (flags: --dry-run, --budget-seconds, ...)."""

    dry_run: bool = False  # CPU, interpret mode, tiny shapes: checks the script, not the GPU
    budget_seconds: float = 420.0  # the whole sweep, shared by the implementations
    impls: tuple[str, ...] = IMPLS
    masks: tuple[str, ...] = MASKS
    modes: tuple[str, ...] = MODES
    lengths: tuple[int, ...] = LENGTHS
    repeats: int = 10  # timed runs after the warm-up (best taken), fewer for slow runs
    memory_fraction: float = 0.7  # of the device's memory, for jax.nn's [B,N,T,S] arrays
    out_dir: str = "bench/results"

    def __post_init__(self):
        unknown = [i for i in self.impls if i not in KNOWN_IMPLS]
        if unknown:
            raise ValueError(f"impls: expected some of {KNOWN_IMPLS}, got {unknown}")


def batch_for(T: int) -> int:
    """B = 4 up to 4K tokens, 2 at 8K, 1 beyond: about the same tokens per step."""
    return max(1, min(4, 16384 // T))


def points(cfg: Config) -> list[dict]:
    """Every (impl, mask, mode, B, N, H, T) the sweep measures, in order."""
    if cfg.dry_run:
        shapes = [(1, 2, 16, 64)]
    else:
        shapes = [(batch_for(T), N, H, T) for T in cfg.lengths for N, H in HEADS]
        shapes += [(batch_for(T), N, H, T) for T in EXTRA_LENGTHS for N, H in EXTRA_HEADS]
    out = [
        dict(impl=impl, mask=mask, mode=mode, B=B, N=N, H=H, T=T)
        for impl in cfg.impls
        for mask in cfg.masks
        for mode in cfg.modes
        for B, N, H, T in shapes
    ]
    # Shortest first within each implementation, so a budget cut drops the longest lengths.
    return sorted(out, key=lambda p: (cfg.impls.index(p["impl"]), p["T"], p["N"]))


def window_of(cfg_dry_run: bool) -> int:
    return 16 if cfg_dry_run else WINDOW


def visible_pairs(mask: str, T: int, window: int, initial: int = INITIAL_TOKENS) -> int:
    """Query-key pairs the mask lets through (T = S)."""
    if mask == "full":
        return T * T
    rows = [min(t + 1, window) + max(0, min(initial, t + 1 - window)) for t in range(T)]
    return T * (T + 1) // 2 if mask == "causal" else sum(rows)


def useful_flops(p: dict, window: int) -> float:
    flops = 4.0 * p["B"] * p["N"] * p["H"] * visible_pairs(p["mask"], p["T"], window)
    return flops * (1 + BACKWARD_FLOPS) if p["mode"] == "fwd+bwd" else flops


def peak_tflops(device_kind: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_kind), None)


# ----------------------------------------------------------------------------
# Child processes: one implementation's points each.


def child_main(spec: dict) -> None:
    """Measures ``spec["points"]`` in order, printing one JSON line per point."""
    if spec["dry_run"]:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    for p in spec["points"]:
        if time.time() > spec["deadline"]:
            result = {"status": "not measured: time budget"}
        else:
            try:
                result = measure_point(p, spec, limit)
            except Exception as e:  # an out-of-memory or a lowering error: record it, go on
                result = {"status": f"failed: {type(e).__name__}: {str(e)[:200]}"}
        print(json.dumps(dict(p, **result)), flush=True)
    stats = device.memory_stats() or {}
    print(json.dumps({"child_peak_bytes_in_use": stats.get("peak_bytes_in_use")}), flush=True)


def skip_reason(p: dict, platform: str, limit: int | None, fraction: float) -> str | None:
    """Why a point is not run, or None."""
    if p["impl"] in ("cudnn", "xla") and p["mask"] not in JAX_NN_MASKS:
        return "not applicable: jax.nn has no initial tokens"
    if p["impl"] == "cudnn" and platform != "gpu":
        return "not measured: cuDNN needs a GPU"
    if p["impl"].startswith("mosaic") and platform != "gpu":
        return "not measured: the Mosaic GPU kernels need a Hopper GPU"
    if p["impl"] == "xla" and limit:
        # float32 logits and weights, and in the backward their gradients.
        need = (3 if p["mode"] == "fwd" else 6) * p["B"] * p["N"] * p["T"] ** 2 * 4
        if need > fraction * limit:
            return f"not measured: [B,N,T,S] arrays ~{need / GiB:.0f} GiB"
    return None


def measure_point(p: dict, spec: dict, limit: int | None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import attn
    from attn import masks

    reason = skip_reason(p, jax.default_backend(), limit, spec["memory_fraction"])
    if reason:
        return {"status": reason}
    window = window_of(spec["dry_run"])
    mask = {
        "causal": masks.causal(),
        "full": masks.full(),
        "window_sinks": masks.causal()
        & (masks.sliding_window(window) | masks.initial_tokens(INITIAL_TOKENS)),
    }[p["mask"]]
    kernel = interpreted()  # a dry run's CPU: the interpreter, asked for
    if p["impl"] == "pallas":

        def fn(q, k, v):
            return attn.pallas.flash_attention(q, k, v, mask=mask, **kernel)

    elif p["impl"] == "mosaic":

        def fn(q, k, v):
            return attn.attention(q, k, v, mask=mask, impl="mosaic", **kernel)

    elif p["impl"] == "mosaic_1wg":
        from attn.pallas.mosaic import mosaic_attention

        def fn(q, k, v):
            return mosaic_attention(q, k, v, mask=mask, consumers=0, **kernel)

    elif p["impl"] == "blockwise":

        def fn(q, k, v):
            return attn.blockwise_attention(q, k, v, mask=mask)

    else:

        def fn(q, k, v):
            return jax.nn.dot_product_attention(
                q, k, v, is_causal=p["mask"] == "causal", implementation=p["impl"]
            )

    rng = np.random.default_rng(0)
    shape = (p["B"], p["T"], p["N"], p["H"])
    q, k, v, ct = (
        jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16) for _ in range(4)
    )
    if p["mode"] == "fwd":
        step, args = fn, (q, k, v)
    else:

        def step(q, k, v, ct):
            def loss(q, k, v):
                return (fn(q, k, v).astype(jnp.float32) * ct).sum()

            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        args = (q, k, v, ct)
    start = time.perf_counter()
    compiled = jax.jit(step).lower(*args).compile()
    compile_seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    program_bytes = None
    if memory is not None:
        program_bytes = (
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes
        )
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    while len(times) < spec["repeats"]:
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
        if sum(times) > 1.0:  # a slow point gets fewer runs
            break
    seconds = min(times)
    error = forward_error(fn, mask, q, k, v) if p["mode"] == "fwd" else None
    tflops = useful_flops(p, window) / seconds / 1e12
    peak = peak_tflops(jax.local_devices()[0].device_kind)
    return {
        "status": "ok",
        "ms": seconds * 1e3,
        "tflops": tflops,
        "peak_share": None if peak is None else tflops / peak,
        "program_bytes": program_bytes,
        "compile_seconds": compile_seconds,
        "max_abs_error": error,
    }


def forward_error(fn, mask, q, k, v, limit_bytes: int = 4 * GiB) -> float | None:
    """Largest |fn(q, k, v) - reference| over the output; None where the reference is too big.

    The reference is ``attn.dot_product_attention`` on the same bf16 inputs cast
    to float32, at ``highest`` matmul precision (a GPU's default for float32 is
    TF32), so the error is the implementation's bf16 arithmetic alone.
    """
    import jax
    import jax.numpy as jnp

    import attn

    B, T, N, _ = q.shape
    if 2 * B * N * T * k.shape[1] * 4 > limit_bytes:  # float32 scores and weights
        return None
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda q, k, v: attn.dot_product_attention(q, k, v, mask=mask))(
            *(x.astype(jnp.float32) for x in (q, k, v))
        )
    out = fn(q, k, v).astype(jnp.float32)
    return float(jnp.max(jnp.abs(out - ref)))


def run_child(spec: dict, timeout: float) -> tuple[list[dict], int | None]:
    """Runs one child on ``spec``'s points, restarting it after a crash; rows and peak bytes."""
    todo, rows, peak = list(spec["points"]), [], None
    while todo:
        env = dict(os.environ, ATTN_GPU_BENCH_CHILD=json.dumps(dict(spec, points=todo)))
        try:
            run = subprocess.run(
                [sys.executable, str(Path(__file__).resolve())],
                env=env, capture_output=True, text=True, timeout=timeout,
            )  # fmt: skip
            stdout, failure = run.stdout, None
            if run.returncode != 0:
                tail = (run.stderr.strip().splitlines() or ["?"])[-1][:200]
                failure = f"failed (exit {run.returncode}): {tail}"
        except subprocess.TimeoutExpired as e:
            out = e.stdout or ""
            stdout = out.decode() if isinstance(out, bytes) else out
            failure = f"timed out after {timeout:.0f} s"
        for line in stdout.splitlines():
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if "child_peak_bytes_in_use" in record:
                peak = record["child_peak_bytes_in_use"]
            else:
                rows.append(record)
                todo.pop(0)
        if failure is None:
            break
        if todo:  # the point it died on is recorded; the rest go to a fresh child
            rows.append(dict(todo.pop(0), status=failure))
        if failure.startswith("timed out"):
            rows += [dict(p, status="not measured: time budget") for p in todo]
            break
    return rows, peak


def probe_device(dry_run: bool) -> None:
    """Prints the device's kind, platform and measured bf16 matmul rate as one JSON line.

    The rate (an ``n x n x n`` product, best of 10 after a warm-up; n = 8192 on a
    GPU) is the ceiling the attention rows are read against, beside the data
    sheet's peak.
    """
    import jax
    import jax.numpy as jnp

    n = 256 if dry_run else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    product = jax.jit(lambda a, b: a @ b).lower(a, a).compile()
    jax.block_until_ready(product(a, a))
    times = []
    for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(product(a, a))
        times.append(time.perf_counter() - start)
    d = jax.local_devices()[0]
    info = dict(platform=jax.default_backend(), kind=d.device_kind)
    info["matmul_tflops"] = 2 * n**3 / min(times) / 1e12
    print(json.dumps(info), flush=True)


def device_info(dry_run: bool) -> dict:
    """``probe_device``'s answer, asked in a child (the parent holds no GPU memory)."""
    env = dict(os.environ, ATTN_GPU_BENCH_PROBE="1")
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *(["--dry-run"] if dry_run else [])],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    if run.returncode != 0:
        raise RuntimeError(f"finding the device: {run.stderr.strip()[-300:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------
# The sweep and its report.


def main(cfg: Config) -> dict:
    from importlib.metadata import version

    started = time.time()
    info = device_info(cfg.dry_run)
    if not cfg.dry_run and info["platform"] != "gpu":
        raise SystemExit(f"bench/gpu.py needs a GPU (JAX sees {info['platform']}); try --dry-run")
    todo = points(cfg)
    spec = dict(dry_run=cfg.dry_run, repeats=2 if cfg.dry_run else cfg.repeats)
    spec["memory_fraction"] = cfg.memory_fraction
    groups = [[p for p in todo if p["impl"] == i] for i in cfg.impls]
    if cfg.dry_run:
        groups = [todo]  # one child: the script's paths, not its timings, are checked
    rows, child_peaks = [], {}
    platform = "cpu" if cfg.dry_run else "gpu"
    # The budget is shared in proportion to the points each child will measure.
    weight = [sum(skip_reason(p, platform, None, 1.0) is None for p in g) for g in groups]
    for n, group in enumerate(groups):
        if not group:
            continue
        left = started + cfg.budget_seconds - time.time()
        share = left * max(weight[n], 1) / max(sum(weight[n:]), 1)
        spec_group = dict(spec, points=group, deadline=time.time() + share)
        got, peak = run_child(spec_group, timeout=share + 120)
        rows += got
        child_peaks["+".join(sorted({p["impl"] for p in group}))] = peak
    name = "gpu-dry-run" if cfg.dry_run else "gpu-" + info["kind"].replace(" ", "_")
    result = {
        "device": info,
        "config": dataclasses.asdict(cfg),
        "window": window_of(cfg.dry_run),
        "initial_tokens": INITIAL_TOKENS,
        "peak_tflops": peak_tflops(info["kind"]),
        "env": {"jax": version("jax"), "load_average": os.getloadavg()},
        "child_peak_bytes_in_use": child_peaks,
        "rows": rows,
        "wall_seconds": time.time() - started,
    }
    write_report(result, cfg.out_dir, name, markdown, plot)
    return result


if __name__ == "__main__":
    if "ATTN_GPU_BENCH_CHILD" in os.environ:
        child_main(json.loads(os.environ["ATTN_GPU_BENCH_CHILD"]))
    elif "ATTN_GPU_BENCH_PROBE" in os.environ:
        probe_device("--dry-run" in sys.argv)
    else:
        import tyro

        main(tyro.cli(Config))
