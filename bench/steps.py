"""Benchmark: the training step of small models, as the main job runs them (one core per run).

For each variant of a comparison (``--config``, default the main job's
``configs/compare_mqar.py``: width 64, 2 layers, batch 64, 24 tokens; or
``configs/compare_lm.py``: width 128, 4 layers, batch 16, 256 bytes) it trains
``--steps`` updates with
``train.loop.train`` in a child process pinned to one core, two children at
once (the comparison's default ``--jobs 2``: both cores busy), and reports:

* tokens/s, as the loop counts it (training steps only: no compilation,
  evaluation or saving);
* achieved GFLOP/s: XLA's FLOP count of one forward + backward of the model
  on the batch (the optimizer's elementwise work not counted) times the steps
  per second, beside the matmul rate the same child measured on its core
  (a jitted f32 ``[B T, D] @ [D, 3 D]``, the q/k/v projection of the batch,
  and a ``[512, 512] @ [512, 512]``).

With ``--baseline-root DIR`` (a checkout of an earlier commit) every variant
also trains from that checkout, at the same time as this one on the other
core, the two swapping cores each round; the table gives both and their ratio.

    python bench/steps.py --baseline-root /tmp/base     # before/after (about 20 minutes)
    python bench/steps.py --variants mha linear --rounds 1   # a quick look
    python bench/steps.py --config configs/compare_lm.py --steps 20 --rounds 1 \
        --out-dir /tmp/steps                            # the language-modelling sizes

Writes ``<out_dir>/steps-cpu.json`` and ``.md``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: `python bench/steps.py`
    sys.path.insert(0, str(ROOT))

VARIANTS = (
    "mha",
    "gqa",
    "mla",
    "window",
    "linear",
    "linear_gated",
    "based",
    "hybrid",
    "gated_deltanet",
)

# One run in a child process: the code under test is whatever ``PYTHONPATH`` holds.
CHILD = r"""
import dataclasses, json, os, sys, tempfile, time
os.sched_setaffinity(0, {int(sys.argv[1])})
import jax, jax.numpy as jnp
from flax import nnx
from train import loop
from train.cli import load_config
from train.tasks import make_task
from train.variants import run_config
try:
    from train.steps import build_model, weighted_metrics
except ImportError:  # a baseline checkout from before train.steps
    from train.loop import build_model, weighted_metrics

variant, steps, repeats = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
compare = load_config(sys.argv[5])
config = run_config(compare, variant, compare.lrs[0], 0)
config = dataclasses.replace(
    config, steps=steps, eval_every=steps, ckpt_every=steps, target_accuracy=None
)
with tempfile.TemporaryDirectory() as workdir:
    summary = loop.train(config, workdir, progress=False)

task = make_task(config.task)
graphdef, params = nnx.split(build_model(config.with_task_vocab(), task.vocab_size))
batch = {k: jnp.asarray(v) for k, v in task.batch(0, "train", 0, config.batch_size).items()}

def loss(params):
    logits = nnx.merge(graphdef, params)(batch["tokens"])
    return weighted_metrics(logits, batch)[0]

flops = jax.jit(jax.grad(loss)).lower(params).compile().cost_analysis()["flops"]

def matmul_rate(m, k, n, repeats=200):
    a, b = jnp.ones((m, k)), jnp.ones((k, n))
    f = jax.jit(jnp.dot)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = f(a, b)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / repeats)
    return 2 * m * k * n / best

