"""Benchmark: one decode step against context length and batch, and a ragged batch's memory.

For contexts S from 1K to 64K and batches B from 1 to 64 (every row holding
S keys; B x S capped by ``max_tokens``) it times one decode step (one query
per row, GQA: ``heads`` query heads over ``kv_heads``) of:

* ``xla``: ``jax.nn.dot_product_attention`` with ``key_value_seq_lengths``,
* ``unsplit``: ``attn.decode_attention(num_splits=1)``,
* ``split``: ``attn.decode_attention`` at its default split count
  (``attn.decode.default_splits``) and at the best of ``splits``,
* ``paged``: ``attn.paged_decode_attention`` over pages of ``page_size`` in a
  shuffled order (default splits),
* with ``--pallas`` (the default on a GPU): ``pallas``, ``attn.decode_attention``
  at its default splits with ``impl="pallas"``, and ``pallas_peer``, JAX's own
  Pallas split-K kernel (``jax.experimental.pallas.ops.gpu.decode_attention.gqa``,
  as many splits, where its shape rules allow); on a CPU both run in interpret
  mode, which checks the path, not the speed,

as decode tokens/s (B over the step's time) and the rate the step reads the
cache at (K and V bytes over the time; decode is bound by it), and how many
cores the step keeps busy (the process's CPU time over the wall time): the
most split-K can gain from running its splits side by side is the cores the
machine has over the cores the unsplit step already uses. Timing: jitted,
compiled first, the best of ``repeats`` runs; the whole run is one process
using every core (XLA's thread pool).

Memory: a ragged batch whose lengths run 1K .. 32K (``ragged_lengths``) in a
contiguous cache costs ``B x max_len`` tokens; in a paged cache the pages in
use. Both are given per valid token, beside the step time of each.

Targets (on the 2-core CPU): split-K at 64K, batch 1, at least 1.5x the
unsplit step's tokens/s; the ragged batch's pages at most 1.2x the bytes of
its valid tokens.

    python bench/decode.py                  # bench/results/decode-<platform>.{json,md,png}
    python bench/decode.py --quick          # S = 1K, 4K; B = 1, 4 ("-quick" files)
    python bench/decode.py --dtype bfloat16 # on a GPU
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform as platform_lib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: `python bench/decode.py`
    sys.path.insert(0, str(ROOT))

from bench._device_common import interpreted  # noqa: E402
from bench._report import write_report  # noqa: E402

IMPLS = ("xla", "unsplit", "split", "split_best", "paged")
PALLAS_IMPLS = ("pallas", "pallas_peer")
LABELS = {
    "xla": "jax.nn (lengths)",
    "unsplit": "decode, 1 split",
    "split": "decode, default splits",
    "split_best": "decode, best splits",
    "paged": "paged, default splits",
    "pallas": "decode, Pallas kernel",
    "pallas_peer": "Pallas ops gqa (peer)",
}
TARGET_SPLIT = 1.5
TARGET_MEMORY = 1.2
MATMUL_SIZE = 2048


@dataclass(frozen=True)
class Config:
    """Benchmark settings (flags: --quick, --dtype, ...)."""

    quick: bool = False
    contexts: tuple[int, ...] = (1024, 4096, 16384, 65536)
    batches: tuple[int, ...] = (1, 4, 16, 64)
    max_tokens: int = 2**20  # B x S per configuration, at most
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    dtype: str = "float32"
    page_size: int = 16
    splits: tuple[int, ...] = (2, 4, 8, 16, 32)
    ragged_lengths: tuple[int, ...] = (1024, 2048, 3000, 5000, 8192, 12000, 20000, 32768)
    repeats: int = 10
    out_dir: str = "bench/results"
    pallas: bool | None = None  # the Pallas kernels too; None: on a GPU only

    def __post_init__(self):
        if not self.contexts or not self.batches or not self.splits or min(self.splits) < 1:
            raise ValueError("--contexts/--batches/--splits: expected non-empty positive sizes")


def _best(fn, args, repeats: int) -> tuple[float, float]:
    """``(best seconds, cores busy)``: the fastest of ``repeats`` runs, and the process's
    CPU seconds per wall second over them (2 means both cores of this machine worked)."""
    import jax

    jax.block_until_ready(fn(*args))
    times, cpu = [], time.process_time()
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return min(times), (time.process_time() - cpu) / sum(times)


def _matmul_rate(dtype) -> float:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (MATMUL_SIZE, MATMUL_SIZE), dtype)
    return 2 * MATMUL_SIZE**3 / _best(jax.jit(jnp.dot), (a, a), 5)[0]


def _cache(cfg: Config, B: int, S: int, seed: int = 0):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    dtype = jnp.dtype(cfg.dtype)
    q = jax.random.normal(keys[0], (B, 1, cfg.heads, cfg.head_dim), dtype)
    k = jax.random.normal(keys[1], (B, S, cfg.kv_heads, cfg.head_dim), dtype)
    v = jax.random.normal(keys[2], (B, S, cfg.kv_heads, cfg.head_dim), dtype)
    return q, k, v


def _paged(cfg: Config, k, v, lengths):
    """The contiguous cache ``k, v`` copied into a pool of shuffled pages."""
    import jax.numpy as jnp
    import numpy as np

    import attn

    B, S = k.shape[:2]
    page = cfg.page_size
    per_row = -(-S // page)
    table = attn.PageTable(B * per_row + 1, page, B, per_row)
    order = np.random.default_rng(0).permutation(B)  # rows take pages interleaved
    for n in range(1, per_row + 1):
        for b in order:
            table.grow(int(b), int(min(n * page, lengths[b])))
    tables = jnp.asarray(table.tables)
    pad = per_row * page - S

    def pool(x):
        x = jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]).reshape(B, per_row, page, *x.shape[2:])
        out = jnp.zeros((table.num_pages, page, *x.shape[3:]), x.dtype)
        # Entries past a row's length hold no page: their writes are dropped.
        return out.at[jnp.where(tables >= 0, tables, table.num_pages)].set(x, mode="drop")

    return pool(k), pool(v), tables, table


@functools.lru_cache(maxsize=8)
def _steps(cfg: Config, S: int):
    """The jitted steps for contexts of S (cached: the ragged batch reuses the sweep's)."""
    import jax

    import attn

    best = [s for s in cfg.splits if s <= S]
    fns = {
        "xla": jax.jit(
            lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n)
        ),
        "unsplit": jax.jit(functools.partial(_decode, splits=1)),
        "split": jax.jit(functools.partial(_decode, splits=None)),
    }
    split_fns = {s: jax.jit(functools.partial(_decode, splits=s)) for s in best}
    paged = jax.jit(lambda q, pk, pv, t, n: attn.paged_decode_attention(q, pk, pv, t, n))
    if _with_pallas(cfg):
        fns["pallas"] = jax.jit(
            functools.partial(_decode, splits=None, impl="pallas", **interpreted())
        )
        peer = _peer(S)
        if peer is not None:
            fns["pallas_peer"] = jax.jit(peer)
    return fns, split_fns, paged


