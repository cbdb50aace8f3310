"""bench/attention.py's report: the targets, the table (markdown) and the figure of a sweep."""

from __future__ import annotations

import operator
from pathlib import Path

# The implementations' names in the table and the figure, in bench/attention.py's IMPLS order.
IMPL_LABELS = {
    "xla": "jax.nn (xla)",
    "cudnn": "jax.nn (cudnn)",
    "dense": "attn dense",
    "blockwise": "attn blockwise",
    "tiles": "blockwise's matmuls alone",
    "torch": "torch SDPA",
}
MATMUL_SIZE = 4096  # n of the n x n matmul whose rate the times are set against
MiB = 2**20


def _memory_label(result: dict) -> str:
    if result["platform"] == "cpu":
        return "peak RSS of the child process"
    return "peak device memory in use (torch: host RSS)"


def row_memory(row: dict) -> int:
    """Peak device memory where the child reported it, else its peak RSS."""
    return row.get("peak_device_bytes", row["peak_rss_bytes"])


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["status"] != "ok":
        return "skipped" if row["status"].startswith("skipped") else "failed"
    return (
        f"{row['seconds']:.3f} s / {row_memory(row) / MiB:.0f} MB / "
        f"{100 * row['matmul_fraction']:.0f}%"
    )


def _lookup(rows, **key):
    for row in rows:
        if all(row[k] == v for k, v in key.items()):
            return row
    return None


def _ratio(rows, a: str, b: str, **key) -> str:
    ra, rb = _lookup(rows, impl=a, **key), _lookup(rows, impl=b, **key)
    if not ra or not rb or ra["status"] != "ok" or rb["status"] != "ok":
        return "-"
    return f"{ra['seconds'] / rb['seconds']:.2f}"


def targets(result: dict) -> list[dict]:
    """The CPU targets (causal, f32, B=1, N=8, H=64), checked on this run."""
    rows = result["rows"]

    def get(impl, mode, T, key="seconds"):
        row = _lookup(rows, impl=impl, mask="causal", mode=mode, T=T)
        return row[key] if row and row["status"] == "ok" else None

    def quotient(a, b):
        return None if a is None or b is None else a / b

    rss = get("blockwise", "fwd+bwd", 65536, "peak_rss_bytes")
    checks = [
        ("T=8192 fwd: blockwise / torch SDPA time", "<=", 1.0,
         quotient(get("blockwise", "fwd", 8192), get("torch", "fwd", 8192))),
        ("T=8192 fwd: jax.nn (xla) / blockwise time", ">=", 8.0,
         quotient(get("xla", "fwd", 8192), get("blockwise", "fwd", 8192))),
        ("T=8192 fwd: blockwise useful FLOP/s / matmul rate", ">=", 0.5,
         get("blockwise", "fwd", 8192, "matmul_fraction")),
        ("T=65536 fwd+bwd: blockwise peak RSS (GB)", "<", 3.0, quotient(rss, 1e9)),
        ("T=8192: blockwise fwd+bwd / fwd time", "<=", 3.5,
         quotient(get("blockwise", "fwd+bwd", 8192), get("blockwise", "fwd", 8192))),
    ]  # fmt: skip
    compare = {"<=": operator.le, ">=": operator.ge, "<": operator.lt}
    return [
        dict(target=name, value=value, wanted=f"{op} {bound:g}",
             met=None if value is None else compare[op](value, bound))
        for name, op, bound, value in checks
    ]  # fmt: skip


