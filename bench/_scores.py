"""Score modifiers in ``bench/attention.py --scores``: their cost in blockwise attention.

At B=1, N=8, H=64, float32, causal, T = 4K and 8K (``--max-len`` caps it), for
the forward pass and forward + backward (the gradient w.r.t. q, k, v and the
modifier's own arrays):

* blockwise with no modifier, ALiBi (learnable slopes), FoX (per-token log
  forget gates, through their running sum) and T5 buckets (a 32-bucket table);
  and jax.nn's arrays, read per tile: ``mask``, the causal mask as a boolean
  ``[T,T]`` array (an argument of the jitted step, so its block schedule is
  built at run time), and ``bias``, a ``[1,1,T,T]`` float32 bias beside
  ``masks.causal()`` (its gradient too);
* the overhead of each as its time over blockwise's without one, in the same run;
* memory: XLA's temporary bytes of the compiled program (its buffer assignment,
  ``memory_analysis()``), whose growth from 4K to 8K shows it linear in T;
* before/after: with ``--baseline-root DIR`` (a checkout of an earlier commit),
  blockwise and dense without a modifier are also timed from that code, in the
  same run and interleaved with today's, so "no slower than before" is a ratio
  of two measurements taken side by side.

Each measurement runs in its own child process (``bench/attention.py``'s
``measure``); the runs are repeated in ``rounds`` interleaved passes and each
keeps its best time. Writes ``bench/results/attention-scores-<platform>.{json,md,png}``.
"""

from __future__ import annotations

import dataclasses
import os
import time

SCORES = ("none", "alibi", "fox", "t5", "mask", "bias")
LENGTHS = (4096, 8192)
QUICK_LENGTHS = (1024,)
DENSE_LENGTHS = (1024, 2048)  # dense before/after (it materializes [N,T,T])
TARGET_OVERHEAD = 1.3  # ALiBi or FoX over no modifier, blockwise, at 4K and 8K


def modifier(name: str, B: int, T: int, N: int):
    """``(build, leaves)``: ``build(*leaves)`` gives the call's extra keyword arguments."""
    import jax.numpy as jnp
    import numpy as np

    from attn import scores

    rng = np.random.default_rng(1)
    if name == "none":
        return (lambda: {}), ()
    if name == "mask":
        return (lambda m: {"mask": m}), (jnp.asarray(np.tril(np.ones((T, T), bool))),)
    if name == "bias":
        bias = 0.1 * rng.standard_normal((1, 1, T, T)).astype(np.float32)
        return (lambda b: {"bias": b}), (jnp.asarray(bias),)
    if name == "alibi":
        make, leaves = scores.alibi, (jnp.asarray(scores.alibi_slopes(N)),)
    elif name == "fox":
        log_f = np.log(rng.uniform(0.9, 1.0, (B, T, N))).astype(np.float32)
        make, leaves = scores.forgetting, (jnp.asarray(log_f),)
    elif name == "t5":
        table = rng.standard_normal((N, 32)).astype(np.float32)
        make, leaves = scores.relative_bias, (jnp.asarray(table),)
    else:
        raise ValueError(f"score: expected one of {SCORES}, got {name!r}")
    return (lambda *leaves: {"score_mod": make(*leaves)}), leaves


