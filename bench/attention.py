"""Benchmark: softmax attention implementations side by side, time and peak memory against T.

For T from 1K to 64K (B=1, N=8, H=64, float32, causal and full masks) it times
the forward pass and forward + backward (the gradient of ``sum(out * ct)``
w.r.t. q, k, v for a random cotangent ct) of:

* ``xla``: ``jax.nn.dot_product_attention`` (materializes ``[N,T,S]``),
* ``dense``: ``attn.dot_product_attention`` (ours, materialized),
* ``blockwise``: ``attn.blockwise_attention`` (ours, FlashAttention),
* ``tiles`` (forward only): the two matmuls of every tile blockwise computes and
  nothing else, in the same loop: what XLA's matmuls alone take on blockwise's
  schedule, a floor under its forward pass,
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` on the same
  CPU, when torch is importable.

Every measurement runs in its own child process, which reports its peak
resident memory (``VmHWM``), so each number is that implementation's alone
(JAX runtime included: a bare child holds a few hundred MB).

Timing: compiled ahead of time, then the best of ``repeats`` runs (one run
when it takes longer than ``SINGLE_RUN_SECONDS``; JAX's first run is a warm-up
below that). A configuration is skipped, and listed as such, when its
``[N,T,S]`` float32 arrays would not fit in memory (materializing
implementations) or when its time, projected from the previous length, exceeds
``max_seconds`` (except the configurations of the targets, ``ALWAYS_MEASURED``).
The machine's matmul rate in the same dtype (``jnp.dot`` of 4096 x 4096,
best of several) is measured first, and every time is also given as useful
FLOP/s as a fraction of it: ``4 T S N H`` for a full forward pass, the visible
half ``2 T^2 N H`` for a causal one, 2.5x that for the backward pass.

The load average and niceness are recorded: on a shared machine other processes
slow some runs, for seconds to minutes at a time (the same run measured 0.59 s
and 0.75 s half an hour apart here). So after the sweep, every run that took at
most ``ROUND_SECONDS`` is measured again in ``rounds - 1`` more interleaved
passes and keeps its best time; ratios of short runs then compare best against
best. Running under ``nice -n -15`` helps too. The CPU targets (``targets``) are
checked at the end of the table.

Writes ``bench/results/attention-<platform>.json``, ``.md`` (a table) and
``.png`` (time and memory against T, log-log).

    python bench/attention.py                 # the full run (about 30 minutes on 2 cores)
    nice -n -15 python bench/attention.py     # the same, ahead of other processes
    python bench/attention.py --quick         # smoke test: T = 1K, 2K, "-quick" files
    python bench/attention.py --max-len 16384
    python bench/attention.py --dtype bfloat16  # on a GPU: cuDNN's fused kernel as the peer
    python bench/attention.py --scores --baseline-root /tmp/before  # score modifiers
                                              # (bench/_scores.py): attention-scores-cpu.*

On a GPU the peers are ``jax.nn.dot_product_attention`` with ``implementation``
``"xla"`` and ``"cudnn"`` (``PLATFORM_IMPLS``), and memory is the device's peak
bytes in use (``memory_stats``), not the host's RSS.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform as platform_lib
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: `python bench/attention.py`
    sys.path.insert(0, str(ROOT))

from bench._attention_child import child_main  # noqa: E402
from bench._attention_report import (  # noqa: E402
    MATMUL_SIZE,
    MiB,
    markdown,
    plot,
    row_memory,
    targets,
)
from bench._report import write_report  # noqa: E402

IMPLS = ("xla", "cudnn", "dense", "blockwise", "tiles", "torch")
FORWARD_ONLY = {"tiles"}
# What runs where by default: torch is the CPU peer (when importable), cuDNN's
# fused kernel the GPU one; the tile-matmul floor is about XLA:CPU's loops.
PLATFORM_IMPLS = {
    "cpu": ("xla", "dense", "blockwise", "tiles", "torch"),
    "gpu": ("xla", "cudnn", "dense", "blockwise"),
}
MODES = ("fwd", "fwd+bwd")
MASKS = ("causal", "full")
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
QUICK_LENGTHS = (1024, 2048)
BACKWARD_FLOPS = 2.5  # the backward pass does 5 matmuls to the forward pass's 2
ROUND_SECONDS = 3.0  # runs up to this long are measured again in later rounds
# Peak memory of the materializing implementations in [N,T,S] float32 arrays,
# measured at T = 4K and 8K (scores, weights, and in the backward their
# gradients), for the memory skip.
MATERIALIZED_ARRAYS = {
    ("xla", "fwd"): 2.5,
    ("dense", "fwd"): 2.5,
    ("xla", "fwd+bwd"): 5.5,
    ("dense", "fwd+bwd"): 8.0,
}
# The configurations the CPU targets are about: measured whatever their
# projected time (T = 65536 forward + backward takes minutes on 2 cores).
ALWAYS_MEASURED = {("blockwise", "causal", "fwd+bwd", 65536)}


@dataclass(frozen=True)
class Config:
    """Benchmark settings (flags: --quick, --max-len, --platform, ...)."""

    quick: bool = False  # T = 1K and 2K, one timed run: a smoke test ("-quick" files)
    max_len: int = 65536
    platform: str = ""  # JAX platform ("cpu", "gpu", "tpu"); empty: the default backend
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"  # of q, k, v ("bfloat16" on a GPU)
    impls: tuple[str, ...] = ()  # empty: those of PLATFORM_IMPLS for the platform
    masks: tuple[str, ...] = ("causal", "full")
    modes: tuple[str, ...] = MODES
    repeats: int = 5  # timed runs (best taken) for runs shorter than SINGLE_RUN_SECONDS
    rounds: int = 3  # passes over the runs up to ROUND_SECONDS long, best taken (see module doc)
    max_seconds: float = 45.0  # skip a run projected (from the previous T) to take longer
    memory_fraction: float = 0.6  # of available memory, for materialized [N,T,S] arrays
    out_dir: str = "bench/results"
    lengths: tuple[int, ...] = ()  # the lengths to measure; () means the default table
    matmul_size: int = MATMUL_SIZE  # n of the n x n matmul whose rate the times are set against
    scores: bool = False  # the score-modifier run instead (bench/_scores.py)
    baseline_root: str = ""  # --scores: an earlier checkout, timed beside today's (before/after)

    def __post_init__(self):
        # Names are checked before any measurement: a typo must not cost a whole sweep.
        for flag, values, allowed in (
            ("impls", self.impls, IMPLS),
            ("masks", self.masks, MASKS),
            ("modes", self.modes, MODES),
        ):
            unknown = [v for v in values if v not in allowed]
            if unknown or (flag != "impls" and not values):
                raise ValueError(f"--{flag}: expected names from {allowed}, got {list(values)}")


def measure(spec: dict, timeout: float) -> dict:
    """Runs ``spec`` in a child process; the result, or a status saying why there is none."""
    env = dict(os.environ, ATTN_BENCH_CHILD=json.dumps(spec))
    try:
        run = subprocess.run(
            [sys.executable, str(Path(__file__).resolve())],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {timeout:.0f} s"}
    if run.returncode != 0:
        tail = (run.stderr.strip().splitlines() or ["?"])[-1][:200]
        return {"status": f"failed (exit {run.returncode}): {tail}"}
    return dict(json.loads(run.stdout.strip().splitlines()[-1]), status="ok")


# ----------------------------------------------------------------------------
# The sweep.


def useful_flops(cfg: Config, T: int, mask: str, mode: str) -> float:
    """Useful FLOPs: the visible scores' two matmuls (x2.5 more for the backward)."""
    flops = 4.0 * cfg.batch * T * T * cfg.heads * cfg.head_dim
    if mask == "causal":
        flops /= 2
    return flops * (1 + BACKWARD_FLOPS) if mode == "fwd+bwd" else flops