def markdown(result: dict) -> str:
    cfg, env, rows = result["config"], result["env"], result["rows"]
    impls = [i for i in cfg["impls"] if any(r["impl"] == i for r in rows)]
    n = cfg.get("matmul_size", MATMUL_SIZE)
    lines = [
        f"# Softmax attention on {result['platform']} ({env['cpu_count']} CPU cores)",
        "",
        f"B={cfg['batch']}, N={cfg['heads']}, H={cfg['head_dim']}, {cfg['dtype']}. Each cell: "
        f"best time / {_memory_label(result)} / useful FLOP/s as a fraction of the matmul "
        "rate. Useful FLOPs: 4 T^2 N H for a full forward pass, half for causal, x3.5 "
        "for forward + backward. Short runs: best of "
        f"{cfg['rounds']} interleaved rounds.",
        "",
        f"{cfg['dtype']} matmul rate (jnp.dot {n}x{n}, best of 5): "
        f"**{result['matmul_gflops']:.0f} GFLOP/s**. Load average at start / end: "
        f"{env['load_average_at_start'][0]:.2f} / {env['load_average_at_end'][0]:.2f} "
        f"(niceness {env['nice']}; other processes on a shared machine slow some runs).",
        "",
    ]
    head = ["mask", "pass", "T", *(IMPL_LABELS[i] for i in impls)]
    with_torch = "torch" in impls and "blockwise" in impls
    if with_torch:
        head.append("blockwise / torch")
    if "xla" in impls and "blockwise" in impls:
        head.append("xla / blockwise")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(head) - 3)]
    keys = sorted(
        {(r["mask"], r["mode"], r["T"]) for r in rows},
        key=lambda k: (cfg["masks"].index(k[0]), cfg["modes"].index(k[1]), k[2]),
    )
    for mask, mode, T in keys:
        cells = [mask, mode, str(T)]
        cells += [_cell(_lookup(rows, impl=i, mask=mask, mode=mode, T=T)) for i in impls]
        if with_torch:
            cells.append(_ratio(rows, "blockwise", "torch", mask=mask, mode=mode, T=T))
        if "xla" in impls and "blockwise" in impls:
            cells.append(_ratio(rows, "xla", "blockwise", mask=mask, mode=mode, T=T))
        lines.append("| " + " | ".join(cells) + " |")
    skipped = [r for r in rows if r["status"] != "ok"]
    if skipped:
        lines += ["", "Not measured:", ""]
        lines += [
            f"- {r['impl']} {r['mask']} {r['mode']} T={r['T']}: {r['status']}" for r in skipped
        ]
    if result["targets"]:
        lines += [
            "",
            "Targets (causal):",
            "",
            "| target | value | wanted | met |",
            "|---|---:|---|---|",
        ]
    for t in result["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"| {t['target']} | {value} | {t['wanted']} | {t['met']} |")
    key = dict(mask="causal", mode="fwd", T=8192)
    floor, torch = _lookup(rows, impl="tiles", **key), _lookup(rows, impl="torch", **key)
    if floor and torch and floor["status"] == torch["status"] == "ok":
        lines += [
            "",
            f"At T=8192, causal, blockwise's tile matmuls alone take {floor['seconds']:.3f} s: "
            f"{floor['seconds'] / torch['seconds']:.2f}x torch SDPA's whole forward pass "
            f"({torch['seconds']:.3f} s).",
        ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cfg = result["rows"], result["config"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 6))
    colors = dict(
        zip(
            IMPL_LABELS,
            ("tab:red", "tab:purple", "tab:orange", "tab:blue", "tab:gray", "tab:green"),
            strict=True,
        )
    )
    styles = {
        ("causal", "fwd"): "-",
        ("causal", "fwd+bwd"): "--",
        ("full", "fwd"): ":",
        ("full", "fwd+bwd"): "-.",
    }
    for impl in cfg["impls"]:
        for mask in cfg["masks"]:
            for mode in cfg["modes"]:
                pts = sorted(
                    (r["T"], r["seconds"], row_memory(r) / MiB)
                    for r in rows
                    if (r["impl"], r["mask"], r["mode"]) == (impl, mask, mode)
                    and r["status"] == "ok"
                )
                if not pts:
                    continue
                Ts, secs, mem = zip(*pts, strict=True)
                kw = dict(
                    color=colors[impl],
                    linestyle=styles.get((mask, mode), "-"),
                    marker="o",
                    markersize=3,
                    label=f"{IMPL_LABELS[impl]}, {mask} {mode}",
                )
                axes[0].plot(Ts, secs, **kw)
                axes[1].plot(Ts, mem, **kw)
    axes[0].set(ylabel="time (s)", title="Time vs sequence length")
    axes[1].set(ylabel=f"{_memory_label(result)} (MB)", title="Peak memory vs sequence length")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T = S (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(
        f"Softmax attention, {result['platform']}, B={cfg['batch']} N={cfg['heads']} "
        f"H={cfg['head_dim']} {cfg['dtype']} (matmul rate {result['matmul_gflops']:.0f} GFLOP/s)"
    )
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