def _with_pallas(cfg: Config) -> bool:
    import jax

    return jax.default_backend() == "gpu" if cfg.pallas is None else cfg.pallas


def _decode(q, k, v, n, splits, impl="dense", interpret=None):
    import attn

    return attn.decode_attention(q, k, v, lengths=n, num_splits=splits, impl=impl,
                                 interpret=interpret)  # fmt: skip


PEER_BLOCK_K = 128  # the peer kernel's default key block


def _peer(S: int):
    """JAX's Pallas split-K decode at our default split count, or None where its rules
    (S divisible by the splits, at least 16 keys a split, blocks dividing a split) fail."""
    import jax
    from jax.experimental.pallas.ops.gpu import decode_attention as peer

    splits = _default_splits(S)
    chunk = S // splits
    block_k = min(PEER_BLOCK_K, chunk)
    if S % splits or chunk < 16 or chunk % block_k:
        return None
    interpret = jax.default_backend() != "gpu"

    def step(q, k, v, n):
        out = peer.gqa(q[:, 0], k, v, kv_seq_len=n, k_splits=splits, block_k=block_k,
                       interpret=interpret)  # fmt: skip
        return out[:, None]

    return step


def sweep(cfg: Config) -> list[dict]:
    import jax.numpy as jnp

    rows = []
    item = jnp.dtype(cfg.dtype).itemsize
    for S in cfg.contexts:
        fns, split_fns, paged = _steps(cfg, S)
        for B in cfg.batches:
            if cfg.max_tokens < B * S:
                continue
            q, k, v = _cache(cfg, B, S)
            n = jnp.full((B,), S, jnp.int32)
            timed = {name: _best(fn, (q, k, v, n), cfg.repeats) for name, fn in fns.items()}
            by_split = {s: _best(fn, (q, k, v, n), cfg.repeats) for s, fn in split_fns.items()}
            best = min(by_split, key=lambda s: by_split[s][0])
            timed["split_best"] = by_split[best]
            pk, pv, tables, _ = _paged(cfg, k, v, n)
            timed["paged"] = _best(paged, (q, pk, pv, tables, n), cfg.repeats)
            want = fns["unsplit"](q, k, v, n)
            errors = {name: _rel_err(fn(q, k, v, n), want) for name, fn in fns.items()}
            times = {name: t for name, (t, _) in timed.items()}
            cores = {name: c for name, (_, c) in timed.items()}
            by_split = {s: t for s, (t, _) in by_split.items()}
            del pk, pv
            read = 2 * B * S * cfg.kv_heads * cfg.head_dim * item
            by_split = {str(s): t for s, t in by_split.items()}  # JSON's keys
            row = {"S": S, "B": B, "best_splits": best, "by_splits": by_split,
                   "default_splits": _default_splits(S), "seconds": times, "cores_busy": cores,
                   "rel_err_vs_unsplit": errors,
                   "tokens_per_s": {i: B / t for i, t in times.items()},
                   "read_gb_per_s": {i: read / t / 1e9 for i, t in times.items()}}  # fmt: skip
            rows.append(row)
            print(_progress(row), flush=True)
    return rows