def time_scores(spec: dict) -> dict:
    """Child process: the time (and XLA temporary bytes) of one (impl, score, mode, T)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import attn
    from attn import masks

    B, T, N, H = spec["batch"], spec["T"], spec["heads"], spec["head_dim"]
    rng = np.random.default_rng(0)
    q, k, v, ct = (jnp.asarray(rng.standard_normal((B, T, N, H), np.float32)) for _ in range(4))
    build, leaves = modifier(spec["score"], B, T, N)
    call = attn.blockwise_attention if spec["impl"] == "blockwise" else attn.dot_product_attention

    def fn(q, k, v, *leaves):
        return call(q, k, v, **{"mask": masks.causal(), **build(*leaves)})

    args = (q, k, v, *leaves)
    if spec["mode"] == "fwd":
        step = fn
    else:
        floats = tuple(i for i, x in enumerate(args) if jnp.issubdtype(x.dtype, jnp.floating))

        def step(*args):
            loss = lambda *a: (fn(*a) * ct).sum()  # noqa: E731
            return jax.grad(loss, argnums=floats)(*args)

    compiled = jax.jit(step).lower(*args).compile()
    memory = compiled.memory_analysis()
    run = lambda: jax.block_until_ready(compiled(*args))  # noqa: E731
    run()
    best = float("inf")
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return {"seconds": best, "temp_bytes": getattr(memory, "temp_size_in_bytes", None)}


def runs(cfg, baseline: bool):
    """Every (code, impl, score, mode, T) of the run, in the order they are measured."""
    lengths = [T for T in (QUICK_LENGTHS if cfg.quick else LENGTHS) if cfg.max_len >= T]
    modes = cfg.modes
    out = []
    for T in lengths:
        for mode in modes:
            for score in SCORES:
                out.append(("now", "blockwise", score, mode, T))
            if baseline:
                out.append(("before", "blockwise", "none", mode, T))
    for T in [T for T in DENSE_LENGTHS if cfg.max_len >= T][: 1 if cfg.quick else None]:
        for mode in modes:
            out.append(("now", "dense", "none", mode, T))
            if baseline:
                out.append(("before", "dense", "none", mode, T))
    return out


def sweep(cfg, measure, platform: str) -> list[dict]:
    """Measures every run in ``cfg.rounds`` interleaved passes, keeping each one's best."""
    baseline = bool(cfg.baseline_root)
    rows = {}
    for round_ in range(max(1, cfg.rounds)):
        for key in runs(cfg, baseline):
            code, impl, score, mode, T = key
            spec = dict(
                kind="scores", impl=impl, score=score, mode=mode, T=T, batch=cfg.batch,
                heads=cfg.heads, head_dim=cfg.head_dim, repeats=cfg.repeats, platform=platform,
                root=os.path.abspath(cfg.baseline_root) if code == "before" else "",
            )  # fmt: skip
            result = measure(spec, 1800)
            fields = ("code", "impl", "score", "mode", "T")
            row = rows.setdefault(key, dict(zip(fields, key, strict=True)))
            if result.get("status") != "ok":
                row.setdefault("status", result.get("status"))
                continue
            if result["seconds"] < row.get("seconds", float("inf")):
                row.update(seconds=result["seconds"], temp_bytes=result.get("temp_bytes"))
                row.pop("status", None)
            print(f"round {round_ + 1}: {code:6s} {impl:9s} {score:5s} {mode:7s} T={T:5d} "
                  f"{row.get('seconds', float('nan')):.3f} s", flush=True)  # fmt: skip
    return list(rows.values())


def _get(rows, **key):
    for row in rows:
        if all(row.get(k) == v for k, v in key.items()) and "seconds" in row:
            return row
    return None


def targets(rows) -> list[dict]:
    """ALiBi and FoX at most 1.3x blockwise without a modifier; no-modifier now vs before."""
    out = []
    for T in sorted({r["T"] for r in rows if r["impl"] == "blockwise"}):
        for mode in ("fwd", "fwd+bwd"):
            base = _get(rows, code="now", impl="blockwise", score="none", mode=mode, T=T)
            for score in ("alibi", "fox"):
                row = _get(rows, code="now", impl="blockwise", score=score, mode=mode, T=T)
                if base and row:
                    ratio = row["seconds"] / base["seconds"]
                    out.append(dict(
                        what=f"blockwise {score} / none, {mode}, T={T}", value=ratio,
                        target=f"<= {TARGET_OVERHEAD}", met=ratio <= TARGET_OVERHEAD,
                    ))  # fmt: skip
    for row in rows:
        if row["code"] != "now" or row["score"] != "none" or "seconds" not in row:
            continue
        before = _get(rows, code="before", impl=row["impl"], score="none", mode=row["mode"],
                      T=row["T"])  # fmt: skip
        if before:
            ratio = row["seconds"] / before["seconds"]
            # "No slower": within the run-to-run spread of this shared machine (5%).
            out.append(dict(
                what=f"{row['impl']} no modifier, now / before, {row['mode']}, T={row['T']}",
                value=ratio, target="<= 1.05", met=ratio <= 1.05,
            ))  # fmt: skip
    return out