print(json.dumps({
    "tokens_per_s": summary["tokens_per_s"],
    "train_loss": summary["train_loss"],
    "flops_per_step": flops,
    "tokens_per_step": config.batch_size * config.task.seq_len,
    "matmul_projection": matmul_rate(
        config.batch_size * config.task.seq_len, config.model.width, 3 * config.model.width,
        repeats,
    ),
    "matmul_512": matmul_rate(512, 512, 512, max(repeats // 4, 1)),
}))
"""


@dataclass(frozen=True)
class Config:
    """Benchmark settings."""

    variants: tuple[str, ...] = ()  # (): VARIANTS for compare_mqar, else the config's own
    steps: int = 300  # updates per run (the first, which compiles, is not timed)
    rounds: int = 2  # runs per variant and code; the best is reported
    baseline_root: str = ""  # a checkout of the code to compare against ("": none)
    out_dir: Path = ROOT / "bench" / "results"
    matmul_repeats: int = 200  # matmuls per timed run of the matmul rate (the 512^3 one: 1/4)
    xla_flags: str = ""  # the children's XLA_FLAGS ("": none, XLA's full optimization)
    config: Path = ROOT / "configs" / "compare_mqar.py"  # the comparison whose models run


def child(cfg: Config, root: Path, core: int, variant: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(root), "XLA_FLAGS": cfg.xla_flags}
    argv = [str(core), variant, str(cfg.steps), str(cfg.matmul_repeats), str(cfg.config)]
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, *argv],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result(proc: subprocess.Popen, what: str) -> dict:
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def measure(cfg: Config) -> dict:
    """``{variant: {code: [run, ...]}}``: each round runs both codes at once, one per core."""
    codes = {"after": ROOT}
    if cfg.baseline_root:
        codes = {"before": Path(cfg.baseline_root).resolve(), **codes}
    runs = {v: {code: [] for code in codes} for v in cfg.variants}
    for r in range(cfg.rounds):
        for variant in cfg.variants:
            names = list(codes) if r % 2 == 0 else list(reversed(codes))
            if len(names) == 1:  # alone: the other core runs a second copy, as with 2 jobs
                names = names * 2
            procs = [child(cfg, codes[n], core, variant) for core, n in enumerate(names)]
            seen = set()
            for name, proc in zip(names, procs, strict=True):
                out = result(proc, f"{variant} ({name})")
                if name not in seen:
                    runs[variant][name].append(out)
                    seen.add(name)
            line = "  ".join(
                f"{n} {max(x['tokens_per_s'] for x in runs[variant][n]) / 1e3:6.1f}K tok/s"
                for n in codes
            )
            print(f"round {r + 1} {variant:>15}: {line}", flush=True)
    return runs


def summarize(runs: dict) -> list[dict]:
    rows = []
    for variant, by_code in runs.items():
        row = {"variant": variant}
        for code, results in by_code.items():
            best = max(results, key=lambda x: x["tokens_per_s"])
            steps_per_s = best["tokens_per_s"] / best["tokens_per_step"]
            row[code] = {
                **best,
                "ms_per_step": 1e3 / steps_per_s,
                "gflops": best["flops_per_step"] * steps_per_s / 1e9,
                "matmul_gflops": max(x["matmul_projection"] for x in results) / 1e9,
                "matmul_512_gflops": max(x["matmul_512"] for x in results) / 1e9,
            }
        if "before" in row:
            row["speedup"] = row["after"]["tokens_per_s"] / row["before"]["tokens_per_s"]
        rows.append(row)
    return rows


def table(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body]) + "\n"


def markdown(rows: list[dict], meta: dict) -> str:
    before = "before" in rows[0]
    head = ["variant", "GFLOP/step"]
    if before:
        head += ["before ms/step", "before tok/s", "before GFLOP/s"]
    head += ["ms/step", "tok/s", "GFLOP/s", "matmul GFLOP/s (proj / 512²)"]
    if before:
        head.append("speedup")
    body = []
    for r in rows:
        a = r["after"]
        line = [r["variant"], f"{a['flops_per_step'] / 1e9:.3f}"]
        if before:
            b = r["before"]
            line += [f"{b['ms_per_step']:.2f}", f"{b['tokens_per_s']:,.0f}", f"{b['gflops']:.1f}"]
        line += [
            f"{a['ms_per_step']:.2f}",
            f"{a['tokens_per_s']:,.0f}",
            f"{a['gflops']:.1f}",
            f"{a['matmul_gflops']:.0f} / {a['matmul_512_gflops']:.0f}",
        ]
        if before:
            line.append(f"{r['speedup']:.2f}x")
        body.append(line)
    intro = [
        "# Training steps of the main job's models on CPU (one core per run, both busy)",
        "",
        f"`python bench/steps.py{meta['args']}` on {meta['processor']} ({meta['cpu_count']} "
        f"cores), jax {meta['jax']}: the models of `{meta['config']}` ({meta['sizes']}), "
        f"{meta['steps']} updates of `train.loop.train` per run, best of "
        f"{meta['rounds']} rounds; two runs at once, each pinned to its own core"
        + (
            f" (before: {meta['baseline_commit']}, after: {meta['commit']}, side by side, "
            "swapping cores each round)"
            if before
            else ""
        )
        + f". Load average {meta['load_before']} before, {meta['load_after']} after.",
        "",
        "GFLOP/step: XLA's count for one forward + backward (not the optimizer). "
        f"Matmul: a jitted f32 `{meta['projection']}` (the q/k/v projection) and "
        "`[512,512] @ [512,512]`, measured by the same run on its core.",
        "",
    ]
    return "\n".join(intro) + table(head, body) + "\n"


def _commit(root) -> str | None:
    """The checkout's commit (short hash), or None where git cannot tell."""
    out = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or None


def _sizes(config_path: Path) -> tuple[dict, tuple[str, ...]]:
    """The comparison's sizes for the report, and its variants."""
    from train.cli import load_config

    compare = load_config(config_path)
    t = compare.train
    B, T, D = t.batch_size, t.task.seq_len, t.model.width
    sizes = {
        "sizes": f"width {D}, {compare.num_layers} layers, batch {B}, {T} tokens",
        "projection": f"[{B * T},{D}] @ [{D},{3 * D}]",
    }
    return sizes, compare.variants


def main(cfg: Config) -> None:
    import jax

    sizes, config_variants = _sizes(cfg.config)
    stem = Path(cfg.config).stem
    if not cfg.variants:
        default = VARIANTS if stem == "compare_mqar" else config_variants
        cfg = dataclasses.replace(cfg, variants=default)

    meta = {
        "jax": jax.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "steps": cfg.steps,
        "rounds": cfg.rounds,
        "baseline_root": cfg.baseline_root,
        "baseline_commit": _commit(cfg.baseline_root) if cfg.baseline_root else None,
        "commit": _commit(ROOT),
        "args": " --baseline-root DIR" if cfg.baseline_root else "",
        "load_before": round(os.getloadavg()[0], 2),
        "config": str(Path(cfg.config).resolve().relative_to(ROOT))
        if Path(cfg.config).resolve().is_relative_to(ROOT)
        else str(cfg.config),
        **sizes,
    }
    runs = measure(cfg)
    meta["load_after"] = round(os.getloadavg()[0], 2)
    rows = summarize(runs)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    name = "steps-cpu" if stem == "compare_mqar" else f"steps-{stem}-cpu"
    (cfg.out_dir / f"{name}.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=2) + "\n"
    )
    (cfg.out_dir / f"{name}.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main(tyro.cli(Config))