def _rel_err(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _default_splits(S: int) -> int:
    from attn.decode import default_splits

    return default_splits(S)


def ragged(cfg: Config) -> dict:
    """A batch of ``ragged_lengths``: the bytes each cache holds, and a step's time."""
    import jax.numpy as jnp

    lengths = list(cfg.ragged_lengths)
    B, S = len(lengths), max(lengths)
    q, k, v = _cache(cfg, B, S, seed=1)
    n = jnp.asarray(lengths, jnp.int32)
    fns, _, paged = _steps(cfg, S)
    pk, pv, tables, table = _paged(cfg, k, v, n)
    per_token = 2 * cfg.kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    valid = sum(lengths) * per_token
    paged_bytes = table.bytes_in_use(
        num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype
    )
    return {
        "lengths": lengths,
        "valid_bytes": valid,
        "contiguous_bytes": B * S * per_token,
        "paged_bytes": paged_bytes,
        "seconds": {
            "split": _best(fns["split"], (q, k, v, n), cfg.repeats)[0],
            "paged": _best(paged, (q, pk, pv, tables, n), cfg.repeats)[0],
        },
    }


def _impls(rows: list[dict]) -> list[str]:
    """The implementations measured, in ``IMPLS + PALLAS_IMPLS`` order."""
    seen = {i for r in rows for i in r["seconds"]}
    return [i for i in IMPLS + PALLAS_IMPLS if i in seen]


def _progress(row: dict) -> str:
    cells = ", ".join(f"{i} {t:,.0f}" for i, t in row["tokens_per_s"].items())
    return f"S={row['S']:>6} B={row['B']:>3}: tokens/s {cells} (best splits {row['best_splits']})"


def targets(result: dict) -> list[dict]:
    out = []
    top = [r for r in result["rows"] if r["B"] == 1 and r["S"] == max(result["config"]["contexts"])]
    if top:
        r = top[0]
        ratio = r["seconds"]["unsplit"] / r["seconds"]["split"]
        name = f"split-K at S={r['S']}, B=1 (default splits) vs unsplit"
        ceiling = result["env"]["cpu_count"] / r["cores_busy"]["unsplit"]
        out.append({"target": name, "value": ratio, "goal": TARGET_SPLIT,
                    "met": ratio >= TARGET_SPLIT, "ceiling": ceiling})  # fmt: skip
    g = result["ragged"]
    ratio = g["paged_bytes"] / g["valid_bytes"]
    out.append({"target": "ragged batch: paged bytes / valid tokens' bytes", "value": ratio,
                "goal": TARGET_MEMORY, "met": ratio <= TARGET_MEMORY})  # fmt: skip
    return out


def markdown(result: dict) -> str:
    c, env = result["config"], result["env"]
    impls = _impls(result["rows"])
    lines = [
        f"# One decode step on {result['platform']} ({env['machine']}, {env['cpu_count']} cores)",
        "",
        f"`python bench/decode.py`, jax {env['jax']}, {c['dtype']}, {c['heads']} query heads over "
        f"{c['kv_heads']} kv heads of {c['head_dim']}, one query per row, every row holding S "
        f"keys; best of {c['repeats']} runs, one process on every core. Matmul: "
        f"{result['matmul_gflops']:.0f} GFLOP/s ({MATMUL_SIZE}^2). Load average "
        f"{env['load_average_at_start'][0]:.2f} at the start, {env['load_average_at_end'][0]:.2f} "
        "at the end.",
        "",
        "Decode tokens/s (and GB/s of K/V read):",
        "",
        "| S | B | "
        + " | ".join(LABELS[i] for i in impls)
        + " | best splits | split / unsplit | cores busy, 1 / default splits |",
        "|---|---|" + "---|" * (len(impls) + 3),
    ]
    for r in result["rows"]:
        cells = [
            f"{r['tokens_per_s'][i]:,.0f} ({r['read_gb_per_s'][i]:.1f})"
            if i in r["seconds"]
            else "-"
            for i in impls
        ]
        ratio = r["seconds"]["unsplit"] / r["seconds"]["split"]
        busy = f"{r['cores_busy']['unsplit']:.2f} / {r['cores_busy']['split']:.2f}"
        lines.append(f"| {r['S']:,} | {r['B']} | " + " | ".join(cells)
                     + f" | {r['best_splits']} | {ratio:.2f}x | {busy} |")  # fmt: skip
    worst = {i: max(r["rel_err_vs_unsplit"].get(i, 0.0) for r in result["rows"]) for i in impls
             if any(i in r["rel_err_vs_unsplit"] for r in result["rows"])}  # fmt: skip
    lines += ["", "Largest relative error against the unsplit step: "
              + ", ".join(f"{LABELS[i]} {e:.1e}" for i, e in worst.items()) + "."]  # fmt: skip
    g = result["ragged"]
    MiB = 2**20
    lines += [
        "",
        f"Ragged batch of {len(g['lengths'])} rows, lengths {g['lengths']} (pages of "
        f"{c['page_size']}):",
        "",
        "| cache | MiB | per valid token | step ms |",
        "|---|---|---|---|",
        f"| contiguous (B x max_len) | {g['contiguous_bytes'] / MiB:,.1f} | "
        f"{g['contiguous_bytes'] / g['valid_bytes']:.2f}x | {g['seconds']['split'] * 1e3:.2f} |",
        f"| paged (pages in use) | {g['paged_bytes'] / MiB:,.1f} | "
        f"{g['paged_bytes'] / g['valid_bytes']:.3f}x | {g['seconds']['paged'] * 1e3:.2f} |",
        "",
        "Targets:",
        "",
    ]
    for t in result["targets"]:
        lines.append(f"- {t['target']}: {t['value']:.3f} (goal {t['goal']}): "
                     + ("met" if t["met"] else "NOT met"))  # fmt: skip
        if "ceiling" in t and result["platform"] == "cpu" and t["ceiling"] >= 1:
            lines[-1] += (f"; the unsplit step already keeps the cores busy, so splits run side"
                          f" by side could gain at most {t['ceiling']:.2f}x")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["B"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.5), squeeze=False)
    for ax, B in zip(axes[0], batches, strict=True):
        rows = [r for r in result["rows"] if r["B"] == B]
        for i in _impls(result["rows"]):
            have = [r for r in rows if i in r["tokens_per_s"]]
            ax.plot([r["S"] for r in have], [r["tokens_per_s"][i] for r in have], "o-",
                    label=LABELS[i])  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="context S", title=f"batch {B}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("decode tokens/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(cfg: Config) -> dict:
    from importlib.metadata import version

    import jax

    if cfg.quick:
        cfg = dataclasses.replace(cfg, contexts=(1024, 4096), batches=(1, 4), repeats=3,
                                  ragged_lengths=(100, 1000, 3000))  # fmt: skip
    platform = jax.default_backend()
    started = time.perf_counter()
    env = {
        "jax": version("jax"),
        "cpu_count": os.cpu_count(),
        "machine": platform_lib.machine(),
        "load_average_at_start": os.getloadavg(),
    }
    rate = _matmul_rate(cfg.dtype)
    rows = sweep(cfg)
    result = {
        "platform": platform,
        "config": dataclasses.asdict(cfg),
        "env": env,
        "matmul_gflops": rate / 1e9,
        "rows": rows,
        "ragged": ragged(cfg),
    }
    env["load_average_at_end"] = os.getloadavg()
    result["targets"] = targets(result)
    result["wall_seconds"] = time.perf_counter() - started
    name = f"decode-{platform}" + ("" if cfg.dtype == "float32" else f"-{cfg.dtype}")
    write_report(result, cfg.out_dir, name + ("-quick" if cfg.quick else ""), markdown, plot)
    return result


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Config))
