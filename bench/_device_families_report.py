"""The families phase's report (``bench/_device_families.py``): the markdown table and the
summary line."""

from __future__ import annotations

from bench._device_families_plan import (
    CHUNK,
    CHUNKWISE,
    FAMILIES,
    MEMORIES,
    NEWER,
    PEERLESS,
    TARGET,
    TARGET_T,
    TOKENS,
    point_key,
)


def _time_cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("status") != "ok":
        return row.get("status", "-")
    cell = f"{row['ms']:.3g} ms"
    if row.get("tflops") is not None:
        cell += f" / {row['tflops']:.3g} TF"
        if row.get("peak_share") is not None:
            cell += f" / {100 * row['peak_share']:.0f}%"
    if row.get("gb_per_s") is not None:
        cell += f" / {row['gb_per_s']:.0f} GB/s"
    return cell


def ratio(ours: dict | None, peer: dict | None) -> float | None:
    """ours ms / peer ms, where both were measured."""
    if not ours or not peer or ours.get("status") != "ok" or peer.get("status") != "ok":
        return None
    return ours["ms"] / peer["ms"]


def _match_cell(peer: dict, form: str) -> str:
    m = (peer.get("match") or {}).get(form)
    if not m:
        return "-"
    cell = f"out {m['out']:.1e}"
    if "grad" in m:
        cell += f", d{m['grad']} {m['grad_rel']:.1e}"
    return cell


def _main_peer(family: str) -> str:
    return {"softmax": "cudnn", "sparse": "cudnn dense", "decode": "jax.nn"}.get(family, "fla")


def points(rows: list[dict]) -> dict:
    """``{point_key: {"ours": row, "peer": row}}`` in the rows' order."""
    out = {}
    for r in rows:
        out.setdefault(point_key(r), {})[r.get("side", "ours")] = r
    return out


def _side(pair: dict, side: str, key: str) -> dict:
    """The side's rows (``ours`` or ``peers``); a side that did not run gives its status."""
    r = pair.get(side)
    if r is None:
        return {}
    return r.get(key) or {"-": {"status": r.get("status", "-")}}


def markdown(rows: list[dict], info: dict) -> str:
    """A table per family, then the 8K forward + backward ratios against the 2x target."""
    fla = next(
        (p["fla"] for r in rows for p in (r.get("peers") or {}).values() if "fla" in p), None
    )
    matmul = info.get("matmul_tflops")
    lines = [
        f"Each step holds {TOKENS} tokens (B x T); chunks of {CHUNK}; bf16 inputs, float32 "
        "states. Cells: best time / useful TFLOP/s (the same count for ours and the peer; "
        "bench/_device_families.py says which) / share of the bf16 peak"
        + (f" (measured matmul: {matmul:.3g} TFLOP/s)" if matmul else "")
        + ". ours / peer: the time ratio (below 1: ours is faster). Match: the largest "
        "difference from the peer, relative to its largest value, of the output and of the "
        "worst gradient, on the first batch row.",
        "",
        "fla: "
        + (
            f"{fla['version']} at commit {fla['commit']} (torch {fla['torch']}, triton "
            f"{fla['triton']})"
            if fla
            else "not loaded in this run"
        )
        + ".",
    ]
    if info.get("dry_run"):
        lines += [
            "",
            "Dry run: tiny shapes on the CPU (Pallas in interpret mode); no time here "
            "means anything.",
        ]
    pairs = points(rows)
    for family in (*FAMILIES, "decode", *NEWER, *MEMORIES):
        group = [(k, pair) for k, pair in pairs.items() if k[0] == family]
        if not group:
            continue
        first = next(iter(group[0][1].values()))
        shape = {k: v for k, v in first.items() if k in ("N", "K", "H", "E", "n")}
        main = _main_peer(family)
        ops = [_side(pair, "peer", "peers").get(main, {}).get("op") for _, pair in group]
        op = next((o for o in ops if o), main)
        if family in PEERLESS:
            op = f"none ({PEERLESS[family]})"
        length = "S" if family == "decode" else "T"
        lines += [
            "",
            f"**{family}** ({', '.join(f'{k}={v}' for k, v in shape.items())}); peer: {op}",
            "",
            f"| {length} | B | pass | form | ours | peer | ours / peer | match |",
            "|---:|---:|---|---|---|---|---:|---|",
        ]
        for (_, at, mode), pair in group:
            B = next(iter(pair.values())).get("B")
            peers = _side(pair, "peer", "peers") or {main: {"status": "-"}}
            for form, o in (_side(pair, "ours", "ours") or {"-": {"status": "-"}}).items():
                for label, p in peers.items():
                    if family == "sparse" and label == "fla nsa" and form != "nsa":
                        continue
                    x = ratio(o, p)
                    name = f"{label}: " if label not in (main, "-") else ""
                    lines.append(
                        f"| {at} | {B} | {mode} | {form} | {_time_cell(o)} | {name}"
                        f"{_time_cell(p)} | {'-' if x is None else f'{x:.2f}x'} | "
                        f"{_match_cell(p, form)} |"
                    )
    lines += ["", summary(rows)]
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    """The 8K forward + backward ratios of the chunkwise forms against the 2x target."""
    pairs = points(rows)
    cells = []
    for family in CHUNKWISE:
        pair = pairs.get((family, TARGET_T, "fwd+bwd"), {})
        x = ratio(
            _side(pair, "ours", "ours").get("chunkwise"), _side(pair, "peer", "peers").get("fla")
        )
        if x is None:
            cells.append(f"{family} not measured")
        else:
            cells.append(f"{family} {x:.2f}x ({'met' if x <= TARGET else 'NOT met'})")
    met = sum(c.endswith("(met)") for c in cells)
    return (
        f"Target: each chunkwise form within {TARGET:g}x of fla at T = {TARGET_T} forward + "
        f"backward (ours / fla): " + "; ".join(cells) + f". {met} of {len(CHUNKWISE)} met."
    )
