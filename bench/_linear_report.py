"""bench/linear.py's report: the targets, the tables (markdown) and the figure of a linear run."""

from __future__ import annotations

from pathlib import Path

GiB = 2**30


def ratio(a, b):
    return None if a is None or b is None else a / b


def targets(result: dict) -> dict:
    seconds = result["forms"]["seconds"]
    at = 16384
    decode = result["decode"]["linear_step"]
    chunkwise = seconds["chunkwise"].get(at)
    checks = {
        "chunkwise_vs_softmax_at_16k": (ratio(seconds["softmax"].get(at), chunkwise), 20.0),
        "chunkwise_vs_recurrent_at_16k": (ratio(seconds["recurrent"].get(at), chunkwise), 10.0),
        "decode_64k_over_1k": (ratio(decode.get(65536), decode.get(1024)), 1.2),
    }
    out = {}
    for name, (value, bound) in checks.items():
        speedup = not name.startswith("decode")
        met = None if value is None else (value >= bound if speedup else value <= bound)
        wanted = (">= " if speedup else "<= ") + str(bound)
        out[name] = {"value": value, "target": wanted, "met": met}
    rss = result.get("recurrent_backward_rss")
    if rss:
        peak = rss["peak_rss_bytes"] / GiB
        out["recurrent_fwd_bwd_peak_rss_gib"] = {"value": peak, "target": "< 4", "met": peak < 4}
    return out


def fmt_ms(seconds):
    return "skipped" if seconds is None else f"{seconds * 1e3:.2f}"


def fmt_x(value):
    return "-" if value is None else f"{value:.1f}x"


def markdown(result: dict) -> str:
    cfg = result["config"]
    forms = result["forms"]
    s = forms["seconds"]
    lines = [
        f"# Linear attention on CPU ({result['env']['devices']}, jax {result['env']['jax']})",
        "",
        f"Forward time in ms, B={cfg['batch']}, N={cfg['heads']}, H=E={cfg['head_dim']}, causal, "
        f"float32, {cfg['feature_map']}, chunk {cfg['chunk_size']}; "
        f"softmax = {forms['softmax_impl']}. "
        "Best of at least 3 runs after warm-up (more for short runs). "
        f"{result['env']['cpu_count']} CPU cores; 1-minute load average "
        f"{result['env']['load_average_at_start'][0]:.1f} at start, "
        f"{result['env']['load_average_at_end'][0]:.1f} at end (other processes shared the CPU).",
        "",
        "| T | parallel | recurrent | chunkwise | softmax | softmax / chunkwise "
        "| recurrent / chunkwise |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for T in sorted(s["chunkwise"]):
        lines.append(
            f"| {T} | {fmt_ms(s['parallel'].get(T))} | {fmt_ms(s['recurrent'].get(T))} "
            f"| {fmt_ms(s['chunkwise'].get(T))} | {fmt_ms(s['softmax'].get(T))} "
            f"| {fmt_x(ratio(s['softmax'].get(T), s['chunkwise'].get(T)))} "
            f"| {fmt_x(ratio(s['recurrent'].get(T), s['chunkwise'].get(T)))} |"
        )
    skipped = [
        f"{name} at {T}: {why}"
        for name, by_len in forms["skipped"].items()
        for T, why in sorted(by_len.items())
    ]
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped) + "."]
    train = result["train"]
    ts = train["seconds"]
    lines += [
        "",
        f"Forward + backward at T={train['T']}: recurrent {fmt_ms(ts['recurrent'])} ms, "
        f"chunkwise {fmt_ms(ts['chunkwise'])} ms "
        f"({fmt_x(ratio(ts['recurrent'], ts['chunkwise']))}).",
    ]
    dec = result["decode"]
    lines += [
        "",
        f"Decode time per token in microseconds ({dec['steps_per_call']} steps per call, "
        "best of many calls): linear step on its constant-size state vs one softmax "
        "query over a KV cache of the context length.",
        "",
        "| context | linear step | softmax step | softmax / linear |",
        "|---:|---:|---:|---:|",
    ]
    for L in sorted(dec["linear_step"]):
        lin, soft = dec["linear_step"][L], dec["softmax_step"][L]
        lines.append(f"| {L} | {lin * 1e6:.1f} | {soft * 1e6:.1f} | {fmt_x(soft / lin)} |")
    rss = result.get("recurrent_backward_rss")
    if rss:
        lines += [
            "",
            f"Recurrent form, forward + backward at T={rss['T']}, N={rss['heads']}, "
            f"F=E={rss['feature_dim']}: peak RSS {rss['peak_rss_bytes'] / GiB:.2f} GiB "
            f"(child process, {rss['seconds_with_compile']:.1f} s including compilation).",
        ]
    lines += ["", "| target | value | wanted | met |", "|---|---:|---:|---|"]
    for name, t in result["targets"].items():
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"| {name} | {value} | {t['target']} | {t['met']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    forms = result["forms"]
    for name, by_len in forms["seconds"].items():
        points = sorted((T, s) for T, s in by_len.items() if s is not None)
        if points:
            label = f"softmax ({forms['softmax_impl']})" if name == "softmax" else name
            left.plot(*zip(*points, strict=True), marker="o", label=label)
    left.set(xscale="log", yscale="log", xlabel="T (tokens)", ylabel="forward time (s)")
    left.set_title("Forward time vs sequence length")
    left.legend()
    dec = result["decode"]
    for name, key in (("linear step", "linear_step"), ("softmax KV cache", "softmax_step")):
        points = sorted(dec[key].items())
        right.plot(*zip(*points, strict=True), marker="o", label=name)
    right.set(xscale="log", yscale="log", xlabel="context length", ylabel="seconds per token")
    right.set_title("Decode time per token vs context")
    right.legend()
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xscale("log", base=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
