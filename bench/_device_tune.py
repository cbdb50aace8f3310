"""The ``tune`` phase of ``bench/device.py``: the Pallas flash kernel's tiles and Triton launch
settings, swept per case; the winners go to ``attn/pallas/tuned.json`` for the device.

One item is one case of ``attn.pallas.tuning`` (head dim, dtype, mask class, length
class) at ``bench/gpu.py``'s shapes: bf16, MHA with ``N * H = 2048``, ``B = 4`` at 4K
and 1 at 16K; the masks causal, full and window + initial tokens
(``causal() & (sliding_window(1024) | initial_tokens(4))``, the ``sparse`` class).
The causal H = 128 cases come first (the kernel's target is 8K-32K causal; an
8K call takes the 16K entry, the nearest), then the full ones, H = 64, and the
sparse ones. Per item, every candidate passed to ``flash_attention(tiles=...)``
and timed as ``bench._device_common.best_seconds`` times (best of a few runs
after a warm-up, compiled ahead of time):

1. the defaults (``BLOCKS["gpu"]``), forward and forward + backward, and cuDNN
   (``jax.nn.dot_product_attention(implementation="cudnn")``, causal and full
   on a GPU) for the ratios;
2. the forward, by forward time, a coordinate search from the defaults: the
   tiles (``block_q x block_k``), then ``num_warps``, then ``num_stages``, each
   pass keeping the best so far;
3. the backward, by forward + backward time with the forward's winner: the
   dk/dv tiles, then the backward kernels' ``num_warps``, then ``num_stages``;
4. a guard: where the result is slower forward + backward than the defaults
   (the dq kernel shares the forward's tiles), the default forward with the
   backward's winner is timed too, and the fastest forward + backward of the
   three is kept: a tuned entry never slows training down.

Every candidate's output (forward) or gradients (forward + backward) must agree
with the defaults' within ``TOLERANCE`` (relative, in norm); one that does not,
or that fails to compile (Triton out of shared memory), is recorded and skipped.
An item stops trying candidates when ``ctx.deadline`` is closer than its last
candidate took, keeping the best so far (the row says how many were cut).

On the H200 (compiles of 0.5-1 s, ``bench/results/gpu-NVIDIA_H200.md``'s
times) an item takes about 10-16 s: 7 forward and 8-10 forward + backward
timings; the phase's ~170 s fit the 12 items' first 10-12. ``finish`` writes
the winners into the cache for the device kind, keeping other devices' (and
this device's other cases'); a dry run writes ``tuned-dry-run.json`` into the
output folder (the committed cache with the dry run's entries, under the
CPU's device kind ``"cpu"``) and never touches ``attn/pallas/tuned.json``.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench._device_common import best_seconds, grad_step, interpreted

TITLE = "The Pallas kernel's tiles and launch settings (tuning)"
WEIGHT = 0.38  # about 170 s of the run's 450 s
WINDOW, INITIAL_TOKENS = 1024, 4
WIDTH = 2048  # N * H: N = 16 at H = 128, 32 at H = 64 (bench/gpu.py's shapes)
MASK_CLASS = {"causal": "causal", "full": "full", "window_sinks": "sparse"}
JAX_NN_MASKS = ("causal", "full")  # what cuDNN can express
# (mask, H, T), most important first: a budget cut drops the tail.
CASES = [
    ("causal", 128, 16384),
    ("causal", 128, 4096),
    ("full", 128, 16384),
    ("causal", 64, 16384),
    ("window_sinks", 128, 16384),
    ("full", 128, 4096),
    ("causal", 64, 4096),
    ("window_sinks", 128, 4096),
    ("full", 64, 16384),
    ("full", 64, 4096),
    ("window_sinks", 64, 16384),
    ("window_sinks", 64, 4096),
]
# The candidates besides the defaults (block_q=128, block_k=64; dk/dv 64 x 64; 4 warps
# at H <= 64, else 8; 2 stages). Forward: FlashAttention-2's Hopper tiles. dk/dv: a
# key block of 128 with short query steps, as Triton's fused-attention tutorial; at
# H = 128 its fp32 dK and dV accumulators of 128 keys crowd the registers, so the
# tall tiles there are (32, 128) and (64, 128) only.
FWD_TILES = [(128, 128), (64, 64), (64, 128)]
BWD_TILES = {
    128: [(32, 64), (64, 128), (32, 128), (128, 64)],
    64: [(64, 128), (32, 128), (128, 64), (128, 128)],
}
WARPS = [4, 8]
FWD_STAGES = [3, 4]  # more stages hide the K/V loads; 4 may not fit 128 x 128 tiles
BWD_STAGES = [1, 3]  # the backward holds more tiles: fewer stages may fit better
TOLERANCE = 2e-2  # a candidate's output and gradients against the defaults' (bf16)
MAX_SECONDS = 0.5  # timed runs per candidate stop past this (after at least one)


def batch_for(T: int) -> int:
    """B = 4 up to 4K tokens, 2 at 8K, 1 beyond (``bench/gpu.py``'s)."""
    return max(1, min(4, 16384 // T))


def items(dry_run: bool) -> list[dict]:
    """One case each, most important first, with its candidate lists."""
    if dry_run:  # interpret mode: launch settings change nothing, so no pass of them
        cases = [("causal", 32, 64), ("window_sinks", 16, 64), ("full", 16, 64)]
        lists = dict(fwd_tiles=[[32, 32]], fwd_warps=[], fwd_stages=[],
                     bwd_tiles=[[32, 32]], bwd_warps=[], bwd_stages=[])  # fmt: skip
        shapes = dict(B=1, N=2, window=16)
        return [
            dict(name=f"{mask}-h{H}-t{T}", mask=mask, mask_class=MASK_CLASS[mask], H=H, T=T,
                 **shapes, **lists)
            for mask, H, T in cases
        ]  # fmt: skip
    return [
        dict(
            name=f"{mask}-h{H}-{T // 1024}k",
            mask=mask,
            mask_class=MASK_CLASS[mask],
            B=batch_for(T),
            N=WIDTH // H,
            H=H,
            T=T,
            window=WINDOW,
            fwd_tiles=[list(t) for t in FWD_TILES],
            fwd_warps=WARPS,
            fwd_stages=FWD_STAGES,
            bwd_tiles=[list(t) for t in BWD_TILES[H]],
            bwd_warps=WARPS,
            bwd_stages=BWD_STAGES,
        )
        for mask, H, T in CASES
    ]


def build_mask(item: dict):
    from attn import masks

    window = masks.sliding_window(item["window"]) | masks.initial_tokens(INITIAL_TOKENS)
    return {"causal": masks.causal(), "full": masks.full(),
            "window_sinks": masks.causal() & window}[item["mask"]]  # fmt: skip


def visible_pairs(item: dict) -> int:
    """Query-key pairs the item's mask lets through (T = S)."""
    import numpy as np

    T, w = item["T"], item["window"]
    if item["mask"] == "full":
        return T * T
    if item["mask"] == "causal":
        return T * (T + 1) // 2
    seen = np.arange(1, T + 1)  # row t sees t + 1 keys causally
    return int((np.minimum(seen, w) + np.clip(np.minimum(INITIAL_TOKENS, seen - w), 0, None)).sum())


def useful_flops(item: dict, mode: str) -> float:
    """4 B N H per visible pair; x3.5 with the backward (5 matmuls to the forward's 2)."""
    flops = 4.0 * item["B"] * item["N"] * item["H"] * visible_pairs(item)
    return flops * 3.5 if mode == "fwd+bwd" else flops


def default_tiles(H: int):
    """``BLOCKS["gpu"]`` with every launch setting spelled out (what a GPU gets without an
    entry): the sweep's start and its baseline."""
    from attn.pallas.blocks import BLOCKS

    d = BLOCKS["gpu"]
    warps = d.num_warps or (4 if H <= 64 else 8)
    return d._replace(
        num_warps=warps,
        bwd_num_warps=d.bwd_num_warps or warps,
        bwd_num_stages=d.num_stages if d.bwd_num_stages is None else d.bwd_num_stages,
    )


# attn.pallas.blocks.Blocks's fields in order (rows hold settings as lists), and those
# the forward pass runs with.
FIELDS = ("block_q", "block_k", "bwd_block_q", "bwd_block_k", "num_warps", "num_stages",
          "bwd_num_warps", "bwd_num_stages")  # fmt: skip
FWD_FIELDS = ("block_q", "block_k", "num_warps", "num_stages")


def describe(tiles) -> str:
    """``"fwd 128x64 w8 s2, bwd 64x64 w8 s2"`` of a ``Blocks`` or its list."""
    t = dict(zip(FIELDS, tiles, strict=True))
    return (f"fwd {t['block_q']}x{t['block_k']} w{t['num_warps']} s{t['num_stages']}, "
            f"bwd {t['bwd_block_q']}x{t['bwd_block_k']} w{t['bwd_num_warps']} "
            f"s{t['bwd_num_stages']}")  # fmt: skip


class Sweep:
    """One item's measurements: each (mode, setting) timed once, checked against the
    defaults', logged; candidates cut when the deadline is near."""

    def __init__(self, ctx, mask, args, ct):
        self.ctx, self.mask, self.args, self.ct = ctx, mask, args, ct
        self.ms: dict = {}  # (mode, relevant fields) -> ms, or None where it failed
        self.reference: dict = {}  # mode -> the defaults' outputs
        self.cost = {"fwd": 0.0, "fwd+bwd": 0.0}  # seconds the last of each mode took
        self.log: list[dict] = []
        self.cut = 0

    @staticmethod
    def relevant(mode: str, tiles) -> tuple:
        """What of ``tiles`` a mode runs: the forward's fields, or all."""
        return tuple(getattr(tiles, f) for f in FWD_FIELDS) if mode == "fwd" else tuple(tiles)

    def time(self, mode: str, tiles, required: bool = False) -> float | None:
        """``tiles``' best ms in ``mode`` (None: failed, wrong or cut); ``required`` ones (the
        defaults) are never cut, and their failure raises."""
        key = (mode, self.relevant(mode, tiles))
        if key in self.ms:
            return self.ms[key]
        if not required and self.ctx.left() < 1.2 * self.cost[mode]:
            self.cut += 1
            return None
        start = time.time()
        row = dict(mode=mode, tiles=list(tiles))
        try:
            row.update(self._measure(mode, tiles))
        except Exception as e:  # Triton out of shared memory, an unsupported setting
            if required:
                raise
            first = (str(e).strip().splitlines() or [""])[0]
            row["error"] = f"{type(e).__name__}: {first[:160]}"
        self.cost[mode] = time.time() - start
        self.log.append(row)
        self.ms[key] = row.get("ms")
        return self.ms[key]

    def _measure(self, mode: str, tiles) -> dict:
        import jax

        from attn.pallas import flash_attention

        def forward(q, k, v):
            return flash_attention(q, k, v, mask=self.mask, tiles=tiles, **interpreted())

        fn = forward if mode == "fwd" else grad_step(forward, (0, 1, 2))
        args = self.args if mode == "fwd" else (*self.args, self.ct)
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        compile_seconds = time.perf_counter() - start
        out = jax.block_until_ready(compiled(*args))
        error = None
        if mode in self.reference:
            error = rel_error(out, self.reference[mode])
            if not error <= TOLERANCE:
                return dict(error=f"wrong: relative error {error:.3g} > {TOLERANCE}",
                            compile_seconds=compile_seconds)  # fmt: skip
        else:
            self.reference[mode] = out
        seconds = best_seconds(lambda: jax.block_until_ready(compiled(*args)), self.ctx.repeats,
                               MAX_SECONDS)  # fmt: skip
        return dict(ms=seconds * 1e3, compile_seconds=compile_seconds, rel_error=error)

    def search(self, mode: str, best, variants):
        """The fastest of ``best`` and ``variants`` in ``mode``; None where none ran."""
        best_ms = self.time(mode, best)
        for tiles in variants:
            ms = self.time(mode, tiles)
            if ms is not None and (best_ms is None or ms < best_ms):
                best, best_ms = tiles, ms
        return None if best_ms is None else best


def variants(tiles, field: str, values: list) -> list:
    """``tiles`` with ``field`` set to each of ``values`` (``"tiles"``/``"bwd_tiles"``:
    ``[block_q, block_k]`` pairs of the forward's or the dk/dv kernel's)."""
    if field in ("tiles", "bwd_tiles"):
        prefix = "bwd_" if field == "bwd_tiles" else ""
        return [tiles._replace(**{f"{prefix}block_q": bq, f"{prefix}block_k": bk})
                for bq, bk in values]  # fmt: skip
    return [tiles._replace(**{field: value}) for value in values]


def rel_error(out, want) -> float:
    """The largest ``|out - want| / |want|`` (norms, float32) over the outputs' leaves."""
    import jax
    import jax.numpy as jnp

    def one(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))

    return max(one(a, b) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True))


def run_item(item: dict, ctx) -> dict:
    import jax
    import jax.numpy as jnp

    from attn.pallas import tuning

    started = time.time()
    mask = build_mask(item)
    B, T, N, H = item["B"], item["T"], item["N"], item["H"]
    key = tuning.case(H, H, jnp.bfloat16, mask, T, T).key
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, ct = (jax.random.normal(r, (B, T, N, H), jnp.bfloat16) for r in keys)
    sweep = Sweep(ctx, mask, (q, k, v), ct)
    default = default_tiles(H)
    result = dict(key=key, default=list(default))
    result["default_fwd_ms"] = sweep.time("fwd", default, required=True)
    result["default_fwd_bwd_ms"] = sweep.time("fwd+bwd", default, required=True)
    result.update(cudnn(item, ctx, mask_name=item["mask"], args=(q, k, v), ct=ct))

    # Each pass starts from a setting already timed: it returns one.
    fwd = default
    for field, values in (("tiles", item["fwd_tiles"]), ("num_warps", item["fwd_warps"]),
                          ("num_stages", item["fwd_stages"])):  # fmt: skip
        fwd = sweep.search("fwd", fwd, variants(fwd, field, values))
    # The forward's winner with the default backward may fail (the dq kernel has its
    # tiles) or be cut: then a backward variant, else the defaults, is the start.
    both = sweep.search("fwd+bwd", fwd, variants(fwd, "bwd_tiles", item["bwd_tiles"]))
    both = default if both is None else both
    for field, values in (("bwd_num_warps", item["bwd_warps"]),
                          ("bwd_num_stages", item["bwd_stages"])):  # fmt: skip
        both = sweep.search("fwd+bwd", both, variants(both, field, values))
    tuned = both
    if sweep.time("fwd+bwd", both) > result["default_fwd_bwd_ms"]:  # the guard
        fallback = default._replace(**{f: getattr(both, f) for f in FIELDS if "bwd_" in f})
        options = [t for t in (both, fallback, default) if sweep.time("fwd+bwd", t) is not None]
        tuned = min(options, key=lambda t: sweep.time("fwd+bwd", t))
    result.update(
        status="ok",
        tuned=list(tuned),
        forward_kept=sweep.relevant("fwd", tuned) == sweep.relevant("fwd", fwd),
        fwd_winner=list(fwd),  # by forward time alone (the entry's unless forward_kept is False)
        fwd_ms=sweep.time("fwd", tuned, required=True),
        fwd_bwd_ms=sweep.time("fwd+bwd", tuned, required=True),
        flops_fwd=useful_flops(item, "fwd"),
        flops_fwd_bwd=useful_flops(item, "fwd+bwd"),
        tried=sweep.log,
        failed=sum("error" in row for row in sweep.log),
        cut=sweep.cut,
        seconds=time.time() - started,
    )
    return result


def cudnn(item: dict, ctx, mask_name: str, args, ct) -> dict:
    """cuDNN's forward and forward + backward ms at the item's shape (None where it does not
    apply or fails, with the reason)."""
    import jax

    out = dict(cudnn_fwd_ms=None, cudnn_fwd_bwd_ms=None)
    if mask_name not in JAX_NN_MASKS:
        return dict(out, cudnn_note="not applicable: jax.nn has no initial tokens")
    if ctx.platform != "gpu":
        return dict(out, cudnn_note="not measured: cuDNN needs a GPU")

    def forward(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=mask_name == "causal",
                                            implementation="cudnn")  # fmt: skip

    programs = [("fwd", forward, args), ("fwd_bwd", grad_step(forward, (0, 1, 2)), (*args, ct))]
    try:
        for mode, fn, inputs in programs:
            compiled = jax.jit(fn).lower(*inputs).compile()
            seconds = best_seconds(lambda c=compiled, i=inputs: jax.block_until_ready(c(*i)),
                                   ctx.repeats, MAX_SECONDS)  # fmt: skip
            out[f"cudnn_{mode}_ms"] = seconds * 1e3
    except Exception as e:  # an unsupported shape on this cuDNN
        out["cudnn_note"] = f"failed: {type(e).__name__}: {str(e)[:160]}"
    return out


def _num(x, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}g}"


