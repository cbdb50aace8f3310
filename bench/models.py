"""Benchmark: the models of each attention kind, sized alike, decoding on this machine.

For a small reference decoder of each kind (width 256, 4 layers, vocabulary
256, N = 8 heads of H = 32, float32) it reports:

* parameters;
* decode-cache bytes: per token (what grows with the context) and fixed (what
  does not: ring buffers, linear-attention states), from
  ``models.cache_bytes`` on abstract caches (``jax.eval_shape``), and the total
  for one 4096-token sequence;
* tokens/s of ``models.generate`` (greedy, a 16-token prompt, 128 new tokens)
  at batch 1 and 8: compiled and warmed up first, then the best of
  ``repeats`` runs (the best resists other processes sharing the CPU; the
  load average is recorded too).

Writes ``<out_dir>/models-cpu.json`` and ``.md``.

    python bench/models.py             # the full run (about 2-3 minutes on 2 cores)
    python bench/models.py --quick     # smoke test: two kinds, batch 1, "-quick" files
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: `python bench/models.py`
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import tyro  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402

WIDTH, LAYERS, VOCAB = 256, 4, 256
PROMPT, NEW_TOKENS = 16, 128
CONTEXT = 4096  # the sequence length of the "total cache" column

# N * H = D: the usual sizing. MLA: latent rank 64 + RoPE key 16 per token,
# against 2 x 8 x 32 = 512 values for MHA.
PRESETS = models.presets(
    num_heads=8,
    head_dim=32,
    gqa_kv_heads=2,
    window=64,
    num_initial_tokens=4,
    global_positions=(0,),
    kv_rank=64,
    q_rank=128,
    rope_head_dim=16,
    chunk_size=64,
)
KINDS = {
    "mha": ("mha",) * LAYERS,
    "gqa (K=2)": ("gqa",) * LAYERS,
    "mqa": ("mqa",) * LAYERS,
    "mla (R=64)": ("mla",) * LAYERS,
    "window 64 + 4 initial tokens": ("streaming",) * LAYERS,
    "linear (elu+1)": ("linear",) * LAYERS,
    "linear + decay": ("linear_decay",) * LAYERS,
    "hybrid": ("linear_decay", "streaming", "mla", "gqa"),
}
QUICK_KINDS = ("gqa (K=2)", "hybrid")


@dataclass(frozen=True)
class Config:
    """Benchmark settings."""

    quick: bool = False  # two kinds, batch 1, one timed run: a smoke test
    repeats: int = 5
    new_tokens: int = NEW_TOKENS  # tokens generated per timed run
    kinds: tuple[str, ...] = ()  # names of KINDS to measure; (): all (with quick: QUICK_KINDS)
    out_dir: Path = ROOT / "bench" / "results"


def build(names) -> models.Decoder:
    config = models.ModelConfig(
        vocab_size=VOCAB, width=WIDTH, layers=models.pattern(names, PRESETS)
    )
    return models.Decoder(config, rngs=nnx.Rngs(0))


def parameter_count(model) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def cache_sizes(model) -> tuple[int, int]:
    """``(bytes per token, fixed bytes)`` of one sequence's cache, from abstract caches."""

    def size(max_len):
        return models.cache_bytes(jax.eval_shape(lambda: model.init_cache(1, max_len)))

    # Ring buffers stop growing once max_len passes initial tokens + window; measure beyond.
    a, b = size(CONTEXT), size(2 * CONTEXT)
    per_token = (b - a) // CONTEXT
    return per_token, a - per_token * CONTEXT


def tokens_per_second(model, batch: int, repeats: int, new_tokens: int = NEW_TOKENS) -> float:
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (batch, PROMPT)), jnp.int32)
    jax.block_until_ready(models.generate(model, prompt, new_tokens))  # compile + warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(models.generate(model, prompt, new_tokens))
        best = min(best, time.perf_counter() - start)
    return batch * new_tokens / best


def markdown(rows, meta) -> str:
    new_tokens = meta.get("new_tokens", NEW_TOKENS)
    lines = [
        f"# Models on CPU ({meta['devices']})",
        "",
        f"Decoders of width {WIDTH}, {LAYERS} layers, vocabulary {VOCAB}, N=8 heads of H=32, "
        f"float32. Generation: greedy, {PROMPT}-token prompt, {new_tokens} new tokens, "
        f"`models.generate` under jit, best of {meta['repeats']} runs after warm-up "
        f"(load average {meta['load_before']} before, {meta['load_after']} after).",
        "",
        "Cache bytes per token grow with the context; fixed bytes do not (ring buffers "
        f"of window + initial-token slots, linear-attention states). Total: one {CONTEXT}-token "
        "sequence. Stored positions (int32 per slot) are bookkeeping, not counted.",
        "",
        "| model | layers | params | cache B/token | cache fixed B | cache @4096 | "
        "tok/s B=1 | tok/s B=8 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        tps8 = "-" if r["tokens_per_s_b8"] is None else f"{r['tokens_per_s_b8']:.0f}"
        lines.append(
            f"| {r['kind']} | {' '.join(r['layers'])} | {r['params']:,} | "
            f"{r['cache_bytes_per_token']:,} | {r['cache_fixed_bytes']:,} | "
            f"{r['cache_bytes_at_4096'] / 2**20:.2f} MiB | {r['tokens_per_s_b1']:.0f} | {tps8} |"
        )
    return "\n".join(lines) + "\n"


def main(cfg: Config) -> None:
    kinds = cfg.kinds or (QUICK_KINDS if cfg.quick else tuple(KINDS))
    repeats = 1 if cfg.quick else cfg.repeats
    meta = {
        "jax": jax.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "cpu_count": os.cpu_count(),
        "repeats": repeats,
        "new_tokens": cfg.new_tokens,
        "load_before": round(os.getloadavg()[0], 2),
    }
    rows = []
    t0 = time.perf_counter()
    for kind in kinds:
        model = build(KINDS[kind])
        per_token, fixed = cache_sizes(model)
        row = {
            "kind": kind,
            "layers": list(KINDS[kind]),
            "params": parameter_count(model),
            "cache_bytes_per_token": per_token,
            "cache_fixed_bytes": fixed,
            "cache_bytes_at_4096": per_token * CONTEXT + fixed,
            "tokens_per_s_b1": tokens_per_second(model, 1, repeats, cfg.new_tokens),
            "tokens_per_s_b8": None
            if cfg.quick
            else tokens_per_second(model, 8, repeats, cfg.new_tokens),
        }
        rows.append(row)
        print(
            f"{kind:>22}: {row['params']:>9,} params, {per_token:>6,} B/token, "
            f"{fixed:>8,} B fixed, {row['tokens_per_s_b1']:8.0f} tok/s (B=1)"
            + ("" if row["tokens_per_s_b8"] is None else f", {row['tokens_per_s_b8']:8.0f} (B=8)"),
            flush=True,
        )
    meta["load_after"] = round(os.getloadavg()[0], 2)
    meta["seconds"] = round(time.perf_counter() - t0, 1)
    name = "models-cpu" + ("-quick" if cfg.quick else "")
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    (cfg.out_dir / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (cfg.out_dir / f"{name}.md").write_text(markdown(rows, meta))
    print(f"wrote {cfg.out_dir / name}.json and .md in {meta['seconds']} s")


if __name__ == "__main__":
    main(tyro.cli(Config))
