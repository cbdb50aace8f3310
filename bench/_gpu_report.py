"""bench/gpu.py's report: the table (markdown) and the figure of one sweep's result."""

from __future__ import annotations

from pathlib import Path

GiB = 2**30
# The implementations' names in the table and the figure, in bench/gpu.py's order.
IMPL_LABELS = {
    "pallas": "attn.pallas",
    "mosaic": "attn.pallas.mosaic",
    "mosaic_1wg": "mosaic (1 warpgroup)",
    "cudnn": "jax.nn (cudnn)",
    "xla": "jax.nn (xla)",
    "blockwise": "attn blockwise",
}
PLOTTED_HEADS = (16, 128)  # the (N, H) the figure draws: the one measured at every length


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["status"] != "ok":
        return row["status"].split(":")[0]
    share = "" if row.get("peak_share") is None else f" / {100 * row['peak_share']:.0f}%"
    memory = "" if row.get("program_bytes") is None else f" / {row['program_bytes'] / GiB:.2f} GiB"
    return f"{row['ms']:.3g} ms / {row['tflops']:.3g} TF{share}{memory}"


def markdown(result: dict) -> str:
    rows, cfg = result["rows"], result["config"]
    impls = [i for i in cfg["impls"] if any(r["impl"] == i for r in rows)]
    peak = result["peak_tflops"]
    lines = [
        f"# Attention on {result['device']['kind']} ({result['device']['platform']})",
        "",
        "bf16, MHA. Each cell: best time / useful TFLOP/s (4 B N H per visible pair; "
        "x3.5 with the backward)"
        + (f" / share of the {peak:.0f} TFLOP/s bf16 peak" if peak else "")
        + " / device memory of the compiled program (XLA buffer assignment). "
        f"Measured bf16 matmul rate here: {result['device']['matmul_tflops']:.3g} TFLOP/s "
        "(one n x n x n product, n = 8192 on a GPU). "
        f"window_sinks: causal & (window {result['window']} | first "
        f"{result['initial_tokens']} tokens). jax {result['env']['jax']}, "
        f"{result['wall_seconds']:.0f} s.",
        "",
        "| mask | pass | B | N | H | T | " + " | ".join(IMPL_LABELS[i] for i in impls) + " |",
        "|---|---|---:|---:|---:|---:|" + "---:|" * len(impls),
    ]
    keys = sorted(
        {(r["mask"], r["mode"], r["B"], r["N"], r["H"], r["T"]) for r in rows},
        key=lambda k: (cfg["masks"].index(k[0]), cfg["modes"].index(k[1]), k[5], k[3]),
    )
    for key in keys:
        found = {
            r["impl"]: r
            for r in rows
            if (r["mask"], r["mode"], r["B"], r["N"], r["H"], r["T"]) == key
        }
        cells = [*key[:2], *(str(x) for x in key[2:])]
        lines.append("| " + " | ".join(cells + [_cell(found.get(i)) for i in impls]) + " |")
    errors = {}
    for r in rows:
        if r.get("max_abs_error") is not None:
            errors[r["impl"]] = max(errors.get(r["impl"], 0.0), r["max_abs_error"])
    if errors:
        lines += ["", "Largest forward error against a float32 reference on the same inputs "
                  "(T <= 4096): " + ", ".join(
                      f"{IMPL_LABELS[i]} {e:.2g}" for i, e in errors.items()) + "."]  # fmt: skip
    missing = [r for r in rows if r["status"] != "ok"]
    if missing:
        lines += ["", "Not measured:", ""]
        lines += [
            f"- {r['impl']} {r['mask']} {r['mode']} B={r['B']} N={r['N']} H={r['H']} "
            f"T={r['T']}: {r['status']}"
            for r in missing
        ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cfg = result["rows"], result["config"]
    fig, axes = plt.subplots(1, len(cfg["modes"]), figsize=(13, 5), squeeze=False)
    colors = dict(
        zip(
            IMPL_LABELS,
            ("tab:blue", "tab:green", "tab:olive", "tab:purple", "tab:red", "tab:orange"),
            strict=True,
        )
    )
    styles = {"causal": "-", "full": ":", "window_sinks": "--"}
    N0, H0 = (2, 16) if cfg["dry_run"] else PLOTTED_HEADS
    for ax, mode in zip(axes[0], cfg["modes"], strict=True):
        for impl in cfg["impls"]:
            for mask in cfg["masks"]:
                pts = sorted(
                    (r["T"], r["tflops"])
                    for r in rows
                    if (r["impl"], r["mask"], r["mode"], r["N"], r["H"])
                    == (impl, mask, mode, N0, H0)
                    and r["status"] == "ok"
                )
                if pts:
                    Ts, tf = zip(*pts, strict=True)
                    ax.plot(Ts, tf, styles[mask], color=colors[impl], marker="o", markersize=3,
                            label=f"{IMPL_LABELS[impl]}, {mask}")  # fmt: skip
        ax.set(title=f"{mode}, N={N0}, H={H0}", xlabel="T = S (tokens)", ylabel="useful TFLOP/s")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        if result["peak_tflops"]:
            ax.axhline(result["peak_tflops"], color="gray", linewidth=0.8)
        ax.axhline(result["device"]["matmul_tflops"], color="gray", linewidth=0.8, ls="--")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"Attention, bf16, {result['device']['kind']}")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