def memory_growth(rows) -> list[dict]:
    """XLA temporary bytes at the largest T over the smallest, per (score, mode)."""
    out = []
    lengths = sorted({r["T"] for r in rows if r["impl"] == "blockwise"})
    if len(lengths) < 2:
        return out
    lo, hi = lengths[0], lengths[-1]
    for score in SCORES:
        for mode in ("fwd", "fwd+bwd"):
            a = _get(rows, code="now", impl="blockwise", score=score, mode=mode, T=lo)
            b = _get(rows, code="now", impl="blockwise", score=score, mode=mode, T=hi)
            if a and b and a.get("temp_bytes") and b.get("temp_bytes"):
                out.append(dict(score=score, mode=mode, lo=lo, hi=hi,
                                ratio=b["temp_bytes"] / a["temp_bytes"],
                                lo_mib=a["temp_bytes"] / 2**20,
                                hi_mib=b["temp_bytes"] / 2**20))  # fmt: skip
    return out


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [
        f"# Score modifiers and jax.nn's arrays in blockwise attention ({result['platform']})",
        "",
        f"B={result['config']['batch']}, N={result['config']['heads']}, "
        f"H={result['config']['head_dim']}, float32, causal; best of "
        f"{result['config']['rounds']} interleaved rounds of {result['config']['repeats']} runs. "
        f"Jitted float32 matmul rate: {result['matmul_gflops']:.0f} GFLOP/s. "
        f"Wall {result['wall_seconds'] / 60:.1f} min.",
        "",
        "| code | impl | modifier | mode | T | seconds | XLA temp MiB | / no modifier |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        base = _get(rows, code=row["code"], impl=row["impl"], score="none", mode=row["mode"],
                    T=row["T"])  # fmt: skip
        if "seconds" not in row:
            lines.append(f"| {row['code']} | {row['impl']} | {row['score']} | {row['mode']} | "
                         f"{row['T']} | {row.get('status')} | | |")  # fmt: skip
            continue
        ratio = f"{row['seconds'] / base['seconds']:.2f}x" if base else ""
        temp = row.get("temp_bytes")
        temp = f"{temp / 2**20:.0f}" if temp else ""
        lines.append(f"| {row['code']} | {row['impl']} | {row['score']} | {row['mode']} | "
                     f"{row['T']} | {row['seconds']:.3f} | {temp} | {ratio} |")  # fmt: skip
    lines += ["", "Memory (XLA temporary bytes), largest T over smallest:", ""]
    for m in result["memory_growth"]:
        lines.append(f"- {m['score']} {m['mode']}: {m['lo_mib']:.0f} MiB at {m['lo']} -> "
                     f"{m['hi_mib']:.0f} MiB at {m['hi']} ({m['ratio']:.2f}x for "
                     f"{m['hi'] // m['lo']}x the length)")  # fmt: skip
    lines += ["", "Targets:", ""]
    for t in result["targets"]:
        lines.append(f"- {t['what']}: {t['value']:.2f} (target {t['target']}): "
                     f"{'met' if t['met'] else 'NOT met'}")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["impl"] == "blockwise" and r["code"] == "now"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd"), strict=True):
        for score in SCORES:
            mine = [r for r in rows if r["score"] == score and r["mode"] == mode]
            pts = sorted((r["T"], r["seconds"]) for r in mine if "seconds" in r)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=score)
        ax.set(xscale="log", yscale="log", xlabel="T", ylabel="seconds", title=f"blockwise, {mode}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(cfg, measure, matmul_rate, platform: str, write_report) -> dict:
    started = time.perf_counter()
    rows = sweep(cfg, measure, platform)
    result = {
        "platform": platform,
        "config": dataclasses.asdict(cfg),
        "matmul_gflops": matmul_rate / 1e9,
        "rows": rows,
        "targets": targets(rows),
        "memory_growth": memory_growth(rows),
        "wall_seconds": time.perf_counter() - started,
    }
    name = f"attention-scores-{platform}" + ("-quick" if cfg.quick else "")
    write_report(result, cfg.out_dir, name, markdown, plot)
    return result