def markdown(rows: list[dict], info: dict) -> str:
    peak = info.get("peak_tflops")
    lines = [
        "Per case (`attn.pallas.tuning`'s key: head dim, dtype, mask class, length), bf16 MHA "
        "with N x H = 2048: the defaults (`BLOCKS['gpu']`) against the tuned setting "
        "(coordinate search: forward tiles, warps, stages by forward time; then the dk/dv "
        "tiles and the backward's warps and stages by forward + backward time). "
        "x cuDNN: the tuned kernel's speed as a share of cuDNN's (cuDNN ms / ours). "
        "TFLOP/s: useful (4 B N H per visible pair, x3.5 with the backward)"
        + (f"; % peak: of {peak:.0f} TFLOP/s." if peak else "."),
        "",
        "| case | key | B | fwd default ms | fwd tuned ms | speed-up | x cuDNN | TFLOP/s "
        "| % peak | fwd+bwd default ms | fwd+bwd tuned ms | speed-up | x cuDNN | TFLOP/s "
        "| % peak | tuned setting | tried / failed / cut |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        if r.get("status") != "ok":
            continue
        cells = []
        for mode, flops in (("fwd", r["flops_fwd"]), ("fwd_bwd", r["flops_fwd_bwd"])):
            tuned, default = r[f"{mode}_ms"], r[f"default_{mode}_ms"]
            cudnn_ms = r[f"cudnn_{mode}_ms"]
            tflops = flops / tuned / 1e9
            cells += [
                _num(default), _num(tuned), f"{default / tuned:.2f}x",
                "—" if cudnn_ms is None else f"{cudnn_ms / tuned:.2f}",
                _num(tflops), "—" if not peak else f"{100 * tflops / peak:.0f}%",
            ]  # fmt: skip
        setting = describe(r["tuned"])
        if not r["forward_kept"]:
            setting += " (the default forward: its winner was not faster with the backward)"
        tried = f"{len(r['tried'])} / {r['failed']} / {r['cut']}"
        lines.append(f"| {r['name']} | `{r['key']}` | {r['B']} | " + " | ".join(cells)
                     + f" | {setting} | {tried} |")  # fmt: skip
    failures = [(r["name"], row) for r in rows if r.get("status") == "ok"
                for row in r["tried"] if "error" in row]  # fmt: skip
    if failures:
        lines += ["", "Candidates skipped:", ""]
        lines += [f"- {name}, {row['mode']}, {describe(row['tiles'])}: {row['error']}"
                  for name, row in failures]  # fmt: skip
    return "\n".join(lines) + "\n"


def finish(rows: list[dict], info: dict, out_dir: Path) -> list[Path]:
    """Writes the winners into the tuning cache for ``info["kind"]`` (a dry run: into
    ``out_dir / "tuned-dry-run.json"``, from the committed cache); returns the file."""
    from attn.pallas import tuning
    from attn.pallas.blocks import Blocks

    entries = {}
    for r in rows:
        if r.get("status") != "ok":
            continue
        measured = dict(shape=[r["B"], r["T"], r["N"], r["H"]], mask=r["mask"], jax=info.get("jax"))
        for name, prefix in (("ms", ""), ("default_ms", "default_"), ("cudnn_ms", "cudnn_")):
            fwd, both = r.get(f"{prefix}fwd_ms"), r.get(f"{prefix}fwd_bwd_ms")
            if fwd is not None and both is not None:
                measured[name] = {"fwd": round(fwd, 4), "fwd+bwd": round(both, 4)}
        entries[r["key"]] = tuning.entry_of(Blocks(*r["tuned"]), measured)
    if not entries:
        return []
    if info.get("dry_run"):
        path = tuning.write(Path(out_dir) / "tuned-dry-run.json", info["kind"], entries,
                            base=tuning.CACHE)  # fmt: skip
    else:
        path = tuning.write(tuning.CACHE, info["kind"], entries)
    return [path]
