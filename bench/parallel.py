"""Benchmark: one training step under each parallelism, on 8 fake CPU devices.

For a small decoder (width 256, 2 softmax layers of 8 heads of 32, SwiGLU
width 1024, vocabulary 256) trained on MQAR batches of 16 x 256 tokens, it
compiles the step ``train.loop.train`` runs (``train.steps.make_train_step``:
AdamW, the state laid out by ``train.sharding``'s rules, the step under
``jax.set_mesh``) on each mesh and reports, against one device:

* the bytes each kind of collective moves per step and device, read from the
  compiled (partitioned) HLO: the operand sizes of every ``all-reduce``,
  ``all-gather``, ``reduce-scatter``, ``all-to-all`` and ``collective-permute``,
  times the trip count of the loops they sit in (the ring's steps). A
  collective inside a ``conditional`` (the ring's skipped steps) counts as if
  its branch ran, so for ``seq`` the figure is an upper bound;
* the memory per device from ``compiled.memory_analysis()``: arguments (the
  state and batch shards), temporaries, and the peak: arguments, temporaries
  and outputs less the buffers an output aliases (none: the step does not
  donate its state);
* the step time, the median of ``repeats`` steps after a warm-up. The 8 fake
  devices share this machine's cores, so times are for sanity only: the bytes
  and the memory are the figures that carry over to real devices.

Writes ``bench/results/parallel-cpu.{json,md,png}``.

    python bench/parallel.py            # sets XLA_FLAGS for 8 devices itself (a few minutes)
    python bench/parallel.py --quick    # two meshes, "-quick" files
    python bench/parallel.py --quick --width 64 --seq-len 64 --batch 8   # the smoke test's size
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# The fake devices must exist before JAX starts.
FLAG = "--xla_force_host_platform_device_count=8"
if FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: `python bench/parallel.py`
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import tyro  # noqa: E402

from bench import _sequence  # noqa: E402
from bench._report import write_report  # noqa: E402
from models import ModelConfig, pattern, presets  # noqa: E402
from train import sharding, steps  # noqa: E402
from train.config import OptimConfig, TrainConfig  # noqa: E402
from train.tasks import TaskConfig, make_task  # noqa: E402

MESHES = (
    "single device",
    "data=8",
    "fsdp=8",
    "data=2,fsdp=4",
    "data=4,seq=2",
    "data=2,fsdp=2,seq=2",
    "fsdp=4,seq=2",
    "seq=8",
)
QUICK_MESHES = ("single device", "data=2,fsdp=2,seq=2")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
DTYPE_BYTES.update({"f64": 8, "s64": 8, "u64": 8, "s16": 2, "u16": 2})


@dataclass(frozen=True)
class Config:
    """Benchmark settings."""

    quick: bool = False  # two meshes: a smoke test
    repeats: int = 3
    out_dir: str = "bench/results"
    width: int = 256  # D; the MLP is 4 D wide, heads are D / 32 (at least 2) of 32
    seq_len: int = 256  # T of the MQAR batches (16 pairs; at least 64)
    batch: int = 16  # B
    meshes: tuple[str, ...] = ()  # the meshes to measure; (): MESHES (with quick: QUICK_MESHES)
    families: bool = True  # also each fixed-state family's sharded form, both exchanges


def train_config(cfg: Config = Config()) -> TrainConfig:
    heads = max(cfg.width // 32, 2)
    return TrainConfig(
        task=TaskConfig(name="mqar", seq_len=cfg.seq_len, vocab_size=256, num_pairs=16),
        model=ModelConfig(
            width=cfg.width,
            mlp_width=4 * cfg.width,
            layers=pattern(("mha", "mha"), presets(num_heads=heads, head_dim=32)),
        ),
        optim=OptimConfig(lr=1e-3),
        steps=100,
        batch_size=cfg.batch,
    ).with_task_vocab()


# ----------------------------------------------------------------------------
# Collectives in the compiled HLO

_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z\-]+)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")


def shape_bytes(text: str) -> int:
    """Bytes of an HLO shape (an array or a tuple of arrays), e.g. ``f32[8,4]{1,0}``."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def parse_hlo(text: str) -> tuple[dict, str]:
    """``({computation: [instruction dicts]}, entry name)`` of an HLO module's text."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            name, shape, op, rest = m.groups()
            comps[current].append({"name": name, "shape": shape, "op": op, "rest": rest})
    return comps, entry


def collective_bytes(text: str) -> dict[str, dict[str, int]]:
    """Per kind of collective: ``{"count", "bytes"}`` executed per step and device.

    Operand bytes are those of the operands' shapes (looked up by name); a
    collective in a while loop counts its known trip count times; in a
    conditional, the branch moving the most counts once (an upper bound).
    """
    comps, entry = parse_hlo(text)
    shapes = {i["name"]: i["shape"] for body in comps.values() for i in body}

    def operands(rest: str) -> int:
        args = rest.split(")", 1)[0]
        return sum(shape_bytes(shapes.get(n, "")) for n in re.findall(r"%([\w.\-]+)", args))

    def add(a, b, times=1):
        for kind, v in b.items():
            slot = a.setdefault(kind, {"count": 0, "bytes": 0})
            slot["count"] += times * v["count"]
            slot["bytes"] += times * v["bytes"]
        return a

    def total(comp: str, seen=()) -> dict:
        out = {}
        for i in comps.get(comp, []):
            op = i["op"].removesuffix("-start")
            if op in COLLECTIVES:
                add(out, {op: {"count": 1, "bytes": operands(i["rest"])}})
            elif op == "while":
                body = re.search(r"body=%([\w.\-]+)", i["rest"]).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', i["rest"])
                add(out, total(body, (*seen, comp)), int(trips.group(1)) if trips else 1)
            elif op == "conditional":
                names = re.search(r"branch_computations=\{([^}]*)\}", i["rest"])
                names = re.findall(r"%([\w.\-]+)", names.group(1)) if names else []
                for key in ("true_computation", "false_computation"):
                    found = re.search(key + r"=%([\w.\-]+)", i["rest"])
                    names += [found.group(1)] if found else []
                branches = [total(n, (*seen, comp)) for n in names]
                if branches:
                    add(out, max(branches, key=lambda b: sum(v["bytes"] for v in b.values())))
            elif op in ("call", "async-start"):
                callee = re.search(r"(?:to_apply|calls)=%([\w.\-]+)", i["rest"])
                if callee and callee.group(1) not in seen:
                    add(out, total(callee.group(1), (*seen, comp)))
        return out

    return total(entry)


# ----------------------------------------------------------------------------
# One mesh


def measure(spec: str, cfg: TrainConfig, repeats: int) -> dict:
    """Compiles and times the sharded train step on the mesh ``spec``."""
    devices = jax.devices()[:1] if spec == "single device" else jax.devices()
    mesh = sharding.make_mesh(None if spec == "single device" else spec, devices)
    task = make_task(cfg.task)
    model, optimizer = steps.init_state(cfg, task.vocab_size)
    steps.place(mesh, model, optimizer)
    step, state = steps.make_train_step(mesh, model, optimizer)  # the step train() runs
    host = [task.batch(cfg.seed, "train", i, cfg.batch_size) for i in range(repeats + 1)]
    with jax.set_mesh(mesh):
        batches = [sharding.shard_batch(mesh, b) for b in host]
        t0 = time.perf_counter()
        compiled = step.update.lower(state, batches[0]).compile()
        compile_s = time.perf_counter() - t0
        state, out = compiled(state, batches[0])  # warm-up
        jax.block_until_ready(out)
        times = []
        for batch in batches[1:]:
            t0 = time.perf_counter()
            state, out = compiled(state, batch)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t0)
    memory = compiled.memory_analysis()
    coll = collective_bytes(compiled.as_text())
    args, temp = memory.argument_size_in_bytes, memory.temp_size_in_bytes
    return {
        "mesh": spec,
        "devices": len(devices),
        "step_ms": 1e3 * statistics.median(times),
        "compile_s": compile_s,
        "loss": float(out["loss"]),
        "collectives": coll,
        "collective_bytes": sum(v["bytes"] for v in coll.values()),
        "argument_bytes": args,
        "temp_bytes": temp,
        "output_bytes": memory.output_size_in_bytes,
        "alias_bytes": memory.alias_size_in_bytes,
        "peak_bytes": args + temp + memory.output_size_in_bytes - memory.alias_size_in_bytes,
    }


# ----------------------------------------------------------------------------
# Report


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def markdown(result: dict) -> str:
    meta, rows = result["meta"], result["rows"]
    lines = [
        "# One training step per parallelism on 8 fake CPU devices",
        "",
        f"Decoder of width {meta['width']}, {meta['layers']} softmax layers "
        f"({max(meta['width'] // 32, 2)} heads of 32), "
        f"{meta['params']:,} parameters; AdamW; batch {meta['batch']} x {meta['seq_len']} "
        f"tokens of MQAR; float32. `python bench/parallel.py` (jax {meta['jax']}, "
        f"{meta['cpu_count']} cores, load average {meta['load_before']} before, "
        f"{meta['load_after']} after; {result['wall_seconds']:.0f} s).",
        "",
        "Collective bytes: operand bytes per device and step, from the compiled HLO "
        "(loops times their trip counts; the ring's conditional steps counted as taken, an "
        "upper bound). Memory per device from `compiled.memory_analysis()`: arguments "
        "(state and batch shards), temporaries, and args + temp + output - aliased "
        "buffers (the step donates none). The 8 devices share the cores, so step times are "
        "for sanity only.",
        "",
        "| mesh | all-reduce | all-gather | reduce-scatter | collective-permute | all-to-all "
        "| total MiB | args MiB | temp MiB | peak MiB | step ms | loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = []
        for kind in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute"):
            v = r["collectives"].get(kind)
            cells.append("-" if v is None else f"{_mib(v['bytes'])} ({v['count']})")
        v = r["collectives"].get("all-to-all")
        cells.append("-" if v is None else f"{_mib(v['bytes'])} ({v['count']})")
        lines.append(
            f"| {r['mesh']} | {' | '.join(cells)} | {_mib(r['collective_bytes'])} | "
            f"{_mib(r['argument_bytes'])} | {_mib(r['temp_bytes'])} | {_mib(r['peak_bytes'])} | "
            f"{r['step_ms']:.0f} | {r['loss']:.4f} |"
        )
    lines += [
        "",
        "Collective cells: MiB (number of collectives executed). The loss column is the "
        "warm-up step's; it agrees across meshes (the same step, up to float rounding).",
    ]
    lines += _sequence.markdown(result.get("families", []))
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["mesh"] for r in rows]
    bottom = np.zeros(len(rows))
    for kind in COLLECTIVES:
        values = np.array([r["collectives"].get(kind, {}).get("bytes", 0) / 2**20 for r in rows])
        if values.any():
            ax1.barh(names, values, left=bottom, label=kind)
            bottom += values
    ax1.set_xlabel("collective MiB per device and step")
    ax1.legend(fontsize=7)
    ax1.invert_yaxis()
    ax2.barh(names, [r["argument_bytes"] / 2**20 for r in rows], label="arguments")
    ax2.barh(
        names,
        [r["temp_bytes"] / 2**20 for r in rows],
        left=[r["argument_bytes"] / 2**20 for r in rows],
        label="temporaries",
    )
    ax2.set_xlabel("MiB per device")
    ax2.legend(fontsize=7)
    ax2.invert_yaxis()
    ax2.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(cfg: Config) -> None:
    assert jax.device_count() == 8, f"expected 8 fake devices, got {jax.devices()}"
    t_begin = time.perf_counter()
    tc = train_config(cfg)
    meshes = cfg.meshes or (QUICK_MESHES if cfg.quick else MESHES)
    meta = {
        "jax": jax.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "width": tc.model.width,
        "layers": len(tc.model.layers),
        "batch": tc.batch_size,
        "seq_len": tc.task.seq_len,
        "repeats": cfg.repeats,
        "load_before": round(os.getloadavg()[0], 2),
    }
    meta["params"] = steps.count_params(steps.build_model(tc, make_task(tc.task).vocab_size))
    rows = []
    for spec in meshes:
        row = measure(spec, tc, cfg.repeats)
        rows.append(row)
        print(
            f"{spec:>22}: {row['collective_bytes'] / 2**20:8.2f} MiB collectives, "
            f"{row['peak_bytes'] / 2**20:8.2f} MiB/device, {row['step_ms']:7.0f} ms/step "
            f"(compiled in {row['compile_s']:.0f} s)",
            flush=True,
        )
    families = _sequence.family_rows(collective_bytes, cfg.quick) if cfg.families else []
    meta["load_after"] = round(os.getloadavg()[0], 2)
    result = {
        "meta": meta,
        "rows": rows,
        "families": families,
        "wall_seconds": time.perf_counter() - t_begin,
        "config": dataclasses.asdict(cfg),
    }
    write_report(
        result, cfg.out_dir, "parallel-cpu" + ("-quick" if cfg.quick else ""), markdown, plot
    )


if __name__ == "__main__":
    main(tyro.cli(Config))