def available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def skip_reason(
    cfg: Config, impl: str, mask: str, mode: str, T: int, done: dict, memory: int
) -> str | None:
    """Why a configuration is not run, or None (``memory``: bytes the run may use)."""
    key = (impl, mask, mode)
    if impl in ("xla", "dense"):
        need = MATERIALIZED_ARRAYS[impl, mode] * cfg.batch * cfg.heads * T * T * 4
        if need > cfg.memory_fraction * memory:
            return f"[N,T,S] float32 arrays: ~{need / 2**30:.0f} GiB"
    shorter = [(t, r) for (k, t), r in done.items() if k == key and t < T]
    if shorter:
        t_prev, prev = max(shorter)
        if prev.get("status") != "ok":
            return "a shorter length was not measured"
        projected = prev["seconds"] * (T / t_prev) ** 2
        if projected > cfg.max_seconds and (impl, mask, mode, T) not in ALWAYS_MEASURED:
            return f"projected {projected:.0f} s > {cfg.max_seconds:.0f} s"
    return None


def sweep(cfg: Config, lengths, platform: str) -> tuple[float, list[dict]]:
    base = dict(
        platform=platform,
        batch=cfg.batch,
        heads=cfg.heads,
        head_dim=cfg.head_dim,
        repeats=cfg.repeats,
        dtype=cfg.dtype,
    )
    n = cfg.matmul_size
    print(f"{cfg.dtype} matmul rate ({n}x{n}, best of 5)...", flush=True)
    mm = measure(dict(base, impl="matmul", T=n, repeats=5), timeout=600)
    if mm["status"] != "ok":
        raise RuntimeError(f"matmul rate: {mm['status']}")
    matmul_rate = 2 * n**3 / mm["seconds"]
    print(f"  {matmul_rate / 1e9:.0f} GFLOP/s", flush=True)
    memory = mm.get("device_bytes_limit") or available_bytes()

    impls = [i for i in cfg.impls if i != "torch" or torch_available()]
    timeout = max(900.0, 4 * cfg.max_seconds)
    done: dict = {}
    rows, specs = [], []
    for mask in cfg.masks:
        for mode in cfg.modes:
            for T in lengths:
                for impl in impls:
                    if impl in FORWARD_ONLY and mode != "fwd":
                        continue
                    spec = dict(base, impl=impl, mask=mask, mode=mode, T=T)
                    reason = skip_reason(cfg, impl, mask, mode, T, done, memory)
                    if reason is None:
                        result = measure(spec, timeout)
                    else:
                        result = {"status": f"skipped: {reason}"}
                    done[((impl, mask, mode), T)] = result
                    rows.append(dict(impl=impl, mask=mask, mode=mode, T=T, rounds=1, **result))
                    specs.append(spec)
                    print(_progress(rows[-1], matmul_rate, cfg), flush=True)
    # Later rounds: the short runs again, interleaved, so that a slow spell of a
    # shared machine does not decide a ratio; each keeps its best time.
    for r in range(2, cfg.rounds + 1):
        print(f"round {r} of {cfg.rounds}: runs up to {ROUND_SECONDS:g} s again", flush=True)
        for row, spec in zip(rows, specs, strict=True):
            if row["status"] != "ok" or row["seconds"] > ROUND_SECONDS:
                continue
            again = measure(spec, timeout)
            if again["status"] == "ok":
                row["seconds"] = min(row["seconds"], again["seconds"])
                for key in ("peak_rss_bytes", "peak_device_bytes"):
                    if key in row:
                        row[key] = max(row[key], again[key])
                row["rounds"] += 1
            print(_progress(row, matmul_rate, cfg), flush=True)
    for row in rows:
        if row["status"] == "ok":
            flops = useful_flops(cfg, row["T"], row["mask"], row["mode"])
            row["useful_gflops"] = flops / row["seconds"] / 1e9
            row["matmul_fraction"] = flops / row["seconds"] / matmul_rate
    return matmul_rate, rows


def _progress(row: dict, matmul_rate: float, cfg: Config) -> str:
    head = f"  {row['mask']:6s} {row['mode']:7s} T={row['T']:6d} {row['impl']:9s}"
    if row["status"] != "ok":
        return f"{head} {row['status']}"
    fraction = useful_flops(cfg, row["T"], row["mask"], row["mode"]) / row["seconds"] / matmul_rate
    return (
        f"{head} {row['seconds']:8.3f} s  {row_memory(row) / MiB:7.0f} MB"
        f"  {100 * fraction:5.1f}% of matmul"
    )


def main(cfg: Config) -> dict:
    from importlib.metadata import version

    # This process starts no JAX backend (on a GPU it would hold its memory).
    platform = cfg.platform
    if not platform:
        probe = measure({"impl": "platform", "platform": ""}, 600)
        if "platform" not in probe:
            raise RuntimeError(f"finding JAX's platform: {probe['status']}")
        platform = probe["platform"]
    if cfg.scores:
        from bench import _scores

        spec = dict(impl="matmul", platform=platform, dtype=cfg.dtype, T=MATMUL_SIZE, repeats=5)
        rate = 2 * MATMUL_SIZE**3 / measure(spec, 600)["seconds"]
        return _scores.main(cfg, measure, rate, platform, write_report)
    table = cfg.lengths or (QUICK_LENGTHS if cfg.quick else LENGTHS)
    lengths = [T for T in table if cfg.max_len >= T]
    impls = cfg.impls or PLATFORM_IMPLS.get(platform, PLATFORM_IMPLS["gpu"])
    cfg = dataclasses.replace(cfg, impls=tuple(impls), platform=platform)
    if cfg.quick:
        cfg = dataclasses.replace(cfg, repeats=1)
    name = f"attention-{platform}" + ("" if cfg.dtype == "float32" else f"-{cfg.dtype}")
    name += "-quick" if cfg.quick else ""
    started = time.perf_counter()
    env = {
        "jax": version("jax"),
        "cpu_count": os.cpu_count(),
        "machine": platform_lib.machine(),
        "processor": platform_lib.processor(),
        "load_average_at_start": os.getloadavg(),
        "nice": os.nice(0),  # a negative niceness gives the benchmark priority on a shared CPU
    }
    matmul_rate, rows = sweep(cfg, lengths, platform)
    env["load_average_at_end"] = os.getloadavg()
    result = {
        "platform": platform,
        "config": dataclasses.asdict(cfg),
        "env": env,
        "matmul_gflops": matmul_rate / 1e9,
        "rows": rows,
        "wall_seconds": time.perf_counter() - started,
    }
    # The targets are for float32 on a CPU.
    result["targets"] = targets(result) if (platform, cfg.dtype) == ("cpu", "float32") else []
    write_report(result, cfg.out_dir, name, markdown, plot)
    return result


if __name__ == "__main__":
    if "ATTN_BENCH_CHILD" in os.environ:
        print(json.dumps(child_main(json.loads(os.environ["ATTN_BENCH_CHILD"]))))
    else:
        import tyro

        main(tyro.cli(Config))  # a bad name is refused here, before any work
